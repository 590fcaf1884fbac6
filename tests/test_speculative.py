"""The speculative loop on tiny random targets: lossless, exact budgets, caches that roll back."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_core.drafter import DFlashDrafter
from dflash_core.errors import ModelLoadError
from dflash_core.speculative import GenerationConfig, collect, stream
from dflash_core.target import FastTarget, HFTarget
from dflash_core.testing import PROMPTS, OracleDrafter, RecordingDrafter, tiny_drafter, tiny_target

def runners(model):
    return {"fast": FastTarget(model), "hf": HFTarget(model)}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("runner_kind", ["fast", "hf"])
def test_greedy_dflash_equals_greedy_ar_for_every_block_size(family, runner_kind):
    model = tiny_target(family)
    runner = runners(model)[runner_kind]
    drafter = tiny_drafter(model, layers=1)
    for prompt in PROMPTS:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=40, block_size=1).validated(16)))
        assert len(ar.token_ids) == 40
        for block in (1, 2, 4, 8, 16):
            cfg = GenerationConfig(max_new_tokens=40, block_size=block).validated(16)
            random_out = collect(stream(runner, drafter, prompt, cfg))
            assert random_out.token_ids == ar.token_ids, (family, runner_kind, block)
            oracle = OracleDrafter(drafter, list(prompt) + ar.token_ids)
            oracle_out = collect(stream(runner, oracle, prompt, cfg))
            assert oracle_out.token_ids == ar.token_ids, (family, runner_kind, block, "oracle")
            if block > 1:
                # The oracle's drafts are all accepted: every full cycle commits a whole block.
                full = [c.accept_len for c in oracle_out.cycles if len(c.drafted) == block - 1]
                assert full and all(length == block for length in full)


def test_oracle_accepts_everything_and_random_accepts_little():
    model = tiny_target("llama")
    runner = FastTarget(model)
    drafter = tiny_drafter(model)
    prompt = PROMPTS[0]
    cfg = GenerationConfig(max_new_tokens=64, block_size=16).validated(16)
    ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=64, block_size=1).validated(16)))
    oracle = collect(stream(runner, OracleDrafter(drafter, list(prompt) + ar.token_ids), prompt, cfg))
    rand = collect(stream(runner, drafter, prompt, cfg))
    assert oracle.tau > 10  # 63 tokens after the prefill in 4 cycles of 16
    assert rand.tau < 2


@pytest.mark.parametrize("runner_kind", ["fast", "hf"])
def test_stop_token_inside_a_block_stops_exactly_there(runner_kind):
    model = tiny_target("llama", seed=1)
    runner = runners(model)[runner_kind]
    drafter = tiny_drafter(model)
    prompt = PROMPTS[2]
    ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=48, block_size=1).validated(16)))
    # Pick a token that first occurs in the middle of the answer and call it a stop token.
    for index, token in enumerate(ar.token_ids):
        if index >= 5 and token not in ar.token_ids[:index]:
            break
    expected = ar.token_ids[: index + 1]
    oracle = OracleDrafter(drafter, list(prompt) + ar.token_ids)
    for d in (drafter, oracle):
        out = collect(stream(runner, d, prompt, GenerationConfig(max_new_tokens=48, block_size=16).validated(16), stop_ids=[token]))
        assert out.token_ids == expected
        assert out.finish_reason == "stop"
    ar_stop = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=48, block_size=1).validated(16), stop_ids=[token]))
    assert ar_stop.token_ids == expected


@pytest.mark.parametrize("max_new", [1, 2, 3, 15, 16, 17, 31, 50])
def test_never_more_than_max_new_tokens(max_new):
    model = tiny_target("qwen3")
    runner = FastTarget(model)
    drafter = tiny_drafter(model)
    prompt = PROMPTS[0]
    ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=64, block_size=1).validated(16)))
    oracle = OracleDrafter(drafter, list(prompt) + ar.token_ids)
    for d in (drafter, oracle):
        out = collect(stream(runner, d, prompt, GenerationConfig(max_new_tokens=max_new, block_size=16).validated(16)))
        assert out.token_ids == ar.token_ids[:max_new]
        assert out.finish_reason == "length"
        assert out.events[-1].tokens_so_far == max_new


@pytest.mark.parametrize("runner_kind", ["fast", "hf"])
def test_caches_hold_exactly_the_committed_positions_after_every_cycle(runner_kind):
    model = tiny_target("llama", seed=2)
    runner = runners(model)[runner_kind]
    base = tiny_drafter(model)
    prompt = PROMPTS[0]
    ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=60, block_size=1).validated(16)))
    # Half-right drafts: an oracle that is wrong at every 3rd position, to exercise rollback.
    reference = list(prompt) + ar.token_ids
    noisy = [tok if i % 3 else (tok + 1) % 96 for i, tok in enumerate(reference)]
    for drafter in (RecordingDrafter(base), RecordingDrafter(OracleDrafter(base, noisy))):
        config = GenerationConfig(max_new_tokens=60, block_size=8).validated(16)
        lengths = []
        for event in stream(runner, drafter, prompt, config):
            if event.finish_reason is None:
                # The target caches every committed token except the newest (the next anchor).
                lengths.append((runner.length, len(prompt) + event.tokens_so_far - 1))
        assert all(got == want for got, want in lengths), lengths
        # The drafter's context cache covers exactly the positions before each block's anchor.
        assert drafter.calls and all(start == cached for start, cached in drafter.calls), drafter.calls


def test_prompt_longer_than_a_prefill_chunk_is_processed_in_pieces():
    from dflash_core import target as target_module

    model = tiny_target("llama")
    runner = FastTarget(model)
    prompt = [(7 * i) % 90 + 4 for i in range(300)]
    old = target_module.PREFILL_CHUNK
    try:
        target_module.PREFILL_CHUNK = 64
        chunked = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=12, block_size=1).validated(16)))
    finally:
        target_module.PREFILL_CHUNK = old
    whole = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=12, block_size=1).validated(16)))
    hf = collect(stream(HFTarget(model), None, prompt, GenerationConfig(max_new_tokens=12, block_size=1).validated(16)))
    assert chunked.token_ids == whole.token_ids == hf.token_ids


def test_the_generic_runner_passes_its_cache_under_the_name_transformers_declares():
    import warnings

    for family in ("llama", "qwen3"):
        model = tiny_target(family)
        prompt = [5, 9, 14, 22]
        fast = collect(stream(FastTarget(model), None, prompt, GenerationConfig(max_new_tokens=10, block_size=1).validated(16)))
        with warnings.catch_warnings():
            # transformers warns (FutureWarning) when the cache comes under its deprecated name.
            warnings.simplefilter("error", FutureWarning)
            warnings.simplefilter("error", DeprecationWarning)
            out = collect(stream(HFTarget(model), tiny_drafter(model), prompt,
                                 GenerationConfig(max_new_tokens=10, block_size=4).validated(16)))
        assert out.token_ids == fast.token_ids  # and the cache is really used: rollbacks included


def test_cancellation_ends_the_stream_within_one_cycle():
    model = tiny_target("llama")
    runner = FastTarget(model)
    drafter = tiny_drafter(model)
    polls = []

    def should_stop():
        polls.append(1)
        return len(polls) >= 3

    events = list(stream(runner, drafter, PROMPTS[0], GenerationConfig(max_new_tokens=200, block_size=16).validated(16),
                         should_stop=should_stop))
    assert events[-1].finish_reason == "cancelled"
    assert len(events) == 4  # prefill, two cycles, the cancellation


def test_adaptive_drafting_stays_lossless_and_verifies_fewer_slots():
    from dflash_core.speculative import measure_verify_costs

    model = tiny_target("llama", seed=6)
    runner = FastTarget(model)
    drafter = tiny_drafter(model)
    before = collect(stream(runner, None, PROMPTS[0], GenerationConfig(max_new_tokens=8, block_size=1).validated(16)))
    costs = measure_verify_costs(runner, 16, context=32, repeats=1)
    assert len(costs) == 16 and all(c > 0 for c in costs)
    # Measuring leaves nothing behind in the runner: a fresh sequence decodes exactly as before.
    after = collect(stream(runner, None, PROMPTS[0], GenerationConfig(max_new_tokens=8, block_size=1).validated(16)))
    assert after.token_ids == before.token_ids
    # Verifying is made to look expensive: an unconfident random drafter then verifies little.
    steep = [0.001 * (1 + 10 * s) for s in range(16)]
    for prompt in PROMPTS:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=40, block_size=1).validated(16)))
        cfg = GenerationConfig(max_new_tokens=40, block_size=16, adaptive=True).validated(16)
        out = collect(stream(runner, drafter, prompt, cfg, verify_costs=steep))
        assert out.token_ids == ar.token_ids
        assert max(len(c.drafted) for c in out.cycles) < 15


def test_monotone_fit_pools_what_decreases_and_keeps_what_does_not():
    from dflash_core.speculative import monotone

    assert monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert monotone([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert monotone([5.0, 1.0, 3.0]) == [3.0, 3.0, 3.0]
    rng = random.Random(1)
    for _ in range(200):
        values = [rng.random() for _ in range(rng.randrange(1, 12))]
        fit = monotone(values)
        assert fit == sorted(fit) and len(fit) == len(values)
        assert sum(fit) == pytest.approx(sum(values))  # pooling keeps the total


def test_a_draft_vocabulary_stays_lossless_and_round_trips(tmp_path):
    """Drafting over a subset of the vocabulary (cheaper LM head) never changes the output."""
    model = tiny_target("llama")
    runner = FastTarget(model)
    drafter = tiny_drafter(model)
    drafter.set_draft_vocab(torch.arange(0, 96, 2))  # even tokens only
    for prompt in PROMPTS:
        config = GenerationConfig(max_new_tokens=40, block_size=16).validated(16)
        spec = collect(stream(runner, drafter, prompt, config))
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=40, block_size=1).validated(16)))
        assert spec.token_ids == ar.token_ids
        assert all(t % 2 == 0 for c in spec.cycles for t in c.drafted)
    drafter.save_pretrained(tmp_path / "d")
    loaded = DFlashDrafter.from_pretrained(tmp_path / "d", dtype=model.dtype)
    assert torch.equal(loaded.draft_vocab, torch.arange(0, 96, 2))
    (tmp_path / "d" / "draft_vocab.json").write_text('{"token_ids": [1, 1]}')
    with pytest.raises(ModelLoadError, match="distinct token ids"):
        DFlashDrafter.from_pretrained(tmp_path / "d")


@pytest.mark.parametrize("bias", ["mlp_bias", "attention_bias"])
def test_a_llama_with_biases_the_fast_runner_lacks_runs_on_the_generic_runner(bias):
    """FastTarget applies no bias on the MLP or the output projection (attention_bias puts one on
    o_proj): such a Llama goes to HFTarget, whose greedy DFlash still equals greedy AR."""
    from transformers import LlamaForCausalLM

    from dflash_core.target import fast_path_reason, make_runner

    config = tiny_target("llama").config
    setattr(config, bias, True)
    torch.manual_seed(1)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # as tiny_target: clear greedy winners
        for name, module in model.named_modules():
            if getattr(module, "bias", None) is not None:
                module.bias.normal_(0, 0.5)  # transformers initialises biases to 0: make them count
    assert "biases on" in fast_path_reason(model)
    with pytest.raises(ValueError, match="biases"):  # what make_runner used to run into
        FastTarget(model)
    runner = make_runner(model)
    assert isinstance(runner, HFTarget)
    drafter = tiny_drafter(model)
    for prompt in PROMPTS[:2]:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=24, block_size=1).validated(16)))
        for block in (4, 16):
            out = collect(stream(runner, drafter, prompt, GenerationConfig(max_new_tokens=24, block_size=block).validated(16)))
            assert out.token_ids == ar.token_ids, (bias, block)


def test_the_drafting_meter_backs_off_while_drafting_does_not_pay_and_resets_when_it_does():
    from dflash_core.proposers import MAX_SKIP, DraftingMeter

    meter = DraftingMeter([0.01] * 16)  # the target alone: 100 tokens a second
    pattern = []
    for _ in range(8):  # every drafting cycle: 1 token in 50 ms (20 a second)
        assert meter.drafting()
        meter.record(1, 0.05)
        sat_out = 0
        while not meter.drafting():
            sat_out += 1
        pattern.append(sat_out)
        meter.skip = 0  # the drafting() that ended the loop drafted: record it next turn
    assert pattern == [1, 2, 4, 8, 16, 32, MAX_SKIP, MAX_SKIP]
    sat_out = []
    for _ in range(6):  # now 8 tokens in 30 ms a drafting cycle: the means recover and the meter stops sitting out
        sat_out.append(0)
        while not meter.drafting():
            sat_out[-1] += 1
        meter.record(8, 0.03)
    assert sat_out[-2:] == [0, 0] and meter.skip == 0 and meter.backoff == 1


def test_the_drafting_meter_weighs_drafting_against_the_targets_measured_cycles_once_it_has_them():
    from dflash_core.proposers import DraftingMeter

    meter = DraftingMeter([0.01] * 16)  # calibrated: the target alone at 100 tokens a second
    meter.record(1, 0.005)  # drafting: 200 a second, it pays against the calibration
    assert meter.drafting()
    meter.record_alone(0.002)  # but this run's cycles of the target alone take 2 ms (500 a second)
    meter.record(1, 0.005)
    assert not meter.drafting()  # drafting is slower than that: it sits out
    paying = DraftingMeter([0.001] * 16)  # calibrated at 1,000 a second: drafting never pays against it
    paying.record_alone(0.02)  # measured: 50 a second (a longer context, the loop's own work)
    paying.record(2, 0.025)  # 80 a second
    assert paying.drafting() and paying.drafting()


@pytest.mark.parametrize("shape", [{}, {"tree": True, "lookup": True}])
def test_a_carried_drafting_meter_goes_on_sitting_out_where_the_last_generation_left_it(shape):
    from dflash_core.proposers import DraftingMeter

    model = tiny_target("llama", seed=3)
    runner, drafter = FastTarget(model), tiny_drafter(model)
    costs = [0.01] * 16
    config = GenerationConfig(max_new_tokens=40, block_size=8, adaptive=True, **shape).validated(16)
    ar = collect(stream(runner, None, PROMPTS[0], GenerationConfig(max_new_tokens=40, block_size=1).validated(16)))
    meter = DraftingMeter(costs)
    meter.skip, meter.backoff = 4, 8  # an earlier generation's drafting did not pay: sitting out
    out = collect(stream(runner, drafter, PROMPTS[0], config, verify_costs=costs, meter=meter))
    assert out.token_ids == ar.token_ids and len(out.cycles) > 4
    assert all(not e.drafted or e.lookup_only for e in out.cycles[:4])  # the drafter sat the first four out
    assert out.cycles[4].drafted and not out.cycles[4].lookup_only  # then drafted again, as the meter said
    assert meter.tokens is not None  # and the meter passed in recorded it
    fresh = collect(stream(runner, drafter, PROMPTS[0], config, verify_costs=costs))
    assert fresh.cycles[0].drafted and not fresh.cycles[0].lookup_only  # a new meter drafts at once


def test_an_engine_keeps_one_drafting_meter_per_kind_of_generation(smollm2_engine):
    from dflash_core.request import Request

    engine, costs = smollm2_engine, [0.01] * 16
    engine.drafting_meters.clear()  # what earlier tests' generations left
    config = GenerationConfig(max_new_tokens=8, block_size=16, adaptive=True, tree=True, lookup=True)
    meter = engine.drafting_meter(config, costs)
    assert engine.drafting_meter(GenerationConfig(max_new_tokens=99, block_size=16, adaptive=True, tree=True,
                                                  lookup=True, seed=7), costs) is meter  # any length and seed
    assert engine.drafting_meter(GenerationConfig(max_new_tokens=8, block_size=16, adaptive=True), costs) is not meter
    engine.drafting_meters.clear()
    resolved = engine.resolve(Request(prompt="Say yes.", variant="dflash_tree_lookup_adaptive", max_new_tokens=8))
    collect(engine.stream_ids(resolved.prompt_ids, resolved.config))
    (used,) = engine.drafting_meters.values()  # the run's kind
    assert used.tokens is not None  # the run drafted into the engine's meter (a new meter drafts at once)
    engine.warm_up(max_new_tokens=4)
    assert engine.drafting_meters == {}  # the warm-up's generations leave no trace


def test_the_drafters_reach_shrinks_its_block_to_the_drafts_verified_and_grows_it_back():
    from dflash_core.proposers import DrafterReach

    reach = DrafterReach()
    assert reach.block(16) == 16 and reach.block(4) == 4  # nothing recorded: the whole block
    for _ in range(20):
        reach.record(0)  # nothing of the drafter's was worth verifying
    assert reach.block(16) == 2
    for _ in range(20):
        reach.record(2)
    assert reach.block(16) == 4  # room for one more draft than it verifies
    sizes = []
    for _ in range(30):  # the text grows predictable: every cycle verifies the whole block
        block = reach.block(16)
        sizes.append(block)
        reach.record(block - 1)
    assert sizes[0] == 4 and sizes[-1] == 16 and sizes == sorted(sizes)
    assert reach.block(8) == 8  # never more than the cycle may verify


class BlockRecordingDrafter(DFlashDrafter):
    """A real drafter that records the size of every block it fills."""

    def __init__(self, base: DFlashDrafter) -> None:
        super().__init__(base.config)
        self.load_state_dict(base.state_dict())
        self.blocks: list[int] = []

    def forward(self, noise_embedding, *args, **kwargs):  # noqa: D102
        self.blocks.append(noise_embedding.shape[1])
        return super().forward(noise_embedding, *args, **kwargs)


@pytest.mark.parametrize("variant", [dict(adaptive=True), dict(adaptive=True, tree=True, lookup=True)])
def test_an_adaptive_variant_drafts_smaller_blocks_where_few_drafts_pay_and_stays_lossless(variant):
    model = tiny_target("llama", seed=6)
    runner = FastTarget(model)
    drafter = BlockRecordingDrafter(tiny_drafter(model))
    # Verifying made to look expensive: a random drafter's drafts are then rarely worth a second row.
    steep = [0.001 * (1 + 10 * s) for s in range(16)]
    for prompt in PROMPTS[:2]:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=40, block_size=1).validated(16)))
        drafter.blocks.clear()
        cfg = GenerationConfig(max_new_tokens=40, block_size=16, **variant).validated(16)
        out = collect(stream(runner, drafter, prompt, cfg, verify_costs=steep))
        assert out.token_ids == ar.token_ids
        assert drafter.blocks[0] == 16 and max(drafter.blocks[1:]) <= 4, drafter.blocks
    # Every draft kept and verifying cheap: the blocks stay whole.
    reference = collect(stream(runner, None, PROMPTS[0], GenerationConfig(max_new_tokens=60, block_size=1).validated(16)))
    oracle = OracleDrafter(drafter, list(PROMPTS[0]) + reference.token_ids)
    sizes = []
    oracle_forward = oracle.forward

    def recorded(noise_embedding, *args, **kwargs):
        sizes.append(noise_embedding.shape[1])
        return oracle_forward(noise_embedding, *args, **kwargs)
    oracle.forward = recorded
    cfg = GenerationConfig(max_new_tokens=60, block_size=16, **variant).validated(16)
    out = collect(stream(runner, oracle, PROMPTS[0], cfg, verify_costs=[0.001] * 16))
    # (the last block is what is left of the 60 tokens)
    assert out.token_ids == reference.token_ids and len(sizes) > 2 and set(sizes[:-1]) == {16}, sizes


class SlowDrafter(DFlashDrafter):
    """A real drafter whose every pass takes 20 ms more: one that never pays for itself."""

    def __init__(self, base: DFlashDrafter) -> None:
        super().__init__(base.config)
        self.load_state_dict(base.state_dict())

    def forward(self, *args, **kwargs):  # noqa: D102
        import time

        time.sleep(0.02)
        return super().forward(*args, **kwargs)


@pytest.mark.parametrize("variant", [dict(adaptive=True), dict(adaptive=True, tree=True, lookup=True)])
def test_an_adaptive_variant_lets_a_drafter_that_does_not_pay_sit_out_and_stays_lossless(variant):
    model = tiny_target("llama", seed=6)
    runner = FastTarget(model)
    slow = SlowDrafter(tiny_drafter(model))
    for prompt in PROMPTS[:2]:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=60, block_size=1).validated(16)))
        cfg = GenerationConfig(max_new_tokens=60, block_size=16, **variant).validated(16)
        out = collect(stream(runner, slow, prompt, cfg, verify_costs=[0.002] * 16))  # the target alone: 2 ms a token
        assert out.token_ids == ar.token_ids
        drafted = [c for c in out.cycles if c.draft_s >= 0.02]  # the cycles that ran the drafter
        # it drafts, then sits out 1, 2, 4 ... cycles (prompt lookup's guesses alone, or the target alone)
        assert 1 <= len(drafted) <= 8 and len(out.cycles) - len(drafted) >= 3 * len(drafted), (len(drafted), len(out.cycles))
    # A drafter that pays (every draft kept, against a target made to look slow) never sits out.
    reference = collect(stream(runner, None, PROMPTS[0], GenerationConfig(max_new_tokens=60, block_size=1).validated(16)))
    oracle = OracleDrafter(tiny_drafter(model), list(PROMPTS[0]) + reference.token_ids)
    out = collect(stream(runner, oracle, PROMPTS[0], GenerationConfig(max_new_tokens=60, block_size=16, **variant)
                         .validated(16), verify_costs=[0.05] * 16))
    assert out.token_ids == reference.token_ids
    assert all(len(c.drafted) > 0 for c in out.cycles[1:] if c.position < len(PROMPTS[0]) + 59)
