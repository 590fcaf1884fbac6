"""Which int8 GEMM inductor compiles well on this CPU: one matrix, rows as signed int8, rows as
unsigned int8 (zero point 128), and int8 weight-only (rows in bf16), each compiled alone.

    python scripts/int8_row_kernels.py [--out-features 3072] [--in-features 576] [--rows 2,16]

Inductor's table of micro-kernels has a vector kernel for int8 x int8 products with signed rows
on AMX only, and on AVX-512 VNNI (an EPYC Zen 4) for unsigned rows only: signed rows there run its
reference loops. This measured what unsigned rows would gain there, before ``w8a8``'s compiled
layers took them (``aoti_kernels.w8a8_rows``, ``aoti_layers.unsigned_rows_product``, whose
quantization pattern the unsigned form here shares): each form written as PyTorch's quantized-linear
pattern (rows dequantized per tensor, the weight per channel; inductor's freezing passes turn it
into its int8 GEMM), ``torch.compile`` with frozen weights and ``max_autotune``, the number of rows
dynamic. Prints microseconds per call (median of 5 rounds) beside the eager module's, whether a
row's result stays the same with 2, 3 and 5 rows as among 16, and the distance to the eager result.
Compiles for a minute or two; timings are this machine's, so run it idle.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the quantized_decomposed ops)
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_core.aoti_kernels import int8_rows_gemm_missing  # noqa: E402


class Int8Rows(torch.nn.Module):
    """Rows quantized per row to int8 (``unsigned``: shifted by 128 into uint8) times an int8
    weight with one scale per output channel, rescaled by the rows' scales."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, unsigned: bool) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", torch.zeros(weight.shape[0], dtype=torch.int64))
        self.unsigned = unsigned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        row_scales = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
        codes = torch.round(x / row_scales)
        if self.unsigned:
            rows = torch.ops.quantized_decomposed.dequantize_per_tensor.default(
                (codes + 128).to(torch.uint8), 1.0, 128, 0, 255, torch.uint8)
        else:
            rows = torch.ops.quantized_decomposed.dequantize_per_tensor.default(
                codes.to(torch.int8), 1.0, 0, -128, 127, torch.int8)
        weight = torch.ops.quantized_decomposed.dequantize_per_channel.default(
            self.weight, self.scales, self.zeros, 0, -128, 127, torch.int8)
        return F.linear(rows, weight) * row_scales


class WeightOnly(torch.nn.Module):
    """The int8 pair's product: rows in bf16 times the int8 weight (``_weight_int8pack_mm``)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales).float()


def microseconds(fn, x: torch.Tensor, calls: int) -> float:
    for _ in range(10):
        fn(x)
    rounds = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(calls):
            fn(x)
        rounds.append((time.perf_counter() - began) / calls * 1e6)
    return statistics.median(rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-features", type=int, default=3072, help="SmolLM2-135M's gate/up: 3072")
    parser.add_argument("--in-features", type=int, default=576)
    parser.add_argument("--rows", default="2,16")
    parser.add_argument("--calls", type=int, default=200)
    opts = parser.parse_args()
    import torch._inductor.config as inductor

    inductor.freezing = True
    inductor.max_autotune = True
    inductor.max_autotune_gemm_backends = "CPP,ATEN"
    print(f"signed int8 rows: {int8_rows_gemm_missing() or 'inductor has a vector kernel here'}")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (opts.out_features, opts.in_features), dtype=torch.int8, generator=generator)
    scales = torch.rand(opts.out_features, generator=generator) * 0.01
    forms = {"int8 rows": Int8Rows(weight, scales, unsigned=False), "uint8 rows": Int8Rows(weight, scales, unsigned=True),
             "int8 weight-only": WeightOnly(weight, scales)}
    with torch.no_grad():
        for name, module in forms.items():
            module.eval()
            compiled = torch.compile(module, dynamic=True)
            times = []
            for rows in (int(r) for r in opts.rows.split(",")):
                x = torch.randn(rows, opts.in_features, generator=generator)
                times.append(f"{rows} rows {microseconds(compiled, x, opts.calls):.1f} us "
                             f"(eager {microseconds(module, x, opts.calls):.1f})")
            x = torch.randn(16, opts.in_features, generator=generator)
            full = compiled(x)
            independent = all(torch.equal(compiled(x[:r].contiguous()), full[:r]) for r in (2, 3, 5))
            distance = ((full - module(x)).norm() / module(x).norm()).item()
            print(f"{name}: {', '.join(times)}; rows independent: {independent}; "
                  f"relative distance to eager {distance:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
