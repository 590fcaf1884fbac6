"""How far guesses alone go on the target's own greedy answers: prompt lookup, its earlier answers, both.

    python scripts/answer_guesses.py [--pair smollm2-135m-w4a8] [--prompts humaneval,heldout] [--limit 20]
        [--fractions 0.125,0.25,0.5,1] [--out runs/answer_guesses.json]

Generates each prompt's greedy answer (the target alone, ``--max-new-tokens``), then replays it
cycle by cycle: each guess (``--guess`` tokens) is compared with what the target said next, and a
cycle commits the agreeing prefix plus one token (what a cycle verifying that guess alone would
commit; the drafter and the cost of verifying play no part). Prints tokens per cycle for prompt
lookup alone (``lookup.NgramIndex``), the earlier answers alone (``corpus.AnswerCorpus``, on the
pair's ``lookup_answers``) and both as one tree (the longer agreeing prefix), with the answers'
index built on the first fraction of the answers (whole answers, in shard order) for each of
``--fractions``: what more committed data buys the guesses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from dflash_core.corpus import END, MAX_BACK, NGRAMS, AnswerCorpus, load_corpus
from dflash_core.engine import Engine
from dflash_core.evaluation import load_prompt_set
from dflash_core.lookup import NgramIndex
from dflash_core.request import Request
from dflash_core.speculative import collect

Guesser = Callable[[list[int], int], list[int]]


def agreeing(guess: Sequence[int], said: Sequence[int]) -> int:
    """How many of ``guess``'s first tokens equal what was said."""
    count = 0
    while count < min(len(guess), len(said)) and guess[count] == said[count]:
        count += 1
    return count


def tokens_per_cycle(answers: list[tuple[list[int], list[int]]], guessers: Sequence[Guesser], length: int) -> float:
    """Replays each (prompt ids, answer ids): a cycle keeps the longest agreeing prefix of any
    guesser's guess, plus the target's own next token; returns answer tokens per cycle."""
    cycles = tokens = 0
    for prompt, answer in answers:
        at = 0
        while at < len(answer):
            text = prompt + answer[:at]
            at += max(agreeing(guess(text, length), answer[at:]) for guess in guessers) + 1
            cycles += 1
        tokens += len(answer)
    return tokens / cycles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", default=None, help="a models.toml pair with lookup_answers (default: the default pair)")
    parser.add_argument("--prompts", default="humaneval,heldout")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--guess", type=int, default=15, help="tokens per guess (a block of 16 holds 15 drafts)")
    parser.add_argument("--fractions", default="0.125,0.25,0.5,1")
    parser.add_argument("--out", type=Path, default=Path("runs/answer_guesses.json"))
    args = parser.parse_args()

    engine = Engine.from_registry(args.pair)
    if engine.pair.lookup_answers is None:
        raise SystemExit(f"{engine.pair.name} names no lookup_answers in models.toml")
    everything = load_corpus(engine.pair.lookup_answers)
    ends = np.flatnonzero(everything.tokens == END)
    sets = {}
    for name in args.prompts.split(","):
        rows = []
        for prompt in load_prompt_set(name)[: args.limit]:
            resolved = engine.resolve(Request(prompt, variant="ar", max_new_tokens=args.max_new_tokens))
            rows.append((list(resolved.prompt_ids), collect(engine.stream_ids(resolved.prompt_ids, resolved.config)).token_ids))
        sets[name] = rows

    def from_prompt(text: list[int], length: int) -> list[int]:
        return NgramIndex(text).continuation(length)[0]

    report: dict = {"pair": engine.pair.name, "guess": args.guess, "limit": args.limit, "sets": {}}
    for name, rows in sets.items():
        report["sets"][name] = {"prompt lookup": round(tokens_per_cycle(rows, [from_prompt], args.guess), 3)}
        print(f"{name}: prompt lookup alone {report['sets'][name]['prompt lookup']:.3f} tokens/cycle")
    for fraction in (float(f) for f in args.fractions.split(",")):
        cut = int(ends[max(int(len(ends) * fraction), 1) - 1]) + 1
        corpus = AnswerCorpus(everything.tokens[:cut])

        def from_answers(text: list[int], length: int, corpus: AnswerCorpus = corpus) -> list[int]:
            return corpus.continuation(text[-(NGRAMS[0] + MAX_BACK):], length)[0]

        for name, rows in sets.items():
            alone = tokens_per_cycle(rows, [from_answers], args.guess)
            both = tokens_per_cycle(rows, [from_prompt, from_answers], args.guess)
            report["sets"][name][f"answers {fraction:g}"] = {"answer tokens": len(corpus), "alone": round(alone, 3),
                                                             "with prompt lookup": round(both, 3)}
            print(f"{name}: answers ({len(corpus):,} tokens) alone {alone:.3f}, with prompt lookup {both:.3f} tokens/cycle")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
