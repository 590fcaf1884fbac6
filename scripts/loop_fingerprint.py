"""What the speculative loop decided, without its timings: a fingerprint to diff across a refactor.

    python scripts/loop_fingerprint.py --out /tmp/loop_before.json
    python scripts/loop_fingerprint.py --out /tmp/loop_after.json --against /tmp/loop_before.json

Runs the default pair (``Engine.from_registry()``, offline) on the first ``--prompts`` HumanEval
bench prompts for each variant below and writes, per variant and prompt, the committed tokens and
each cycle's decisions (acceptance length, drafted tokens, the target's choices, tree and lookup
counts); never a time. Each variant starts from fresh prompt-lookup estimates, so variants do not
depend on the order they run in.

``--against`` compares with an earlier fingerprint and exits 1 on a difference that matters:
every variant's tokens must match; cycle records must match except for variants whose choices
depend on measured times (``adaptive``), whose greedy tokens must equal AR's instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from dflash_core.bench.prompts import load_bench_prompts
from dflash_core.engine import LOOKUP_MEMORY, Engine
from dflash_core.lookup import LookupStats
from dflash_core.speculative import CycleEvent, GenerationConfig, collect

SAMPLED = GenerationConfig(temperature=0.7, seed=1)
# name -> (mode, config; max_new_tokens comes from the command line)
VARIANTS: dict[str, tuple[str, GenerationConfig]] = {
    "ar": ("ar", GenerationConfig()),
    "dflash": ("dflash", GenerationConfig()),
    "tree": ("dflash", GenerationConfig(tree=True)),
    "lookup": ("dflash", GenerationConfig(lookup=True)),
    "tree_lookup_adaptive": ("dflash", GenerationConfig(tree=True, lookup=True, adaptive=True)),
    "adaptive": ("dflash", GenerationConfig(adaptive=True)),
    "sampled_ar": ("ar", SAMPLED),
    "sampled_match": ("dflash", replace(SAMPLED, rule="match")),
    "sampled_pq": ("dflash", replace(SAMPLED, rule="pq")),
    "sampled_tree_lookup": ("dflash", replace(SAMPLED, rule="match", tree=True, lookup=True)),
}
TIMED = ("adaptive",)  # a variant whose name holds one of these decides from measured times


def cycle_record(event: CycleEvent) -> dict:
    return {
        "accept_len": event.accept_len,
        "drafted": event.drafted,
        "target_choices": event.target_choices,
        "confidence": [round(c, 6) for c in event.draft_confidence],
        "tree_nodes": event.tree_nodes,
        "lookup_nodes": event.lookup_nodes,
        "lookup_only": event.lookup_only,
        "lookup_drafted": event.lookup_drafted,
        "answer_nodes": event.answer_nodes,
        "finish_reason": event.finish_reason,
    }


def fingerprint(engine: Engine, prompts: list[str], max_new_tokens: int) -> dict:
    report: dict = {}
    for name, (mode, config) in VARIANTS.items():
        engine.lookup_stats = LookupStats(memory=LOOKUP_MEMORY)
        engine.answers_stats = LookupStats(memory=LOOKUP_MEMORY)
        runs = []
        for prompt in prompts:
            ids, valid = engine.prepare(prompt, replace(config, max_new_tokens=max_new_tokens), mode)
            result = collect(engine.stream_ids(ids, valid))
            runs.append({"tokens": result.token_ids, "cycles": [cycle_record(e) for e in result.cycles]})
        report[name] = runs
        lengths = [c["accept_len"] for run in runs for c in run["cycles"]]
        print(f"{name}: {len(lengths)} cycles, tau {sum(lengths) / len(lengths):.3f}", file=sys.stderr, flush=True)
    return report


def differences(now: dict, before: dict) -> list[str]:
    found = []
    for name, runs in before.items():
        if name not in now:
            found.append(f"{name}: missing")
            continue
        timed = any(word in name for word in TIMED)
        for i, (a, b) in enumerate(zip(now[name], runs)):
            if a["tokens"] != b["tokens"]:
                found.append(f"{name} prompt {i}: tokens differ")
            if not timed and a["cycles"] != b["cycles"]:
                first = next((j for j, (x, y) in enumerate(zip(a["cycles"], b["cycles"])) if x != y), None)
                found.append(f"{name} prompt {i}: cycles differ (first at cycle {first})")
    for name, runs in now.items():
        if not name.startswith("sampled") and name != "ar":
            found += [f"{name} prompt {i}: greedy tokens differ from AR's"
                      for i, run in enumerate(runs) if run["tokens"] != now["ar"][i]["tokens"]]
    return sorted(set(found))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4, help="first N HumanEval prompts")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--against", type=Path, help="an earlier fingerprint to compare with")
    args = parser.parse_args()

    prompts = [p.text for p in load_bench_prompts("humaneval")[: args.prompts]]
    report = fingerprint(Engine.from_registry(), prompts, args.max_new_tokens)
    args.out.write_text(json.dumps(report) + "\n")
    if args.against:
        found = differences(report, json.loads(args.against.read_text()))
        print("\n".join(found) if found else "no differences that matter", flush=True)
        sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
