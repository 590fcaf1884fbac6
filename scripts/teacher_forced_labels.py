"""How many exact drafter labels one teacher-forced target pass gives, against generating answers.

    python scripts/teacher_forced_labels.py --samples 200 --out runs/teacher-labels.json

For each source of text, the default target (its chat template, the registry's dtype rule) runs
a forward pass over prompt + answer (several texts stacked, as the features stage does), and
each answer anchor counts the slots whose label is exact (``dflash_core.training.teacher_labels``).
Sources:

* ``code``   — a third-party package function's stub as the task, the package's own code as the
  answer (the code-stub packages of the prompt set; never the standard library);
* ``chat``   — the opening turns of a chitchat-dataset conversation, the person's next turn as
  the answer;
* ``shards`` — the target's own committed answers: every slot should be exact there, up to
  near-ties that the pass and the generating decoder round differently (a check on the method).

Generation's rate, for comparison, is the manifest's ``tokens_per_s`` of the latest
``--generation-shards`` shards (printed with the machine that made them): generating gives one
exact label per slot per answer token, for every slot.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Iterator

from dflash_core.loading import load_target
from dflash_core.registry import load_registry
from dflash_core.training.features import STACK_TOKENS
from dflash_core.training.prompt_sources import CODE_PACKAGES, chitchat_replies, code_references
from dflash_core.training.selfdistill import chat_ids
from dflash_core.training.shards import DataDir, read_samples
from dflash_core.training.teacher_labels import LabelTally, greedy_after_each_position

SOURCES = ("code", "chat", "shards")


def texts(source: str, tokenizer: Any, samples: int, max_answer: int, shards: Path) -> Iterator[tuple[list[int], int]]:
    """(prompt + answer ids, index of the answer's first token) for ``samples`` texts of ``source``."""
    if source == "shards":
        for sample in read_samples(shards)[-samples:]:
            yield list(sample.prompt_ids) + list(sample.response_ids)[:max_answer], len(sample.prompt_ids)
        return
    pairs = code_references(per_package=samples // len(CODE_PACKAGES) + 1) if source == "code" else chitchat_replies(limit=samples)
    taken = 0
    for prompt, answer in pairs:
        if taken == samples:
            return
        prompt_ids = chat_ids(tokenizer, prompt.messages)
        answer_ids = tokenizer.encode(answer, add_special_tokens=False)
        # A whole answer ends where the target would stop: its end-of-turn token.
        answer_ids = answer_ids[:max_answer] if len(answer_ids) >= max_answer else answer_ids + [tokenizer.eos_token_id]
        if len(answer_ids) < 2:
            continue
        taken += 1
        yield prompt_ids + answer_ids, len(prompt_ids)


def run_stack(runner: Any, batch: list[tuple[list[int], int]], tally: LabelTally) -> None:
    """One pass over the texts of ``batch`` (stacked as the features stage stacks them), into ``tally``."""
    if not batch:
        return
    began = time.perf_counter()
    greedy = greedy_after_each_position(runner, [ids for ids, _ in batch])
    seconds = time.perf_counter() - began
    total = sum(len(ids) for ids, _ in batch)
    for (ids, first), g in zip(batch, greedy):
        tally.add(ids, g, first, seconds * len(ids) / total)  # the pass's time, shared by tokens
    batch.clear()


def generation_rate(shards: Path, last: int) -> dict[str, Any]:
    entries = DataDir(shards).shards[-last:]
    tokens, seconds = sum(e["answer_tokens"] for e in entries), sum(e["wall_s"] for e in entries)
    return {"shards": [e["file"] for e in entries], "answer_tokens_per_s": round(tokens / seconds, 1),
            "machines": sorted({e.get("machine", "?") for e in entries}), "dtypes": sorted({e.get("dtype", "?") for e in entries})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", default=",".join(SOURCES))
    parser.add_argument("--samples", type=int, default=200, help="texts per source")
    parser.add_argument("--max-answer-tokens", type=int, default=256)
    parser.add_argument("--slots", type=int, default=15, help="predicted slots per block (block size 16)")
    parser.add_argument("--shards", type=Path, default=Path("assets/data/smollm2-answers"))
    parser.add_argument("--generation-shards", type=int, default=5)
    parser.add_argument("--stack-tokens", type=int, default=STACK_TOKENS, help="tokens per stacked pass (the features stage's)")
    parser.add_argument("--pair", default="smollm2-135m")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    unknown = [s for s in args.sources.split(",") if s not in SOURCES]
    if unknown:
        raise SystemExit(f"unknown source(s) {unknown}; choose from {', '.join(SOURCES)}")
    target = load_target(load_registry().get(args.pair).target, "auto")
    report: dict[str, Any] = {"pair": args.pair, "slots": args.slots, "max_answer_tokens": args.max_answer_tokens,
                              "generation": generation_rate(args.shards, args.generation_shards), "sources": {}}
    greedy_after_each_position(target.runner, [list(range(100, 612))] * 2)  # untimed: first-call costs
    for source in args.sources.split(","):
        tally, count = LabelTally(args.slots), 0
        batch: list[tuple[list[int], int]] = []
        for ids, first in texts(source, target.tokenizer, args.samples, args.max_answer_tokens, args.shards):
            batch.append((ids, first))
            count += 1
            if sum(len(i) for i, _ in batch) >= args.stack_tokens:
                run_stack(target.runner, batch, tally)
        run_stack(target.runner, batch, tally)
        report["sources"][source] = {"texts": count, **tally.summary()}
        print(json.dumps({"source": source, **report["sources"][source]}), flush=True)
    print(json.dumps({"generation": report["generation"]}), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
