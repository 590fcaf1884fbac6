"""Our drafters as transformers' own DFlash assistant: the same drafts, the same greedy loop."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_core import cli
from dflash_core.bench.hf_dflash import hf_dflash_generate
from dflash_core.drafter import DFlashDrafter, init_drafter_weights
from dflash_core.drafter_config import DrafterConfig
from dflash_core.errors import ModelLoadError
from dflash_core.hf_export import to_hf_assistant
from dflash_core.speculative import GenerationConfig, collect, stream
from dflash_core.target import HFTarget
from dflash_core.testing import tiny_drafter, tiny_target

BLOCK = 8
MAX_NEW = 40
# With this tiny target and seed-0 drafter the second prompt has cycles that accept whole blocks.
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 4, 5, 14, 15, 9]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama", vocab=96)
    return target, tiny_drafter(target, layers=1, block_size=BLOCK)


def test_the_assistant_drafts_what_our_drafter_drafts(pair):
    target, drafter = pair
    assistant = to_hf_assistant(drafter)
    hidden = target.config.hidden_size
    gen = torch.Generator().manual_seed(1)
    noise = torch.randn(1, BLOCK, hidden, generator=gen)
    context = torch.randn(1, 30, len(drafter.target_layer_ids) * hidden, generator=gen)
    head = target.lm_head.weight
    with torch.no_grad():
        ours = drafter.logits(drafter(noise, torch.arange(30, 30 + BLOCK), context, torch.arange(30)), head)
        theirs = target.lm_head(assistant(noise_embeds=noise, context_hidden_states=context,
                                          position_ids=torch.arange(30 + BLOCK)[None]).last_hidden_state)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def _full_block_cycles(lengths: list[int]) -> list[int]:
    """The cycles that began with at least a block of budget left (after the prefill's token):
    near the end the two loops cut the block at different moments (see bench/hf_dflash.py)."""
    out, generated = [], 1
    for length in lengths:
        if MAX_NEW - generated < BLOCK:
            break
        out.append(length)
        generated += length
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_transformers_dflash_equals_ours_token_for_token_and_cycle_for_cycle(pair, prompt):
    target, drafter = pair
    runner = HFTarget(target)
    ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=MAX_NEW, block_size=1).validated(BLOCK)))
    ours = collect(stream(runner, drafter, prompt, GenerationConfig(max_new_tokens=MAX_NEW, block_size=BLOCK).validated(BLOCK)))
    theirs = hf_dflash_generate(target, to_hf_assistant(drafter), prompt, MAX_NEW)
    assert theirs.token_ids == ours.token_ids == ar.token_ids
    assert _full_block_cycles(theirs.acceptance_lengths) == _full_block_cycles(ours.acceptance_lengths)
    assert sum(theirs.acceptance_lengths) <= MAX_NEW - 1


def test_acceptance_is_counted_not_assumed(pair):
    """The prompt with whole accepted blocks has tau well above 1 on both sides."""
    target, drafter = pair
    theirs = hf_dflash_generate(target, to_hf_assistant(drafter), PROMPTS[1], MAX_NEW)
    assert max(theirs.acceptance_lengths) == BLOCK and theirs.tau > 1.2


def test_export_hf_writes_a_folder_plain_transformers_loads(pair, tmp_path):
    from transformers import MuseGlimmerAssistantModel

    target, drafter = pair
    drafter.set_draft_vocab(torch.arange(0, 96, 2))
    drafter.save_pretrained(tmp_path / "ours")
    drafter.set_draft_vocab(None)
    out = tmp_path / "hf"
    assert cli.main(["export-hf", "--drafter", str(tmp_path / "ours"), "--out", str(out), "--dtype", "float32"]) == 0
    info = json.loads((out / "dflash_export.json").read_text())
    assert info["model_type"] == "muse_glimmer_assistant"
    assert any("draft vocabulary" in note for note in info["notes"])  # transformers drafts over all of it
    loaded = MuseGlimmerAssistantModel.from_pretrained(out).eval()
    assert loaded.config.target_layer_ids == drafter.target_layer_ids and loaded.config.block_size == BLOCK
    theirs = hf_dflash_generate(target, loaded, PROMPTS[1], MAX_NEW)
    ours = collect(stream(HFTarget(target), drafter, PROMPTS[1], GenerationConfig(max_new_tokens=MAX_NEW, block_size=BLOCK).validated(BLOCK)))
    assert theirs.token_ids == ours.token_ids
    assert _full_block_cycles(theirs.acceptance_lengths) == _full_block_cycles(ours.acceptance_lengths)


@pytest.mark.parametrize("options, named", [
    ({"is_causal": True}, "causal layers"),
    ({"layer_types": ["sliding_attention"], "sliding_window": 16, "is_causal": False}, "sliding-window layers"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_what_the_assistant_class_cannot_express_is_refused_by_name(options, named, tmp_path, capsys):
    target = tiny_target("llama", vocab=96)
    drafter = DFlashDrafter(DrafterConfig.for_target(target.config, num_layers=1, mask_token_id=3, **options))
    init_drafter_weights(drafter, seed=0)
    with pytest.raises(ModelLoadError, match=named):
        to_hf_assistant(drafter)
    drafter.save_pretrained(tmp_path / "d")
    assert cli.main(["export-hf", "--drafter", str(tmp_path / "d"), "--out", str(tmp_path / "o")]) == 2
    assert named in capsys.readouterr().err
