"""What running every layer in one C++ call (``q4_layers.FusedPass``) gained a w4a8 target: the
same generations with the pass as it runs and with the layer-by-layer calls, in one process,
taking turns; what docs/BENCHMARKS-AMD.md cites.

    python scripts/fused_pass_ab.py [--pair smollm2-135m-w4a8] [--prompts 3] [--rounds 3] [--max-new-tokens 200]

For AR (block 1), plain DFlash (block 16) and DFlash with draft trees (block 16, ``tree``), each
round generates greedily for the first ``--prompts`` HumanEval prompts once with the one-call pass
(chains and trees) and once without it, and prints tokens/s (prefill included) per round; the
token ids must be the same both ways (they are checked).
"""

from __future__ import annotations

import argparse
import statistics
import time

from dflash_core.bench.prompts import load_bench_prompts
from dflash_core.engine import Engine
from dflash_core.speculative import GenerationConfig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="smollm2-135m-w4a8")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    opts = parser.parse_args()
    engine = Engine.from_registry(opts.pair)
    runner = engine.target.runner
    fused = getattr(runner, "_fused_pass", None)
    if fused is None:
        parser.error(f"pair {opts.pair}'s target does not run its layers in one call here ({runner.kernel_note})")
    prompts = [p.text for p in load_bench_prompts("humaneval")[: opts.prompts]]

    def run(one_call: bool, config: GenerationConfig) -> tuple[float, list[list[int]]]:
        runner._fused_pass = fused if one_call else None
        began, tokens, outputs = time.perf_counter(), 0, []
        for prompt in prompts:
            ids = engine.generate(prompt, config).token_ids
            tokens += len(ids)
            outputs.append(ids)
        return tokens / (time.perf_counter() - began), outputs

    arms = {"AR": GenerationConfig(max_new_tokens=opts.max_new_tokens, block_size=1),
            "plain DFlash": GenerationConfig(max_new_tokens=opts.max_new_tokens, block_size=16),
            "DFlash trees": GenerationConfig(max_new_tokens=opts.max_new_tokens, block_size=16, tree=True)}
    run(True, arms["plain DFlash"])  # warm-up
    for name, config in arms.items():
        rates: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(opts.rounds):
            for one_call in (False, True):
                rate, outputs = run(one_call, config)
                rates[one_call].append(rate)
                if one_call:
                    assert outputs == reference, f"{name}: the one-call pass changed the output"
                else:
                    reference = outputs
        print(f"{name}: one call {', '.join(f'{r:.1f}' for r in rates[True])} tok/s; layer by layer "
              f"{', '.join(f'{r:.1f}' for r in rates[False])} (medians {statistics.median(rates[True]):.1f} / "
              f"{statistics.median(rates[False]):.1f})", flush=True)
    runner._fused_pass = fused
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
