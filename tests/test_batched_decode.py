"""The continuous-batching greedy decoder of the self-distillation stage.

Its answers must be the target's own greedy answers, whatever else shares the batch: every answer
is compared with transformers ``generate()`` run on that prompt alone (fp32, where the two
computations agree to the last bit that matters)."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_core.target import FastTarget
from dflash_core.testing import tiny_target
from dflash_core.training.batched_decode import ContinuousBatchDecoder, greedy_decode_stream
from dflash_core.training.prompt_sources import Prompt
from dflash_core.training.features import FeatureStore, build_feature_cache
from dflash_core.training.selfdistill import SPENT_FILE, generate_responses, read_samples

MAX_NEW = 14


def _prompts(count: int, vocab: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(1, 40, (count,), generator=g)]  # very unequal on purpose
    return [(f"p{i}", torch.randint(4, vocab, (n,), generator=g).tolist()) for i, n in enumerate(lengths)]


def _alone(model, ids: list[int], eos: int | None) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                         pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def _common_token(model, prompts) -> int:
    """The token greedy decoding emits mid-answer for most prompts: as EOS it ends answers early."""
    counts: dict[int, int] = {}
    for _, ids in prompts:
        for tok in set(_alone(model, ids, None)[1:-2]):
            counts[tok] = counts.get(tok, 0) + 1
    return max(counts, key=counts.get)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_every_answer_equals_greedy_decoding_of_that_prompt_alone(family):
    model = tiny_target(family, vocab=96, layers=3, seed=3)
    prompts = _prompts(11, 96)
    eos = _common_token(model, prompts)
    answers = {a.key: (a.response, a.finished) for a in
               greedy_decode_stream(FastTarget(model), prompts, MAX_NEW, eos, slots=3, max_prompt_tokens=48)}
    assert set(answers) == {key for key, _ in prompts}  # 11 prompts through 3 slots: slots were refilled
    ended_early = 0
    for key, ids in prompts:
        expected = _alone(model, ids, eos)
        response, finished = answers[key]
        assert response == expected, key
        assert finished == (expected[-1] == eos)
        ended_early += finished and len(response) < MAX_NEW
    assert ended_early >= 2  # the test exercises slots freed before the others


def test_stop_starts_no_new_prompt_and_completes_those_under_way():
    model = tiny_target("llama", vocab=96, layers=2, seed=1)
    prompts = _prompts(9, 96, seed=2)
    seen: list[str] = []
    stream = greedy_decode_stream(FastTarget(model), prompts, MAX_NEW, None, slots=4, max_prompt_tokens=48,
                                  stop=lambda: bool(seen))
    for answer in stream:
        seen.append(answer.key)
        assert answer.response == _alone(model, dict(prompts)[answer.key], None) and not answer.finished
    assert sorted(seen) == sorted(key for key, _ in prompts[:4])  # the four that had started


def test_a_prompt_longer_than_allowed_is_refused_with_its_name():
    model = tiny_target("llama", vocab=96, layers=1)
    with pytest.raises(ValueError, match="'long' has 30 tokens; at most 20"):
        list(greedy_decode_stream(FastTarget(model), [("long", [5] * 30)], 4, None, slots=2, max_prompt_tokens=20))


def test_a_slot_reused_for_a_shorter_prompt_forgets_the_longer_one():
    model = tiny_target("llama", vocab=96, layers=2, seed=4)
    decoder = ContinuousBatchDecoder(FastTarget(model), slots=1, capacity=64)
    decoder.prefill(0, torch.arange(10, 40))
    first, _ = decoder.prefill(0, torch.tensor([7, 8, 9]))
    assert [first] == _alone(model, [7, 8, 9], None)[:1]
    assert int(decoder.step(torch.tensor([first]))[0][0]) == _alone(model, [7, 8, 9], None)[1]


class _Tokenizer:  # just what the generate stage uses: a chat template that is the raw prompt
    eos_token_id = 2
    pad_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return [int(t) for t in messages[-1]["content"].split()]


def _as_prompts(items):
    return [Prompt(key, "test", [{"role": "user", "content": " ".join(map(str, ids))}]) for key, ids in items]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_features_kept_while_decoding_are_the_targets_features_of_the_whole_sequence(family):
    model = tiny_target(family, vocab=96, layers=3, seed=8)
    runner = FastTarget(model)
    prompts = _prompts(7, 96, seed=9)
    eos = _common_token(model, prompts)
    answers = list(greedy_decode_stream(runner, prompts, MAX_NEW, eos, slots=3, max_prompt_tokens=48,
                                        layer_ids=[0, 2]))
    assert len(answers) == 7 and any(a.finished for a in answers)
    for a in answers:
        ids = dict(prompts)[a.key] + a.response
        runner.reset(len(ids))
        expected = runner.forward(torch.tensor(ids), [0, 2]).features
        assert a.features.shape == expected.shape == (len(ids), 2 * 64)
        torch.testing.assert_close(a.features, expected, atol=2e-5, rtol=1e-4)


def test_the_features_stage_reuses_features_kept_by_the_generate_stage(tmp_path):
    model = tiny_target("llama", vocab=96, layers=3, seed=10)
    runner = FastTarget(model)
    prompts = _as_prompts(_prompts(8, 96, seed=11))
    generate_responses(model, _Tokenizer(), prompts, tmp_path / "responses", batch_size=3, max_new_tokens=MAX_NEW,
                       runner=runner, feature_layers=[1, 2])
    samples = read_samples(tmp_path / "responses")
    assert all(s.features and s.features["layers"] == [1, 2] for s in samples)

    class Counting:  # the runner, counting the sequences it is asked to run
        def __init__(self, inner):
            self.inner, self.calls = inner, 0
            self.hidden_size = inner.hidden_size

        def reset(self, capacity):
            self.inner.reset(capacity)

        def forward(self, *args, **kwargs):
            self.calls += 1
            return self.inner.forward(*args, **kwargs)

    counting = Counting(runner)
    kept = build_feature_cache(counting, samples, [1, 2], tmp_path / "kept", responses_dir=tmp_path / "responses")
    assert counting.calls == 0
    computed = build_feature_cache(counting, samples, [1, 2], tmp_path / "computed")
    assert counting.calls == len(samples)
    assert [r.__dict__ for r in kept.records] == [r.__dict__ for r in computed.records]
    a = torch.cat([kept.sequence(i)[1] for i in range(len(kept))]).float()
    b = torch.cat([computed.sequence(i)[1] for i in range(len(computed))]).float()
    torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)  # both rounded to bf16 from fp32

    # Other layers than those kept, or a kept file cut short: the target computes them.
    build_feature_cache(counting, samples, [0, 2], tmp_path / "other")
    assert counting.calls == 2 * len(samples)
    binary = next((tmp_path / "responses").glob("*.features.bin"))
    binary.write_bytes(binary.read_bytes()[:-2])
    build_feature_cache(counting, samples, [1, 2], tmp_path / "cut", responses_dir=tmp_path / "responses")
    assert counting.calls == 2 * len(samples) + 1
    assert FeatureStore(tmp_path / "cut").num_tokens == computed.num_tokens


def test_generate_stage_gives_the_same_answers_on_both_paths(tmp_path):
    """The recipe's generate stage: our decoder (FastTarget runner) and transformers' batched
    generate() (any other model) write the same answers."""
    Tokenizer = _Tokenizer
    model = tiny_target("llama", vocab=96, layers=2, seed=6)
    prompts = _as_prompts(_prompts(10, 96, seed=7))
    ours = generate_responses(model, Tokenizer(), prompts, tmp_path / "ours", batch_size=3, max_new_tokens=MAX_NEW,
                              runner=FastTarget(model))
    theirs = generate_responses(model, Tokenizer(), prompts, tmp_path / "hf", batch_size=3, max_new_tokens=MAX_NEW)
    a = {s.id: s for s in read_samples(tmp_path / "ours")}
    b = {s.id: s for s in read_samples(tmp_path / "hf")}
    assert set(a) == set(b) == {p.id for p in prompts}
    assert all(a[k].response_ids == b[k].response_ids and a[k].finished == b[k].finished for k in a)
    assert ours["new_tokens"] == theirs["new_tokens"] > 0


def test_a_time_budget_counts_the_time_earlier_runs_spent(tmp_path):
    """Rerunning a generate stage whose time budget is spent (a resumed recipe) answers nothing
    more; a budget with time left goes on from what was spent, not from zero."""
    model = tiny_target("llama", vocab=96, layers=2, seed=6)
    prompts = _as_prompts(_prompts(8, 96, seed=7))
    out = tmp_path / "responses"
    first = generate_responses(model, _Tokenizer(), prompts[:4], out, batch_size=2, max_new_tokens=MAX_NEW,
                               time_budget_s=600.0, runner=FastTarget(model))
    assert first["new_tokens"] > 0 and len(read_samples(out)) == 4
    spent = json.loads((out / SPENT_FILE).read_text())["seconds"]
    assert 0.0 <= spent < 600.0
    (out / SPENT_FILE).write_text(json.dumps({"seconds": 600.0}))  # as if the budget ran out
    again = generate_responses(model, _Tokenizer(), prompts, out, batch_size=2, max_new_tokens=MAX_NEW,
                               time_budget_s=600.0, runner=FastTarget(model))
    assert again["new_tokens"] == 0 and len(read_samples(out)) == 4
    assert not list(out.glob("shard-00001*"))  # not even an empty shard
    more = generate_responses(model, _Tokenizer(), prompts, out, batch_size=2, max_new_tokens=MAX_NEW,
                              time_budget_s=1200.0, runner=FastTarget(model))
    assert more["new_tokens"] > 0 and len(read_samples(out)) == 8
    assert json.loads((out / SPENT_FILE).read_text())["seconds"] >= 600.0
