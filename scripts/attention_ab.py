"""The target's C++ attention (``dot_attention``'s ``write_and_attend``) against its source at another
git revision, interleaved, on SmolLM2's shapes: what docs/BENCHMARKS-AMD.md cites for it.

    python scripts/attention_ab.py --base 7f8c62c [--rows 1,2,16] [--context 300,900] [--rounds 15]

Builds ``csrc/q4_dot.cpp`` as it was at ``--base`` (with that revision's headers) beside this
checkout's, then for each row count and context length times both on the same random queries,
keys and values, a pass's worth of layers (30) per call group, taking turns round by round.
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
    return lib


def layers_call(lib: ctypes.CDLL, rows: torch.Tensor, tensors: dict, out: torch.Tensor):
    """One pass's attention calls (every layer) with ``lib``'s kernel."""
    q, k, v, keys, values = (tensors[name] for name in ("q", "k", "v", "keys", "values"))
    threads = torch.get_num_threads()

    def run() -> None:
        for layer in range(LAYERS):
            lib.write_and_attend(q[layer].data_ptr(), k[layer].data_ptr(), v[layer].data_ptr(), keys[layer].data_ptr(),
                                 values[layer].data_ptr(), rows.data_ptr(), len(rows), HEADS, KV_HEADS, HEAD_DIM,
                                 CAPACITY, out[layer].data_ptr(), threads)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the git revision to compare with")
    parser.add_argument("--rows", default="1,2,16")
    parser.add_argument("--context", default="300,900", help="positions before the rows")
    parser.add_argument("--rounds", type=int, default=15)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        libs = {opts.base: library_at(opts.base, Path(folder)), "this checkout": q4_dot.library()}
        generator = torch.Generator().manual_seed(0)
        cache = {name: torch.randn(LAYERS, KV_HEADS, CAPACITY, HEAD_DIM, generator=generator) for name in ("keys", "values")}
        for context in (int(c) for c in opts.context.split(",")):
            for count in (int(r) for r in opts.rows.split(",")):
                rows = torch.arange(context, context + count)
                tensors = {"q": torch.randn(LAYERS, count, HEADS, HEAD_DIM, generator=generator) * HEAD_DIM**-0.5,
                           "k": torch.randn(LAYERS, count, KV_HEADS, HEAD_DIM, generator=generator),
                           "v": torch.randn(LAYERS, count, KV_HEADS, HEAD_DIM, generator=generator), **cache}
                outs = {name: torch.empty(LAYERS, count, HEADS * HEAD_DIM) for name in libs}
                runs = {name: layers_call(lib, rows, tensors, outs[name]) for name, lib in libs.items()}
                times: dict[str, list[float]] = {name: [] for name in libs}
                for _ in range(opts.rounds):
                    for name, run in runs.items():
                        began = time.perf_counter()
                        run()
                        times[name].append(time.perf_counter() - began)
                same = torch.equal(*outs.values())
                print(f"{count} rows after {context} positions, {LAYERS} layers: "
                      + ", ".join(f"{name} {1000 * statistics.median(t):.3f} ms" for name, t in times.items())
                      + f"; same numbers bit for bit: {same}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
