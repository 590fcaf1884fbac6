"""The target's linear layers in each weight format on this CPU: bf16 and fp32 (plain and
oneDNN-packed), weight-only int8 / int4, and the GGUF's own Q4_1 codes through this project's
kernels (``q4_dot``, bf16 rows; ``int8_rows``, int8 rows: the w4a8 pair's) where they run.

For SmolLM2-135M's 30 layers (fused QKV, O, fused gate/up, down: the matrices FastTarget runs),
times one pass over all 120 matrices for 2, 16 and 32 rows in each format, interleaved
(every round runs every format in a rotated order), and reports medians; then checks, per format,
batch invariance (a row's result equal bit for bit for 2 / 3 / 16 / 37 rows) and the distance to
the exact result (fp32 math on the GGUF's exact dequantized weights). Also measures memory
read bandwidth, for the bytes-per-step limit.

``--inductor`` adds fp32 through inductor's own C++ GEMM (max-autotune, frozen weights, the
number of rows dynamic), which was faster than oneDNN's packed fp32 at a few rows on an AVX2 CPU,
compiled by ``torch.compile`` (paid again in every process: with frozen weights nothing is reused
from inductor's disk cache). ``--aoti`` adds the same kernels built ahead of time into an
AOTInductor package, the form an engine could build once per machine and load; it reports the
build's seconds, the load's and the package's size.

    /tmp/quiet.sh python scripts/weight_formats.py [--rounds 15] [--inductor] [--aoti]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_core.kernels import Linear, native_bf16, onednn_bf16  # noqa: E402
from dflash_core.loading import resolve_gguf  # noqa: E402
from dflash_core.registry import load_registry  # noqa: E402
from dflash_core.kernels import PROBE_ROWS, rows_match  # noqa: E402
from dflash_core.weight_formats import Int4Weight, Int8Weight, Q4Blocks, q4_1_blocks  # noqa: E402
from dflash_core.int8_dot import cannot_run  # noqa: E402
from dflash_core.int8_rows import Q4Q8DotWeight, refusal as int8_rows_refusal  # noqa: E402
from dflash_core.q4_dot import Q4DotWeight  # noqa: E402


def fused_blocks(blocks: dict[str, Q4Blocks], layers: int) -> list[list[Q4Blocks]]:
    out = []
    for i in range(layers):
        p = f"model.layers.{i}."
        out.append([
            Q4Blocks.cat([blocks[p + f"self_attn.{n}_proj"] for n in "qkv"]),
            blocks[p + "self_attn.o_proj"],
            Q4Blocks.cat([blocks[p + "mlp.gate_proj"], blocks[p + "mlp.up_proj"]]),
            blocks[p + "mlp.down_proj"],
        ])
    return out


def bandwidth() -> tuple[float, float]:
    """GB/s reading (a sum of 512 MB of fp32) and copying (256 MB -> 256 MB), best of 5."""
    x = torch.ones(128 << 20)  # 512 MB
    y = torch.empty(64 << 20)
    src = x[: 64 << 20]
    read, copy = [], []
    for _ in range(5):
        t = time.perf_counter(); x.sum(); read.append(time.perf_counter() - t)
        t = time.perf_counter(); y.copy_(src); copy.append(time.perf_counter() - t)
    return x.numel() * 4 / min(read) / 1e9, 2 * y.numel() * 4 / min(copy) / 1e9


class _AllMatrices(torch.nn.Module):
    """Every fused matrix of the 30 layers as one module, for torch.compile: one call runs all
    120 products (``x`` feeds the 576-wide inputs, ``x_down`` the down projections')."""

    def __init__(self, exact: list[list[torch.Tensor]]) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList()
        for layer in exact:
            for w in layer:
                linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
                linear.weight.data.copy_(w)
                self.linears.append(linear)

    def forward(self, x: torch.Tensor, x_down: torch.Tensor) -> list[torch.Tensor]:
        return [lin(x_down if lin.in_features != x.shape[1] else x) for lin in self.linears]


def _matrix_views(run: Callable, exact: list[list[torch.Tensor]]) -> tuple[list[list], Callable]:
    """Per-matrix callables and a whole pass over ``run`` (a compiled ``_AllMatrices``): each
    per-matrix call computes all 120 products and keeps its own, the other input zeros."""
    width, down_width = exact[0][0].shape[1], exact[0][3].shape[1]

    def call(index: int, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if x.shape[1] == width:
            return run(x, torch.zeros(n, down_width))[index]
        return run(torch.zeros(n, width), x)[index]

    per_matrix = [[(lambda x, i=li * 4 + mi: call(i, x)) for mi in range(4)] for li in range(len(exact))]
    return per_matrix, (lambda xs: run(xs[0], xs[3]))


def inductor_matrices(exact: list[list[torch.Tensor]]) -> tuple[list[list], Callable, float]:
    """One compiled module of all 120 fp32 matrices (see ``_AllMatrices``): its per-matrix
    callables and whole pass (``_matrix_views``), and the seconds compiling took for 2 rows and
    for a lone row (inductor specializes a size of 1)."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # weights become constants the C++ GEMM packs once
    inductor_config.max_autotune = True
    inductor_config.max_autotune_gemm_backends = "CPP,ATEN"
    module = _AllMatrices(exact).eval()
    compiled = torch.compile(module, dynamic=True)
    width, down_width = exact[0][0].shape[1], exact[0][3].shape[1]
    started = time.perf_counter()
    with torch.inference_mode():  # the mode the timings and checks run in (a guard of the graph)
        for rows in (2, 1):
            compiled(torch.zeros(rows, width), torch.zeros(rows, down_width))
    seconds = time.perf_counter() - started
    return (*_matrix_views(compiled, exact), seconds)


def aoti_matrices(exact: list[list[torch.Tensor]]) -> tuple[list[list], Callable, dict[str, float]]:
    """As ``inductor_matrices``, through an AOTInductor package of ``_AllMatrices`` (the number
    of rows a dynamic dimension), built in a temporary folder and loaded back; also the build's
    and the load's seconds and the package's MB."""
    import tempfile

    configs = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
    module = _AllMatrices(exact).eval()
    width, down_width = exact[0][0].shape[1], exact[0][3].shape[1]
    rows = torch.export.Dim("rows", min=1, max=4096)
    with tempfile.TemporaryDirectory() as folder:
        package = Path(folder) / "matrices.pt2"
        started = time.perf_counter()
        with torch.no_grad():
            program = torch.export.export(module, (torch.zeros(2, width), torch.zeros(2, down_width)),
                                          dynamic_shapes=({0: rows}, {0: rows}))
            torch._inductor.aoti_compile_and_package(program, package_path=str(package), inductor_configs=configs)
        built = time.perf_counter() - started
        started = time.perf_counter()
        runner = torch._inductor.aoti_load_package(str(package))
        cost = {"build_s": built, "load_s": time.perf_counter() - started, "mb": package.stat().st_size / 1e6}
    return (*_matrix_views(runner, exact), cost)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--rows", default="2,16,32")
    parser.add_argument("--inductor", action="store_true",
                        help="add fp32 through inductor's C++ GEMM, compiled in this process (minutes)")
    parser.add_argument("--aoti", action="store_true",
                        help="add the same kernels from an AOTInductor package built and loaded here (minutes)")
    args = parser.parse_args()
    torch.manual_seed(0)
    pair = load_registry().get("smollm2-135m")
    gguf = resolve_gguf(pair.target)
    t0 = time.perf_counter()
    mats = fused_blocks(q4_1_blocks(gguf, 9, 3), 30)
    print(f"read {len(mats) * 4} fused Q4_1 matrices from {gguf.name} in {time.perf_counter() - t0:.1f} s")
    exact = [[b.dequantize() for b in layer] for layer in mats]  # fp32, the file's numbers
    bf16 = [[w.bfloat16().contiguous() for w in layer] for layer in exact]
    formats = {
        "bf16 F.linear": [[(lambda x, w=w: F.linear(x, w)) for w in layer] for layer in bf16],
        "bf16 oneDNN packed": [[Linear(w) for w in layer] for layer in bf16],
        "fp32 F.linear": [[(lambda x, w=w: F.linear(x, w)) for w in layer] for layer in exact],
        "fp32 oneDNN packed": [[Linear(w) for w in layer] for layer in exact],
        "int8 per-channel": [[Int8Weight(w) for w in layer] for layer in exact],
        "int4 Q4_1 blocks": [[Int4Weight(b) for b in layer] for layer in mats],
        "fp32 rows, int4 Q4_1 blocks (bf16 inside)": [[Int4Weight(b, torch.float32) for b in layer] for layer in mats],
    }
    if cannot_run() is None:  # the GGUF's own codes through this project's kernels
        formats["q4_dot (Q4_1, bf16 rows)"] = [[Q4DotWeight(b) for b in layer] for layer in mats]
    if int8_rows_refusal() is None:
        formats["int8_rows (Q4_1, int8 rows: w4a8)"] = [[Q4Q8DotWeight(b) for b in layer] for layer in mats]
    whole_pass = {}  # formats timed as one call over all matrices (a compiled module)
    if args.inductor:
        name = "fp32 inductor C++ GEMM (dynamic rows)"
        formats[name], whole_pass[name], compile_s = inductor_matrices(exact)
        print(f"{name}: compiled in {compile_s:.1f} s (2 rows, then a lone row)")
    if args.aoti:
        name = "fp32 AOTInductor package (dynamic rows)"
        formats[name], whole_pass[name], cost = aoti_matrices(exact)
        print(f"{name}: built in {cost['build_s']:.1f} s, {cost['mb']:.0f} MB, loaded in {cost['load_s']:.2f} s")
    activations = {n: torch.float32 if n.startswith("fp32") else torch.bfloat16 for n in formats}
    for n in ("bf16 oneDNN packed", "fp32 oneDNN packed"):
        kernels = [lin for layer in formats[n] for lin in layer]
        lone = sum(lin.lone_row_packed for lin in kernels)
        print(f"{n}: {sum(lin.packed is not None for lin in kernels)} of {len(kernels)} matrices packed "
              f"({lone} serve a lone row too); the others run F.linear")
    bf16_bytes = sum(w.numel() * 2 for layer in bf16 for w in layer)
    nbytes = {
        "bf16 F.linear": bf16_bytes, "bf16 oneDNN packed": bf16_bytes,
        "fp32 F.linear": 2 * bf16_bytes, "fp32 oneDNN packed": 2 * bf16_bytes,
        "int8 per-channel": sum(k.q.numel() + k.scales.numel() * 2 for layer in formats["int8 per-channel"] for k in layer),
        "int4 Q4_1 blocks": sum(k.packed.numel() + k.scales_zeros.numel() * 2 for layer in formats["int4 Q4_1 blocks"] for k in layer),
    }
    nbytes["fp32 rows, int4 Q4_1 blocks (bf16 inside)"] = nbytes["int4 Q4_1 blocks"]
    for n in ("q4_dot (Q4_1, bf16 rows)", "int8_rows (Q4_1, int8 rows: w4a8)"):  # 20 bytes per 32 weights
        if n in formats:
            nbytes[n] = sum(k.packed.numel() for layer in formats[n] for k in layer)
    for n in whole_pass:
        nbytes[n] = 2 * bf16_bytes
    print(f"oneDNN bf16 path on this CPU (kernels.onednn_bf16): {onednn_bf16()}; bf16 instructions "
          f"(kernels.native_bf16, what dtype auto follows): {native_bf16()}; threads: {torch.get_num_threads()}")

    row_counts = [int(r) for r in args.rows.split(",")]
    base = {r: [torch.randn(r, w.shape[1]) for w in bf16[0]] for r in row_counts}
    inputs = {(n, r): [x.to(activations[n]) for x in base[r]] for n in formats for r in row_counts}

    def one_pass(n, xs):
        if n in whole_pass:
            whole_pass[n](xs)
            return
        for layer in formats[n]:
            for kernel, x in zip(layer, xs):
                kernel(x)

    names = list(formats)
    times = {(n, r): [] for n in names for r in row_counts}
    with torch.inference_mode():
        for n in names:  # warm-up
            for r in row_counts:
                one_pass(n, inputs[(n, r)])
        for round_ in range(args.rounds):
            order = names[round_ % len(names):] + names[: round_ % len(names)]
            for r in row_counts:
                for n in order:
                    t = time.perf_counter()
                    one_pass(n, inputs[(n, r)])
                    times[(n, r)].append(time.perf_counter() - t)

        # Batch invariance and closeness, on every fused matrix of layers 0, 15 and 29.
        invariant = {n: True for n in names}
        lone_row = {n: True for n in names}
        err = {n: [] for n in names}
        for li in (0, 15, 29):
            for mi, w in enumerate(exact[li]):
                probe16 = torch.randn(max(PROBE_ROWS), w.shape[1]).bfloat16()
                truth = probe16.float() @ w.T
                for n in names:
                    kernel = formats[n][li][mi]
                    probe = probe16.to(activations[n])
                    ref = kernel(probe)
                    invariant[n] &= rows_match(kernel, ref, probe)
                    lone_row[n] &= torch.equal(kernel(probe[:1]), ref[:1])
                    err[n].append(((ref.float() - truth).norm() / truth.norm()).item())

    read_bw, copy_bw = bandwidth()
    print(f"memory bandwidth: read {read_bw:.1f} GB/s (fp32 sum), copy {copy_bw:.1f} GB/s (read + write)")
    print()
    header = "| format | MB read | " + " | ".join(f"{r} rows ms" for r in row_counts) + \
             " | limit ms (MB / read BW) | rows 2/3/16/37 identical | lone row identical | rel. error vs exact |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for n in names:
        med = [statistics.median(times[(n, r)]) * 1e3 for r in row_counts]
        print(f"| {n} | {nbytes[n] / 1e6:.0f} | " + " | ".join(f"{m:.2f}" for m in med) +
              f" | {nbytes[n] / read_bw / 1e6:.2f} | {invariant[n]} | {lone_row[n]} | {max(err[n]):.2e} |")
    print(f"\n{args.rounds} interleaved rounds, medians; 120 matrices (30 layers x QKV, O, gate/up, down), "
          f"LM head not included (Q8_0 in the file, kept bf16).")


if __name__ == "__main__":
    main()
