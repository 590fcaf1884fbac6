"""The z-lab checkpoint format: round trips, both config layouts, and refusals with reasons."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_core.drafter import DFlashDrafter
from dflash_core.drafter_config import default_target_layer_ids
from dflash_core.errors import DrafterMismatchError, ModelLoadError
from dflash_core.testing import tiny_drafter, tiny_target


def _outputs(drafter):
    torch.manual_seed(0)
    noise = torch.randn(1, 16, 64)
    ctx = torch.randn(1, 30, 64 * len(drafter.target_layer_ids))
    with torch.no_grad():
        hidden = drafter(noise, torch.arange(30, 46), ctx, torch.arange(30))
        return drafter.logits(hidden, torch.randn(96, 64, generator=torch.Generator().manual_seed(1)))


def test_save_then_load_gives_identical_logits(tmp_path):
    drafter = tiny_drafter(tiny_target("llama"), layers=2)
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert torch.equal(_outputs(drafter), _outputs(loaded))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"block_size": 16, "mask_token_id": 3, "target_layer_ids": drafter.target_layer_ids}
    assert config["rope_theta"] == 10000.0  # what transformers 4.x (z-lab's loader) reads


@pytest.mark.parametrize("layout", ["nested", "top-level"])
def test_both_block_size_placements_load(tmp_path, layout):
    drafter = tiny_drafter(tiny_target("llama"), layers=1, block_size=8)
    drafter.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    if layout == "top-level":
        # Older z-lab checkpoints: block_size / target_layer_ids / mask_token_id at the top.
        dflash = raw.pop("dflash_config")
        raw.update(dflash)
    else:
        raw.pop("block_size")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert loaded.block_size == 8
    assert loaded.target_layer_ids == drafter.target_layer_ids
    assert torch.equal(_outputs(drafter), _outputs(loaded))


def test_parameter_names_are_those_of_the_z_lab_checkpoints():
    drafter = tiny_drafter(tiny_target("llama"), layers=1)
    names = set(drafter.state_dict())
    for expected in ("fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
                     "layers.0.self_attn.k_norm.weight", "layers.0.mlp.gate_proj.weight",
                     "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"):
        assert expected in names


def test_default_layer_spacing_matches_z_lab():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(30, 3) == [1, 14, 27]


def test_a_drafter_for_another_target_is_refused_with_the_reason():
    llama = tiny_target("llama", layers=4)
    drafter = tiny_drafter(llama)
    drafter.check_fits(4, 64, 96)
    with pytest.raises(DrafterMismatchError, match="hidden size 64 != target's 128"):
        drafter.check_fits(4, 128, 96)
    with pytest.raises(DrafterMismatchError, match="4-layer target, this one has 2"):
        drafter.check_fits(2, 64, 96)
    with pytest.raises(DrafterMismatchError, match="vocabulary 96 != target's 1000"):
        drafter.check_fits(4, 64, 1000)


def test_truncated_or_corrupted_weights_are_refused(tmp_path):
    drafter = tiny_drafter(tiny_target("llama"))
    drafter.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="truncated or corrupted"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_configs_that_are_not_dflash_drafters_are_refused(tmp_path):
    drafter = tiny_drafter(tiny_target("llama"))
    drafter.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        DFlashDrafter.from_pretrained(tmp_path)
    no_dflash = {k: v for k, v in raw.items() if k != "dflash_config"}
    no_dflash.pop("block_size")
    (tmp_path / "config.json").write_text(json.dumps(no_dflash))
    with pytest.raises(ModelLoadError, match="is this a DFlash drafter"):
        DFlashDrafter.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="expected"):
        DFlashDrafter.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 3, "layer_types": None}))
    with pytest.raises(ModelLoadError, match="do not match the config"):
        DFlashDrafter.from_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="no config.json"):
        DFlashDrafter.from_pretrained(tmp_path / "nowhere")
