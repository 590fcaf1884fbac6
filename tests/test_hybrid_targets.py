"""Hybrid targets (Gated DeltaNet linear attention + full attention: Qwen3.5/3.6, Qwen3.5-MoE,
Qwen3-Next) and gpt-oss (sliding-window layers with attention sinks, MoE) on the generic runner:
rolling back after a rejected draft restores the state of the kept tokens, at a cost that does
not grow with the context, so greedy DFlash equals greedy AR token for token."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from dflash_core import cli
from dflash_core.speculative import GenerationConfig, collect, stream
from dflash_core.target import HFTarget, fast_path_reason, make_runner
from dflash_core.testing import (
    exact_three_tokens,
    TINY_SLIDING_WINDOW,
    OracleDrafter,
    SometimesRightDrafter,
    chi_square_passes,
    hybrid_drafter,
    tiny_target,
)

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss"]
LINEAR = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
# Prompts longer and shorter than the sliding window (8), so rollbacks happen on both sides of it.
EOS = 91  # the end-of-sequence id of the saved targets (see save_target)
PROMPTS = [[5, 17, 42, 8, 9, 60], [11], [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 30, 31]]


def linear_states(runner: HFTarget) -> list[torch.Tensor]:
    """Every conv and recurrent state tensor the runner's cache holds, in layer order."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    states = []
    for layer in runner._cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            states += [layer.conv_states[0], layer.recurrent_states[0]]
    return states


@pytest.mark.parametrize("family", FAMILIES)
def test_these_families_run_on_the_generic_runner(family):
    model = tiny_target(family)
    assert fast_path_reason(model) is not None
    assert isinstance(make_runner(model), HFTarget)
    with pytest.raises(ValueError, match="engine='fast' cannot run this target"):
        make_runner(model, "fast")


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_restores_exactly_the_state_of_the_kept_tokens(family):
    """After any sequence of (append T tokens, keep some of them), the cache equals a fresh run
    over the kept tokens alone: the next logits and features, and the linear layers' states."""
    model = tiny_target(family)
    gen = torch.Generator().manual_seed(1)
    runner = HFTarget(model)
    runner.reset(256)
    committed = torch.randint(4, 90, (5,), generator=gen).tolist()
    runner.forward(torch.tensor(committed), None)
    # Every drop from 0 (all kept) to the whole block; 60+ positions cross the window many times.
    for step in range(14):
        append = 1 + step % 6
        new = torch.randint(4, 90, (append,), generator=gen).tolist()
        runner.forward(torch.tensor(new), [0, 3])
        keep = len(committed) + append - step % (append + 1)
        committed = (committed + new)[:keep]
        runner.truncate(keep)
        assert runner.length == len(committed)
    probe = torch.tensor([7, 8, 9])
    got = runner.forward(probe, [0, 1, 2, 3])
    fresh = HFTarget(model)
    fresh.reset(256)
    fresh.forward(torch.tensor(committed), None)
    want = fresh.forward(probe, [0, 1, 2, 3])
    # Not bit-identical: the replayed mixers' inputs come from a forward over the whole block,
    # whose matrix products round differently from the fresh run's (~1e-6). A state left as the
    # whole block made it is off by ~1e-2 (checked by breaking the restore).
    assert torch.allclose(got.logits, want.logits, atol=2e-5)
    assert torch.allclose(got.features, want.features, atol=2e-5)
    for a, b in zip(linear_states(runner), linear_states(fresh), strict=True):
        assert torch.allclose(a, b, atol=2e-5)
    assert len(linear_states(runner)) == (4 if family in LINEAR else 0)


@pytest.mark.parametrize("family", LINEAR)
def test_a_rollback_replays_only_the_kept_tokens_whatever_the_context(family):
    """The cost of rolling back: the linear layers' mixers rerun on the kept tokens, nothing else."""
    model = tiny_target(family)
    mixers = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
    seen: list[int] = []
    hooks = [m.register_forward_pre_hook(lambda _m, args, kwargs: seen.append(kwargs["hidden_states"].shape[1]),
                                         with_kwargs=True) for m in mixers]
    try:
        for context in (12, 150):
            runner = HFTarget(model)
            runner.reset(256)
            runner.forward(torch.arange(context) % 80 + 4, None)
            runner.forward(torch.arange(10) + 4, None)
            seen.clear()
            runner.truncate(context + 3)  # keep 3 of the 10
            assert seen == [3] * len(mixers)
            seen.clear()
            runner.forward(torch.arange(5) + 4, None)
            runner.truncate(context + 3 + 5)  # everything kept: nothing to replay
            assert seen == [5] * len(mixers)  # (the forward itself)
    finally:
        for hook in hooks:
            hook.remove()


def test_sliding_layers_keep_no_more_than_their_window_after_a_rollback():
    model = tiny_target("gpt_oss")
    runner = HFTarget(model)
    runner.reset(256)
    runner.forward(torch.arange(40) + 4, None)
    runner.forward(torch.arange(16) + 4, None)
    runner.truncate(45)
    sliding = [layer for layer in runner._cache.layers if getattr(layer, "is_sliding", False)]
    assert sliding and all(layer.keys.shape[-2] == TINY_SLIDING_WINDOW - 1 for layer in sliding)
    assert all(layer.get_seq_length() == 45 for layer in sliding)


