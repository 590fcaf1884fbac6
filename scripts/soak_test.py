"""Long-run test: many consecutive generations in one process, watching resident memory.

    python scripts/soak_test.py --generations 200 --max-new-tokens 64

Alternates DFlash and AR over a set of prompts; after a warm-up (the first 20 generations),
resident memory (RSS) must grow by less than 10%. Prints a Markdown table, writes ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import psutil

PROMPTS = [
    "Write a Python function that reverses a list.",
    "Explain gravity to a child.",
    "What are three uses of a paperclip?",
    "Summarize the water cycle.",
    "Write a limerick about a cat.",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--generations", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/soak_test.json"))
    args = parser.parse_args()

    from dflash_core.engine import Engine
    from dflash_core.speculative import GenerationConfig

    process = psutil.Process()
    engine = Engine.from_registry()
    samples = []
    started = time.time()
    for i in range(args.generations):
        mode = "dflash" if i % 2 == 0 else "ar"
        engine.generate(PROMPTS[i % len(PROMPTS)], GenerationConfig(max_new_tokens=args.max_new_tokens), mode=mode)
        if (i + 1) % 10 == 0:
            gc.collect()
            samples.append((i + 1, process.memory_info().rss / 2**20))
            print(f"{i + 1:4d} generations  rss {samples[-1][1]:.0f} MiB", file=sys.stderr, flush=True)
    after_warmup = next(rss for n, rss in samples if n >= args.warmup)
    final = samples[-1][1]
    growth = (final - after_warmup) / after_warmup
    summary = {"generations": args.generations, "rss_after_warmup_mib": round(after_warmup, 1),
               "rss_final_mib": round(final, 1), "growth_percent": round(100 * growth, 2),
               "seconds": round(time.time() - started, 1), "max_new_tokens": args.max_new_tokens}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "rss_mib": samples}, indent=2))
    print("| generations | RSS after warm-up | RSS at the end | growth | time |")
    print("|---|---|---|---|---|")
    print(f"| {args.generations} | {after_warmup:.0f} MiB | {final:.0f} MiB | {100 * growth:+.2f}% | {summary['seconds']:.0f} s |")
    sys.exit(0 if growth < 0.10 else 1)


if __name__ == "__main__":
    main()
