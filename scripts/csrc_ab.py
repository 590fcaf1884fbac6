"""The w4a8 target's C++ kernels (``csrc/q4_dot.cpp``) against their source at another git revision,
interleaved, on SmolLM2's shapes: what docs/BENCHMARKS-AMD.md cites for changes to them.

    python scripts/csrc_ab.py --base 7f8c62c [--kernels attention,products,q8_products] [--rows 1,2,16]
                              [--context 300,900] [--rounds 15]

Builds ``csrc/q4_dot.cpp`` as it was at ``--base`` (with that revision's headers) beside this
checkout's, then times both on the same random inputs, a pass's worth of layers (30) per call
group, taking turns round by round:

* ``attention``: ``dot_attention``'s ``write_and_attend`` for each row count after each context length;
* ``products``: ``int8_rows``' products of fp32 rows with a layer's four Q4_1 matrices (QKV, O,
  gate/up, down; random codes, fp16 scales and minimums) for each row count.
* ``q8_products``: the same with Q8_0 matrices (random codes, small fp32 scales; the bundled
  drafter's format): its three layers' four matrices, and the target's LM head (49,152 x 576).

Prints milliseconds (median over rounds) and whether both gave the same numbers bit for bit.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from dflash_core import int8_dot, q4_dot

ROOT = Path(__file__).resolve().parent.parent
CSRC = "dflash_core/csrc"
HEADS, KV_HEADS, HEAD_DIM, CAPACITY, LAYERS = 9, 3, 64, 1024, 30  # SmolLM2-135M
MATRICES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # its layers' QKV, O, gate/up, down (N, K)
HEAD, DRAFTER_LAYERS = (49152, 576), 3  # its LM head (N, K); the bundled drafter's layers (the target's shapes)


def library_at(revision: str, folder: Path) -> ctypes.CDLL:
    """``q4_dot.cpp`` and its headers as they were at ``revision``, compiled as the engine compiles them."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{CSRC}"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        text = subprocess.run(["git", "show", f"{revision}:{CSRC}/{name}"], cwd=ROOT, check=True,
                              capture_output=True).stdout
        (folder / name).write_bytes(text)
    lib = int8_dot.compiled(folder / "q4_dot.cpp")
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.write_and_attend.argtypes = [pointer] * 6 + [size] * 5 + [pointer, ctypes.c_int]
    lib.write_and_attend.restype = None
    lib.int8_rows_floats.argtypes = [ctypes.c_int, pointer, size, size, pointer, ctypes.c_float, pointer, pointer,
                                     pointer, size, ctypes.c_int]
    lib.int8_rows_floats.restype = None
    return lib


