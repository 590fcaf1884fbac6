"""The features stage's throughput, one sequence per pass against several stacked: the figures
docs/TRAINING.md cites.

    python scripts/bench_features.py --sequences 64 --rounds 2 --stacks 1,1024,2048,4096

Runs the default pair's target (the dtype the recipe's probe picks) over the first
``--sequences`` answers of the committed shards, writing a throwaway feature cache per arm;
the arms are interleaved within each round so that a drift of the shared machine hits them
alike. ``--stacks 1`` is one sequence per pass (the path before stacking). Prints tokens/s per
arm and round, and per target layer the largest relative difference of a token's features
(L2 norm of the difference over the first arm's) between an arm and the first arm.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from dflash_core.loading import load_target
from dflash_core.registry import load_registry
from dflash_core.training.features import build_feature_cache
from dflash_core.training.shards import read_samples

LAYERS = [1, 8, 15, 22, 27, 29]  # the bundled drafter's FEATURE_LAYERS (Makefile)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", default="assets/data/smollm2-answers")
    ap.add_argument("--pair", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--stacks", default="1,2048", help="stack_tokens per arm; 1 = one sequence per pass")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()

    registry = load_registry()
    target = load_target(registry.get(args.pair).target, args.dtype, "cpu")
    samples = read_samples(args.shards)[: args.sequences]
    tokens = sum(len(s.ids) for s in samples)
    stacks = [int(x) for x in args.stacks.split(",")]
    rates: dict[int, list[float]] = {s: [] for s in stacks}
    diffs: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for stack in stacks:
                out = Path(tmp) / f"r{r}-s{stack}"
                started = time.perf_counter()
                store = build_feature_cache(target.runner, samples, LAYERS, out, stack_tokens=stack)
                rates[stack].append(tokens / (time.perf_counter() - started))
                if r == 0:
                    feats = torch.cat([store.sequence(i)[1] for i in range(len(store))]).float()
                    if stack == stacks[0]:
                        reference = feats
                    diffs[stack] = [round(float(((f - ref).norm(dim=1) / ref.norm(dim=1)).max()), 4)
                                    for f, ref in zip(feats.chunk(len(LAYERS), 1), reference.chunk(len(LAYERS), 1))]
                print(f"round {r} stack {stack}: {rates[stack][-1]:.0f} tokens/s", flush=True)
    result = {"dtype": str(target.runner.dtype), "sequences": len(samples), "tokens": tokens,
              "tokens_per_s": {str(s): [round(x, 1) for x in v] for s, v in rates.items()},
              "max_relative_diff_by_layer_vs_first_arm": {str(s): d for s, d in diffs.items()}}
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
