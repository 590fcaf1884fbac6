"""Target passes of several pairs side by side: what docs/BENCHMARKS-AMD.md cites for the int4 pair
against the w8a8 one.

    python scripts/pass_times.py --pairs smollm2-135m-int4,smollm2-135m-w8a8 [--rows 2,16] [--rounds 3]

Loads each pair's target as the engine does, then per row count (2: an autoregressive step padded
to the multi-row threshold; 16: a verify block) times 30 passes after 150 cached positions, each
undone before the next, the pairs taking turns round by round; prints the median milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_core.engine import Engine
from dflash_core.speculative import verify_pass


def pass_ms(runner, context: torch.Tensor, block: torch.Tensor, passes: int = 30) -> float:
    """Milliseconds a pass of ``block`` over ``context`` (prefilled into a fresh cache), each undone."""
    runner.reset(512)
    runner.forward(context, None, last_only=True)
    began = time.perf_counter()
    for _ in range(passes):
        verify_pass(runner.forward(block, None))  # every row's logits
        runner.truncate(len(context))
    return (time.perf_counter() - began) / passes * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default="smollm2-135m-int4,smollm2-135m-w8a8")
    parser.add_argument("--rows", default="2,16")
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    runners = {}
    for pair in opts.pairs.split(","):
        runner = Engine.from_registry(pair).target.runner
        print(f"{pair}: {runner.weight_note} | {getattr(runner, 'kernel_note', '')}", flush=True)
        runners[pair] = runner
    context = torch.arange(100, 250)
    for rows in (int(r) for r in opts.rows.split(",")):
        block = torch.arange(300, 300 + rows)
        times: dict[str, list[float]] = {pair: [] for pair in runners}
        for round_ in range(opts.rounds + 1):  # the first round warms up
            for pair, runner in runners.items():
                ms = pass_ms(runner, context, block)
                if round_:
                    times[pair].append(ms)
        print(f"{rows} rows: " + ", ".join(f"{pair} {statistics.median(t):.2f} ms" for pair, t in times.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