def interleaved(runs: dict, outs: dict, rounds: int) -> str:
    """Each of ``runs`` timed in turn, ``rounds`` times: medians and whether ``outs`` agree."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            began = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - began)
    first, second = outs.values()
    same = all(torch.equal(a, b) for a, b in zip(first, second))
    return (", ".join(f"{name} {1000 * statistics.median(t):.3f} ms" for name, t in times.items())
            + f"; same numbers bit for bit: {same}")


def attention_call(lib: ctypes.CDLL, rows: torch.Tensor, tensors: dict, out: torch.Tensor):
    """One pass's attention calls (every layer) with ``lib``'s kernel."""
    q, k, v, keys, values = (tensors[name] for name in ("q", "k", "v", "keys", "values"))
    threads = torch.get_num_threads()

    def run() -> None:
        for layer in range(LAYERS):
            lib.write_and_attend(q[layer].data_ptr(), k[layer].data_ptr(), v[layer].data_ptr(), keys[layer].data_ptr(),
                                 values[layer].data_ptr(), rows.data_ptr(), len(rows), HEADS, KV_HEADS, HEAD_DIM,
                                 CAPACITY, out[layer].data_ptr(), threads)
    return run


def random_q4(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Packed Q4 groups (n / 16, k / 32, 320): random codes, then small fp16 scales and minimums."""
    packed = torch.randint(0, 256, (n // 16, k // 32, 320), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(n // 16, k // 32, 32, generator=generator) * 0.01).half()
    packed[..., 256:] = scales.view(torch.uint8)
    return packed


def random_q8(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Packed Q8 groups (n / 16, k / 32, 640): random codes, small fp32 scales, the codes' sums."""
    packed = torch.randint(0, 256, (n // 16, k // 32, 640), generator=generator, dtype=torch.uint8)
    packed[..., 512:576] = (torch.rand(n // 16, k // 32, 16, generator=generator) * 0.01).view(torch.uint8)
    sums = packed[..., :512].view(torch.int8).view(n // 16, k // 32, 128, 4).sum(dim=-1, dtype=torch.int32)
    packed[..., 576:] = (128 * sums.view(n // 16, k // 32, 8, 16).sum(dim=2, dtype=torch.int32)).view(torch.uint8)
    return packed


def products_call(lib: ctypes.CDLL, rows: list[torch.Tensor], matrices: list[list[torch.Tensor]],
                  out: list[torch.Tensor], shapes: list[tuple[int, int]] = MATRICES, fmt: int = 0):
    """One pass's layer products (every layer's matrices of ``shapes``) with ``lib``'s kernel
    (``fmt`` 0: Q4, 1: Q8)."""
    threads = torch.get_num_threads()

    def run() -> None:
        for layer in matrices:
            for i, (n, k) in enumerate(shapes):
                lib.int8_rows_floats(fmt, rows[i].data_ptr(), rows[i].shape[0], k, None, 0.0, layer[i].data_ptr(), None,
                                     out[i].data_ptr(), n, threads)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the git revision to compare with")
    parser.add_argument("--kernels", default="attention,products")
    parser.add_argument("--rows", default="1,2,16")
    parser.add_argument("--context", default="300,900", help="positions before the rows (attention)")
    parser.add_argument("--rounds", type=int, default=15)
    opts = parser.parse_args()
    counts = [int(r) for r in opts.rows.split(",")]
    kernels = opts.kernels.split(",")
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        libs = {opts.base: library_at(opts.base, Path(folder)), "this checkout": q4_dot.library()}
        if "attention" in kernels:
            cache = {name: torch.randn(LAYERS, KV_HEADS, CAPACITY, HEAD_DIM, generator=generator)
                     for name in ("keys", "values")}
            for context in (int(c) for c in opts.context.split(",")):
                for count in counts:
                    tensors = {"q": torch.randn(LAYERS, count, HEADS, HEAD_DIM, generator=generator) * HEAD_DIM**-0.5,
                               "k": torch.randn(LAYERS, count, KV_HEADS, HEAD_DIM, generator=generator),
                               "v": torch.randn(LAYERS, count, KV_HEADS, HEAD_DIM, generator=generator), **cache}
                    rows = torch.arange(context, context + count)
                    outs = {name: [torch.empty(LAYERS, count, HEADS * HEAD_DIM)] for name in libs}
                    runs = {name: attention_call(lib, rows, tensors, outs[name][0]) for name, lib in libs.items()}
                    print(f"attention, {count} rows after {context} positions, {LAYERS} layers: "
                          + interleaved(runs, outs, opts.rounds), flush=True)
        if "products" in kernels:
            matrices = [[random_q4(n, k, generator) for n, k in MATRICES] for _ in range(LAYERS)]
            for count in counts:
                rows = [torch.randn(count, k, generator=generator) for _, k in MATRICES]
                outs = {name: [torch.empty(count, n) for n, _ in MATRICES] for name in libs}
                runs = {name: products_call(lib, rows, matrices, outs[name]) for name, lib in libs.items()}
                print(f"Q4_1 products with int8 rows, {count} rows, {LAYERS} layers' four matrices: "
                      + interleaved(runs, outs, opts.rounds), flush=True)
        if "q8_products" in kernels:
            drafter = [[random_q8(n, k, generator) for n, k in MATRICES] for _ in range(DRAFTER_LAYERS)]
            head = [[random_q8(*HEAD, generator)]]
            for count in counts:
                for label, shapes, matrices in ((f"the drafter's {DRAFTER_LAYERS} layers' four matrices", MATRICES,
                                                 drafter), ("the LM head", [HEAD], head)):
                    rows = [torch.randn(count, k, generator=generator) for _, k in shapes]
                    outs = {name: [torch.empty(count, n) for n, _ in shapes] for name in libs}
                    runs = {name: products_call(lib, rows, matrices, outs[name], shapes, fmt=1)
                            for name, lib in libs.items()}
                    print(f"Q8_0 products with int8 rows, {count} rows, {label}: "
                          + interleaved(runs, outs, opts.rounds), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
