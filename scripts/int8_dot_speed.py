"""The weight-only int8 and Q4_1 kernels side by side on SmolLM2's shapes: what docs/BENCHMARKS-AMD.md
cites for ``dflash_core/int8_dot.py``, ``dflash_core/q4_dot.py`` and ``dflash_core/int8_rows.py``.

    python scripts/int8_dot_speed.py [--rows 1,2,16,32] [--rounds 3] [--out runs/int8_dot_speed.json]

For the LM head (49152 x 576, once) and the MLP's ``down`` (576 x 1536, 30 distinct copies, as in a
pass), times per call group, interleaved round by round: inductor's weight-only int8 GEMM
(``aoti_kernels.AotiInt8Weight``, the compiled pairs' kernel elsewhere), ``int8_dot`` (bf16 dot
products), and, for scale, oneDNN's packed bf16 product of the same codes (twice the bytes); then
the Q4_1 kernels on random Q4_1 blocks whose weights the int8 codes requantize: PyTorch's int4
kernel (``weight_formats.Int4Weight``) and ``q4_dot``; where AVX512-VNNI runs them, ``int8_rows``' products
with int8 rows of the same Q4_1 blocks and of their Q8_0 requantization (``quantize_q8``). Also the largest relative error of each
against the exact product of the same rows (rounded to bf16) and its own codes, in float64. Prints milliseconds (median over rounds) and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dflash_core import aoti_kernels, int8_dot, int8_rows, q4_dot
from dflash_core.kernels import Linear
from dflash_core.weight_formats import Int4Weight, Int8Weight, Q4Blocks, QuantizedLinear, quantize_q8

SHAPES = {"LM head": (49152, 576, 1), "down x30": (576, 1536, 30)}


def random_q4(out_features: int, in_features: int, generator: torch.Generator) -> Q4Blocks:
    """Q4_1 blocks of a matrix's scale: codes 0..15, fp16 scales and minimums per group of 32."""
    groups = (out_features, in_features // 32)
    scale = 4 / in_features**0.5 / 15
    return Q4Blocks(torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.int32),
                    (scale * (0.5 + torch.rand(groups, generator=generator))).half().float(),
                    (-7.5 * scale * (0.5 + torch.rand(groups, generator=generator))).half().float())


def seconds(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - began) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,16,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/int8_dot_speed.json"))
    opts = parser.parse_args()
    if (why := int8_dot.cannot_run()) is not None:
        parser.error(f"int8_dot cannot run here: {why}")
    generator = torch.Generator().manual_seed(0)
    results: dict = {"threads": torch.get_num_threads(), "shapes": {}}
    for name, (out_features, in_features, copies) in SHAPES.items():
        blocks = [random_q4(out_features, in_features, generator) for _ in range(copies)]
        eager = [Int8Weight(b.dequantize(), torch.float32) for b in blocks]
        kernels = {
            "inductor int8 GEMM": [aoti_kernels.aoti_int8_linear(QuantizedLinear(e))[0] for e in eager],
            "int8_dot (bf16 dot products)": [QuantizedLinear(int8_dot.Int8DotWeight(e.q, e.scales)) for e in eager],
            "oneDNN bf16 (codes as bf16)": [Linear(e.q.to(torch.bfloat16)) for e in eager],
            "PyTorch int4 (Q4_1)": [QuantizedLinear(Int4Weight(b, torch.float32)) for b in blocks],
            "q4_dot (Q4_1, bf16 dot products)": [QuantizedLinear(q4_dot.Q4DotWeight(b)) for b in blocks],
        }
        if int8_rows.refusal() is None:  # the rows int8 too, as llama.cpp multiplies (w4a8)
            kernels["int8_rows (Q4_1, int8 rows)"] = [QuantizedLinear(int8_rows.Q4Q8DotWeight(b)) for b in blocks]
            q8 = [quantize_q8(b.dequantize()) for b in blocks]
            kernels["int8_rows (Q8_0, int8 rows)"] = [QuantizedLinear(int8_rows.Q8Q8DotWeight(b)) for b in q8]
        scales = eager[0].scales.double()
        q4_weight = blocks[0].dequantize().double()
        q8_weight = q8[0].dequantize().double() if int8_rows.refusal() is None else None
        shape: dict = {}
        for rows in (int(r) for r in opts.rows.split(",")):
            x = torch.randn(rows, in_features, generator=generator)
            exact = (x.bfloat16().double() @ eager[0].q.double().T) * scales
            exact_q4 = x.bfloat16().double() @ q4_weight.T
            exact_q8 = None if q8_weight is None else x.bfloat16().double() @ q8_weight.T
            timings: dict[str, list[float]] = {kind: [] for kind in kernels}
            errors = {}
            with torch.inference_mode():
                for kind, group in kernels.items():
                    rows_in = x.bfloat16() if kind.startswith("oneDNN") else x
                    got = group[0](rows_in).double() * (scales if kind.startswith("oneDNN") else 1)
                    want = exact_q4 if "Q4_1" in kind else exact_q8 if "Q8_0" in kind else exact
                    errors[kind] = ((got - want).abs().max() / want.abs().max()).item()
                for _ in range(opts.rounds):
                    for kind, group in kernels.items():
                        rows_in = x.bfloat16() if kind.startswith("oneDNN") else x
                        timings[kind].append(1e3 * seconds(lambda: [k(rows_in) for k in group]))
            shape[rows] = {kind: {"ms": round(statistics.median(t), 3), "max_relative_error": errors[kind]}
                           for kind, t in timings.items()}
            print(f"{name}, {rows} rows: " + ", ".join(f"{kind} {v['ms']:.2f} ms (error {v['max_relative_error']:.1e})"
                                                     for kind, v in shape[rows].items()), flush=True)
        results["shapes"][name] = shape
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