def test_a_rollback_reaches_only_into_the_latest_forward():
    runner = HFTarget(tiny_target("qwen3_5"))
    runner.reset(64)
    runner.forward(torch.arange(6) + 4, None)
    runner.forward(torch.arange(4) + 4, None)
    with pytest.raises(ValueError, match="latest forward"):
        runner.truncate(5)
    with pytest.raises(ValueError, match="holds 10"):
        runner.truncate(11)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_dflash_equals_greedy_ar_with_many_rejected_drafts(family):
    model = tiny_target(family)
    runner = HFTarget(model)
    drafter = hybrid_drafter(model)
    rejected = partial = 0
    for prompt in PROMPTS:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=40, block_size=1).validated(16)))
        assert len(ar.token_ids) == 40
        reference = list(prompt) + ar.token_ids
        for block in (2, 5, 16):
            cfg = GenerationConfig(max_new_tokens=40, block_size=block).validated(16)
            for proposer in (drafter, SometimesRightDrafter(drafter, reference), OracleDrafter(drafter, reference)):
                out = collect(stream(runner, proposer, prompt, cfg))
                assert out.token_ids == ar.token_ids, (family, block, type(proposer).__name__)
                rejected += sum(c.num_accepted < len(c.drafted) for c in out.cycles)
                partial += sum(0 < c.num_accepted < len(c.drafted) for c in out.cycles)
    assert rejected > 100 and partial > 20  # rollbacks of every kind really happened


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss"])
def test_dflash_sampling_follows_the_targets_distribution(family):
    """As in test_sampling.py: the joint distribution of 3 sampled tokens over a 5-token
    vocabulary, chi-square at 1e-3. The prompt is longer than gpt-oss's window."""
    vocab, temperature = 5, 1.3
    model = tiny_target(family, vocab=vocab, layers=2, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)  # soften: every outcome has some mass
    runner = HFTarget(model)
    drafter = hybrid_drafter(model, block_size=4, mask_token_id=4, seed=2)
    prompt = [1, 3, 0, 2, 4, 1, 1, 3, 0, 2]

    expected = exact_three_tokens(model, prompt, temperature, vocab)
    n = 1200
    observed: dict[tuple, int] = {}
    accepted = rejected = 0
    for seed in range(n):
        config = GenerationConfig(max_new_tokens=3, block_size=4, temperature=temperature, seed=seed)
        out = collect(stream(runner, drafter, prompt, config.validated(4)))
        key = tuple(out.token_ids)
        observed[key] = observed.get(key, 0) + 1
        accepted += sum(c.num_accepted for c in out.cycles)
        rejected += sum(c.num_accepted < len(c.drafted) for c in out.cycles)
    assert set(observed) <= set(itertools.product(range(vocab), repeat=3))
    ok, stat, critical = chi_square_passes(observed, expected, n)
    assert ok, (stat, critical)
    assert accepted > 0.1 * n and rejected > 0.1 * n


def char_tokenizer():
    """One token per ASCII character from "!" to "z" (ids 0-89), as a BPE without merges:
    transformers loads Qwen3.5 folders with its own BPE tokenizer class whatever the folder
    declares, and that class reads this vocabulary but could not split the words of
    ``test_security.tiny_tokenizer``. Fewer ids than the targets' 96, so a random drafter finds
    a MASK id past the tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(33 + i): i for i in range(90)} | {"<unk>": 90, "<eos>": EOS}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")


def save_target(model, folder) -> None:
    """Save ``model`` with ``char_tokenizer``; its EOS becomes the tokenizer's, with a zero row in
    the LM head (a zero logit never wins greedy decoding), so generations run to their length."""
    with torch.no_grad():
        model.lm_head.weight[EOS] = 0
    for config in (model.config, model.config.get_text_config(), model.generation_config):
        config.eos_token_id = EOS
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)


def qwen3_5_checkpoint(folder) -> None:
    """A tiny Qwen3.5 folder laid out as the published checkpoints are: model_type ``qwen3_5``
    (text + vision configs), weights under ``model.language_model``."""
    import transformers

    text = tiny_target("qwen3_5").config.to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    model = transformers.Qwen3_5ForConditionalGeneration(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    save_target(model, folder)


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss", "qwen3_5_moe"])
def test_the_cli_runs_these_targets_losslessly(tmp_path, capsys, family):
    """A saved drafter for Qwen3.5 (in the published checkpoint layout) and gpt-oss; the
    registry's random drafter for Qwen3.5-MoE (whose config has no dense MLP width)."""
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    if family == "qwen3_5":
        qwen3_5_checkpoint(target_dir)
        assert json.loads((target_dir / "config.json").read_text())["model_type"] == "qwen3_5"
    else:
        save_target(tiny_target(family, layers=2), target_dir)
    if family == "qwen3_5_moe":
        drafter = "{ random = true, layers = 1, seed = 0 }\nblock_size = 8"
    else:
        from transformers import AutoModelForCausalLM

        hybrid_drafter(AutoModelForCausalLM.from_pretrained(target_dir), block_size=8).save_pretrained(drafter_dir)
        drafter = f'{{ path = "{drafter_dir}" }}'
    registry = tmp_path / "models.toml"
    registry.write_text(f'default = "p"\n[pairs.p]\ndescription = "tiny {family}"\n'
                        f'target = {{ path = "{target_dir}" }}\ndrafter = {drafter}\n'
                        'dtype = "float32"\ndevice = "cpu"\n')

    def generate(*extra: str) -> dict:
        args = ["--registry", str(registry), "generate", "--json", "--raw", "--prompt", "Hybrid-targets!",
                "--max-new-tokens", "48", *extra]
        assert cli.main(args) == 0
        return json.loads(capsys.readouterr().out)

    dflash, ar = generate(), generate("--mode", "ar")
    assert dflash["token_ids"] == ar["token_ids"] and len(ar["token_ids"]) == 48
    assert any(c["num_accepted"] < len(c["drafted"]) for c in dflash["cycles"])
