"""Where a target pass goes, by part: the figures docs/BENCHMARKS.md cites for the compiled layers.

    python scripts/pass_parts.py --pair smollm2-135m-int8 [--rows 2,16] [--capacity 512] [--out runs/pass_parts]

Loads the pair's target as the engine does, prefills ``--context`` tokens into a cache of
``--capacity`` positions, then times ``--passes`` passes of each row count in ``--rows`` (2: an
autoregressive step padded to the multi-row threshold; 16: a verify block), each undone before
the next so every pass sees the same context. Timers sit around each call of the layers' first
halves (norm, QKV, rotary), the attention, their second halves (O, MLP) and the LM head; the
rest of a pass (embedding, cache bookkeeping, Python between the calls) is the pass's time
minus theirs; for ``q4_layers``' halves the q4_dot products inside them are timed too ("of
which"); where a w4a8 target runs every layer in one call (``q4_layers.FusedPass``), that call is
timed whole. Only targets whose layers run compiled (``kernels = "aoti"``) are split this way.
Then the greedy choice of a pass's tokens (``acceptance.argmax``) beside ATen's argmax, timed apart.
Prints milliseconds per pass and writes ``<out>/parts.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import torch

from dflash_core.acceptance import argmax
from dflash_core.aoti_layers import HalfThenDown
from dflash_core.engine import Engine
from dflash_core.q4_layers import Q4Before
from dflash_core.speculative import verify_pass

INSIDE = "  of which "  # a part timed inside another (q4_layers' products inside their halves)


def timed(name: str, fn: Callable, totals: Counter) -> Callable:
    def call(*args, **kwargs):
        began = time.perf_counter()
        out = fn(*args, **kwargs)
        totals[name] += time.perf_counter() - began
        return out

    return call


def _seconds(fn: Callable, repeats: int) -> float:
    """Seconds per call of ``fn``, over ``repeats`` calls."""
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - began) / repeats


class TimedRunner:
    """An AOTInductor runner whose ``run`` is timed as ``name``."""

    def __init__(self, runner, name: str, totals: Counter) -> None:
        self.run = timed(name, runner.run, totals)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="smollm2-135m-int8")
    parser.add_argument("--rows", default="2,16", help="row counts of the passes timed, comma-separated")
    parser.add_argument("--context", type=int, default=150, help="positions in the cache before the passes")
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--passes", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/pass_parts"))
    opts = parser.parse_args()

    runner = Engine.from_registry(opts.pair).target.runner
    if not getattr(runner, "compiled_layers", False):
        parser.error(f"pair {opts.pair}'s layers do not run compiled here ({getattr(runner, 'kernel_note', 'no note')})")
    totals: Counter = Counter()
    if runner._fused_pass is not None:  # q4_layers.FusedPass: every layer in one call, timed whole
        runner._fused_pass = timed("layers (one C++ call)", runner._fused_pass, totals)
    # The kernels' runners are timed (the engine may call them directly or through their wrappers).
    for layer in runner.layers if runner._fused_pass is None else ():
        if isinstance(layer.before, Q4Before):  # q4_layers: the halves, and inside them each product
            for kernel, name, method in ((layer.before.qkv, "qkv", "floats"), (layer.after.o, "o", "floats"),
                                         (layer.after.gate_up, "gate_up", "floats"), (layer.after.down, "down", "glu")):
                setattr(kernel, method, timed(f"{INSIDE}{name}", getattr(kernel, method), totals))
            layer.before = timed("qkv half", layer.before, totals)
            layer.after = timed("o and MLP half", layer.after, totals)
            continue
        layer.before.runner = TimedRunner(layer.before.runner, "qkv half", totals)
        if isinstance(layer.after, HalfThenDown):  # down apart, through int8_dot
            layer.after.half.runner = TimedRunner(layer.after.half.runner, "o and MLP half", totals)
            layer.after.down.rows = timed("down", layer.after.down.rows, totals)
        else:
            layer.after.runner = TimedRunner(layer.after.runner, "o and MLP half", totals)
    if runner.attention is not None:  # a pass straddling a span's end makes two calls
        runner.attention.runner = TimedRunner(runner.attention.runner, "attention", totals)
    runner._lm_head = timed("LM head", runner._lm_head, totals)
    context = torch.arange(100, 100 + opts.context)
    results = {"pair": opts.pair, "kernels": runner.kernel_note, "min_rows": runner.min_rows,
               "capacity": opts.capacity, "context": opts.context, "passes": {}}
    for rows in (int(r) for r in opts.rows.split(",")):
        block = torch.arange(300, 300 + rows)
        rounds = []
        for r in range(opts.rounds + 1):  # the first round warms up
            runner.reset(opts.capacity)
            runner.forward(context, None, last_only=True)
            totals.clear()
            began = time.perf_counter()
            for _ in range(opts.passes):
                verify_pass(runner.forward(block, None))  # every row's logits, as a pass computed them before
                runner.truncate(opts.context)
            per_pass = (time.perf_counter() - began) / opts.passes
            if r:
                parts = {name: 1e3 * seconds / opts.passes for name, seconds in totals.items()}
                outer = sum(ms for name, ms in parts.items() if not name.startswith(INSIDE))
                rounds.append({"pass": 1e3 * per_pass, **parts, "rest": 1e3 * per_pass - outer})
        median = {key: round(statistics.median(x[key] for x in rounds), 3) for key in rounds[0]}
        # After the pass, the greedy choice of its tokens (acceptance.argmax) against ATen's argmax.
        logits = runner.forward(block, None).logits
        median |= {name: round(1e3 * statistics.median(_seconds(lambda: choose(logits), opts.passes)
                                                       for _ in range(opts.rounds)), 3)
                   for name, choose in (("greedy choice", argmax), ("ATen argmax", lambda x: x.float().argmax(-1)))}
        results["passes"][rows] = {"median_ms": median, "rounds_ms": rounds}
        print(f"{rows} rows: " + ", ".join(f"{key} {value:.2f} ms" for key, value in median.items()), flush=True)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "parts.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
