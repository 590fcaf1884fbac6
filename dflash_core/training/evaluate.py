"""Measure an exported drafter's acceptance length (tau) with the real engine loop."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ..drafter import DFlashDrafter
from ..engine import Engine
from ..evaluation import load_prompt_set, mean
from ..loading import LoadedPair, LoadedTarget
from ..registry import ModelPair, ModelSource
from ..request import Request
from ..speculative import collect
from .export import model_card


def evaluation_engine(target: LoadedTarget, drafter: DFlashDrafter) -> Engine:
    """An engine for a drafter that no registry pair names yet (the one training just wrote), so
    that its evaluation runs requests through ``Engine.resolve`` as every front end does: the
    drafter's own block size, the chat template's own thinking default."""
    device = str(target.runner.device)
    pair = ModelPair(name="evaluated-drafter", description="a drafter under evaluation", target=target.source,
                     drafter=ModelSource("path"), block_size=None, dtype=str(target.runner.dtype).removeprefix("torch."),
                     target_device=device, drafter_device=device, quantization=None, engine="auto")
    return Engine(LoadedPair(pair=pair, target=target, drafter=drafter))


def measure_tau(
    target: LoadedTarget,
    drafter: DFlashDrafter,
    prompts: list[str],
    max_new_tokens: int = 256,
    block_size: int = 16,
    temperature: float = 0.0,
    seed: int = 0,
) -> dict[str, float]:
    """Mean acceptance length over all cycles of all prompts (and the per-prompt mean)."""
    engine = evaluation_engine(target, drafter)
    lengths: list[int] = []
    per_prompt: list[float] = []
    for i, prompt in enumerate(prompts):
        resolved = engine.resolve(Request(prompt, max_new_tokens=max_new_tokens, block_size=block_size,
                                          temperature=temperature, seed=seed + i))
        result = collect(engine.stream_ids(resolved.prompt_ids, resolved.config))
        lengths.extend(result.acceptance_lengths)
        per_prompt.append(result.tau)
        print(f"\r  tau[{i + 1}/{len(prompts)}] {mean(lengths):.3f}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return {"tau": round(mean(lengths), 4), "tau_per_prompt_mean": round(mean(per_prompt), 4), "cycles": len(lengths)}


def evaluate_drafter(target: LoadedTarget, drafter_dir: str | Path, num_prompts: int = 40,
                     max_new_tokens: int = 256) -> dict[str, Any]:
    """tau on HumanEval (B=16, B=8, T=0.7) and on held-out chat prompts; written to the card."""
    drafter = DFlashDrafter.from_pretrained(drafter_dir, dtype=target.runner.dtype, device=target.runner.device)
    drafter.requires_grad_(False).eval().pack_for_inference()
    humaneval = load_prompt_set("humaneval")[:num_prompts]
    heldout = load_prompt_set("heldout")[:num_prompts]
    measured = {
        "tau_humaneval_b16": measure_tau(target, drafter, humaneval, max_new_tokens, 16)["tau"],
        "tau_heldout_b16": measure_tau(target, drafter, heldout, max_new_tokens, 16)["tau"],
        "tau_humaneval_b8": measure_tau(target, drafter, humaneval, max_new_tokens, 8)["tau"],
        "tau_humaneval_b16_t0.7": measure_tau(target, drafter, humaneval, max_new_tokens, 16, 0.7)["tau"],
    }
    out = Path(drafter_dir)
    info_file = out / "training_info.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    info["measured"] = {
        f"tau HumanEval B=16 (first {len(humaneval)}, greedy, {max_new_tokens} tokens)": measured["tau_humaneval_b16"],
        f"tau held-out chat B=16 ({len(heldout)} prompts)": measured["tau_heldout_b16"],
        "tau HumanEval B=8": measured["tau_humaneval_b8"],
        "tau HumanEval B=16, T=0.7 (match rule)": measured["tau_humaneval_b16_t0.7"],
    }
    info_file.write_text(json.dumps(info, indent=2, default=str) + "\n")
    (out / "README.md").write_text(model_card(drafter, info), encoding="utf-8")
    return measured
