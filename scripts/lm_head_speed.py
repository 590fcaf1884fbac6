"""SmolLM2's LM head as the GGUF stores it (Q8_0, ``int8_dot.Q8DotWeight``) against the int8 head
with one scale per output (``int8_dot.Int8DotWeight``): milliseconds and the relative error against
the exact product of the file's weights; what docs/BENCHMARKS-AMD.md cites.

    python scripts/lm_head_speed.py [--rows 2,16]

Interleaved round by round, 20 calls a round, 9 rounds (the first ones warm up alike); the median.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_core.int8_dot import Q8DotWeight, int8_dot_weight
from dflash_core.loading import resolve_gguf
from dflash_core.registry import load_registry
from dflash_core.weight_formats import Int8Weight, q4_1_blocks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="2,16")
    opts = parser.parse_args()
    blocks = q4_1_blocks(resolve_gguf(load_registry().get("smollm2-135m").target), 9, 3)["lm_head"]
    weights = blocks.dequantize()
    per_output, _ = int8_dot_weight(Int8Weight(weights, torch.float32))
    kernels = {"int8, one scale per output": per_output, "Q8_0 as stored": Q8DotWeight(blocks)}
    generator = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in opts.rows.split(",")):
        x = torch.randn(rows, weights.shape[1], generator=generator)
        exact = x.bfloat16().double() @ weights.double().T
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for round_ in range(9):
            for name, kernel in (list(kernels.items()) if round_ % 2 else list(kernels.items())[::-1]):
                began = time.perf_counter()
                for _ in range(20):
                    kernel(x)
                times[name].append((time.perf_counter() - began) / 20 * 1e3)
        print(f"{rows} rows: " + ", ".join(
            f"{name} {statistics.median(t):.3f} ms (error {float((kernel(x).double() - exact).norm() / exact.norm()):.1e})"
            for (name, t), kernel in zip(times.items(), kernels.values())), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
