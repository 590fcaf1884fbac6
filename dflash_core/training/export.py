"""Export a trained drafter in the z-lab DFlash format, with a model card.

``config.json`` is ``DrafterConfig.to_dict``: every field the drafter was loaded from (schema,
sliding windows, causality, extra ``dflash_config`` keys, RoPE) is written back where it was read,
``auto_map`` aside (it names remote code an export does not ship)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..drafter import DFlashDrafter, count_parameters
from ..hardware import hardware_summary


def attention_summary(drafter: DFlashDrafter) -> str:
    """What each layer's block attends to, in a few words (full / sliding window W / causal)."""
    specs = [spec.describe() for spec in drafter.layer_specs]
    if len(set(specs)) == 1:
        return f"{specs[0]} (every layer)"
    return "; ".join(f"layer {i}: {spec}" for i, spec in enumerate(specs))


def model_card(drafter: DFlashDrafter, info: dict[str, Any]) -> str:
    cfg = drafter.config
    lines = [
        "---",
        "library_name: dflash-studio",
        "tags: [dflash, speculative-decoding, block-diffusion, drafter]",
        f"base_model: {info.get('target', 'unknown')}",
        "---",
        "",
        f"# DFlash drafter for {info.get('target', 'its target')}",
        "",
        "A block-diffusion drafter in the z-lab DFlash format (config.json + safetensors), trained with",
        "DFlash Studio. It proposes a block of tokens in one forward pass from the target's hidden",
        "states; the target verifies the block, so the output is exactly the target's own.",
        "",
        "| | |",
        "|---|---|",
        f"| target | {info.get('target', '?')} |",
        f"| drafter layers | {len(drafter.layers)} ({count_parameters(drafter) / 1e6:.1f} M parameters) |",
        f"| target layers used | {cfg.target_layer_ids} |",
        f"| block size | {cfg.block_size} |",
        f"| attention | {attention_summary(drafter)} |",
        f"| RoPE | {cfg.qwen3.rope_parameters or {}} |",
        f"| mask token id | {cfg.mask_token_id} |",
        f"| draft vocabulary | {info.get('draft_vocabulary', 'the whole vocabulary')} |",
        f"| training data | {info.get('data', '?')} |",
        f"| training steps | {info.get('steps', '?')} |",
        f"| wall time | {info.get('wall_time', '?')} |",
        f"| hardware | {info.get('hardware', hardware_summary())} |",
    ]
    for key, value in info.get("measured", {}).items():
        lines.append(f"| {key} | {value} |")
    lines += [
        "",
        "## Serving",
        "",
        "vLLM: `--speculative-config '{\"method\": \"dflash\", \"model\": \"PATH\", \"num_speculative_tokens\": 15}'`",
        "",
        "SGLang: `--speculative-algorithm DFLASH --speculative-draft-model-path PATH`",
        "",
        "DFlash Studio: point a pair's `drafter = { path = \"PATH\" }` at this folder in `models.toml`.",
        "",
    ]
    if info.get("command"):
        lines += ["## Reproduce", "", "```", info["command"], "```", ""]
    return "\n".join(lines)


def export_drafter(drafter: DFlashDrafter, out_dir: str | Path, info: dict[str, Any]) -> Path:
    out = Path(out_dir)
    drafter = drafter.to(dtype=torch.bfloat16).cpu()
    drafter.save_pretrained(out, model_card=model_card(drafter, info))
    (out / "training_info.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    return out
