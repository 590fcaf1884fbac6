"""How far each weight format takes the target from its fp32 self: the figures docs/BENCHMARKS.md
cites for ``weights = "int8"``, ``"w8a8"``, ``"int4"`` and ``"w4a8"``.

    python scripts/weight_quality.py [--pair smollm2-135m] [--formats bf16,int8,w8a8] [--sequences 24]
                                     [--alphas 0.3,0.5,0.7,0.9] [--llama-like] [--down-rows] [--heads int8,w8a8]

Teacher-forced over prompt + answer sequences from the newest committed answer shard (the
target's own answers to training prompts: never HumanEval, nor the held-out set), each format
runs the engine's own eager kernels (``FastTarget`` with ``weights = FORMAT``, the pair's target
loaded in fp32; int4 and w4a8 on the GGUF's own Q4_1 blocks and Q8_0 head, as their pairs run them)
and is compared, position by position, with the fp32 target: how often the
greedy choice agrees, and the mean KL divergence of the next-token distributions
(KL(fp32 || format)). ``--alphas 0.5,0.7`` measures w8a8 again at each SmoothQuant alpha
(``weight_formats.SMOOTHING_ALPHA``, its default being the engine's). ``--down-rows`` measures w8a8
with the MLP's down projection's rows quantized too, ``--heads int8,w8a8`` with the LM head run each
way (what-ifs behind the engine's choices: docs/BENCHMARKS-AMD.md). ``--llama-like`` adds a simulation of llama.cpp's own activation rounding
(int8 weights per channel, rows rounded to int8 in blocks of 32, as its Q8 matrix products do)
for scale: not an engine format, plain PyTorch math on the same weights.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dflash_core.loading import gguf_q4_blocks, load_target
from dflash_core.registry import load_registry
from dflash_core.target import FastTarget
from dflash_core import target as target_module
from dflash_core import kernel_choice, weight_formats
from dflash_core.weight_formats import calibration_ids

SHARDS = Path(__file__).resolve().parents[1] / "assets" / "data" / "smollm2-answers"


def sequences(count: int, length: int) -> list[torch.Tensor]:
    shard = np.load(sorted(SHARDS.glob("shard-*.npz"))[-1])
    prompts = np.cumsum([0, *shard["prompt_lengths"]])
    answers = np.cumsum([0, *shard["answer_lengths"]])
    out = []
    for i in range(min(count, len(shard["prompt_lengths"]))):
        ids = np.concatenate([shard["prompt_ids"][prompts[i]:prompts[i + 1]], shard["answer_ids"][answers[i]:answers[i + 1]]])
        out.append(torch.tensor(ids[:length], dtype=torch.long))
    return out


@torch.inference_mode()
def logits_of(runner: FastTarget, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for ids in seqs:
        runner.reset(len(ids) + 16)
        out.append(runner.forward(ids, None).logits.float()[:-1])
    return out


def compare(reference: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, float]:
    positions = sum(len(r) for r in reference)
    agree = sum((r.argmax(-1) == g.argmax(-1)).sum().item() for r, g in zip(reference, got))
    kl = sum(F.kl_div(g.log_softmax(-1), r.log_softmax(-1), log_target=True, reduction="sum").item()
             for r, g in zip(reference, got))
    return {"top1_agreement": round(agree / positions, 4), "kl": round(kl / positions, 5), "positions": positions}


@torch.inference_mode()
def llama_like(model: torch.nn.Module, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The transformers model with int8 weights per channel and rows rounded in blocks of 32."""
    def rows_in_blocks(x: torch.Tensor) -> torch.Tensor:
        v = x.unflatten(-1, (-1, 32))
        s = v.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
        return ((v / s).round().clamp(-127, 127) * s).flatten(-2)

    linears = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in name]
    saved = [(m, m.weight.data, m.forward) for m in linears]
    try:
        for m in linears:
            w = m.weight.data.float()
            s = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
            m.weight.data = (w / s).round().clamp(-127, 127) * s
            m.forward = (lambda m: lambda x: F.linear(rows_in_blocks(x), m.weight, m.bias))(m)
        return [model(ids[None]).logits[0, :-1].float() for ids in seqs]
    finally:
        for m, weight, forward in saved:
            m.weight.data, m.forward = weight, forward


@torch.inference_mode()
def lm_head_as(runner: FastTarget, fmt: str, calibration: torch.Tensor):
    """``runner``'s LM head as ``fmt``: "int8" weight-only (what the aoti pairs run), or "w8a8"
    (rows quantized per row after smoothing factors from the final norm's outputs on the
    calibration text, as the layers' matrices)."""
    weight = runner.lm_head_weight.float()
    if fmt == "int8":
        return weight_formats.QuantizedLinear(weight_formats.Int8Weight(weight, runner.dtype))
    seen = []
    head = runner._lm_head
    runner._lm_head = lambda x: seen.append(x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()) or head(x)
    try:
        runner.reset(len(calibration) + 16)
        runner.forward(calibration, None)
    finally:
        runner._lm_head = head
    smoothing = weight_formats.smoothing_factors(torch.stack(seen).amax(0), weight)
    return weight_formats.QuantizedLinear(weight_formats.DynamicInt8Weight(weight, smoothing))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="smollm2-135m")
    parser.add_argument("--formats", default="bf16,int8,w8a8")
    parser.add_argument("--sequences", type=int, default=24)
    parser.add_argument("--length", type=int, default=384)
    parser.add_argument("--alphas", default="", help="w8a8 again at each of these SmoothQuant alphas")
    parser.add_argument("--llama-like", action="store_true")
    parser.add_argument("--down-rows", action="store_true", help="w8a8 again with the MLP's down projection's rows in int8 too")
    parser.add_argument("--heads", default="", help="w8a8 again with the LM head in each of these formats (int8, w8a8)")
    parser.add_argument("--out", default="runs/weight_quality")
    args = parser.parse_args()
    torch.set_num_threads(2)
    pair = load_registry().get(args.pair)
    loaded = load_target(pair.target, dtype="float32")  # the fp32 reference, eager
    seqs = sequences(args.sequences, args.length)
    reference = logits_of(loaded.runner, seqs)
    calibration = calibration_ids(loaded.tokenizer)
    results = {}
    for fmt in [f for f in args.formats.split(",") if f]:
        # "bf16": the default pair's target (the weights in bf16), from a copy: the fp32 ones stay
        model = loaded.model if fmt != "bf16" else copy.deepcopy(loaded.model).to(torch.bfloat16)
        # int4 and w4a8 on the GGUF's own blocks, their LM head too, as the pairs run them
        blocks = gguf_q4_blocks(loaded.source, model, fmt)
        runner = FastTarget(model, fmt, q4_blocks=blocks, calibration_ids=calibration)
        if blocks and "lm_head" in blocks and fmt in ("int4", "w4a8"):
            kernel_choice.file_head(runner)
        results[fmt] = {**compare(reference, logits_of(runner, seqs)), "runs": runner.weight_note}
        print(fmt, results[fmt], flush=True)
    engine_alpha = weight_formats.SMOOTHING_ALPHA
    for alpha in [float(a) for a in args.alphas.split(",") if a]:
        weight_formats.SMOOTHING_ALPHA = alpha
        try:
            runner = FastTarget(loaded.model, "w8a8", calibration_ids=calibration)
        finally:
            weight_formats.SMOOTHING_ALPHA = engine_alpha
        results[f"w8a8 alpha {alpha}"] = compare(reference, logits_of(runner, seqs))
        print(f"w8a8 alpha {alpha}", results[f"w8a8 alpha {alpha}"], flush=True)
    if args.down_rows:
        # w8a8 with down's rows quantized too (a what-if: the engine keeps down weight-only)
        all_four = ("qkv", "o", "gate_up", "down")
        saved = weight_formats.DYNAMIC_MATRICES, target_module.DYNAMIC_MATRICES
        weight_formats.DYNAMIC_MATRICES = target_module.DYNAMIC_MATRICES = all_four
        try:
            runner = FastTarget(loaded.model, "w8a8", calibration_ids=calibration)
        finally:
            weight_formats.DYNAMIC_MATRICES, target_module.DYNAMIC_MATRICES = saved
        results["w8a8, down's rows int8 too"] = compare(reference, logits_of(runner, seqs))
        print("w8a8, down's rows int8 too", results["w8a8, down's rows int8 too"], flush=True)
    for head in [h for h in args.heads.split(",") if h]:
        # w8a8 with the LM head run as ``head`` too (the eager w8a8 target's head is fp32)
        runner = FastTarget(loaded.model, "w8a8", calibration_ids=calibration)
        runner._lm_head = lm_head_as(runner, head, calibration)
        results[f"w8a8, LM head {head}"] = compare(reference, logits_of(runner, seqs))
        print(f"w8a8, LM head {head}", results[f"w8a8, LM head {head}"], flush=True)
    if args.llama_like:
        results["llama.cpp-like (int8 rows in blocks of 32, simulated)"] = compare(reference, llama_like(loaded.model, seqs))
        print("llama-like", results["llama.cpp-like (int8 rows in blocks of 32, simulated)"], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps({"pair": args.pair, "sequences": len(seqs), "length": args.length,
                                                  "results": results}, indent=2))


if __name__ == "__main__":
    main()
