"""The target's own earlier answers as a second source of lookup guesses (retrieval drafting).

Prompt lookup (``lookup.py``) copies from the current text; a small model also repeats itself
*across* answers: the same openings, explanations, idioms and code shapes come back in answers to
other questions. ``AnswerCorpus`` holds the answers the target gave to the training prompts (the
committed shards, ``training/shards.py``: greedy, never HumanEval or the held-out prompts) and,
where the text's last tokens occurred in them, guesses what the target would say next: the
continuation most of those occurrences share (REST, He et al. 2023, does this with a suffix array
over a general datastore; here the datastore is the target's own output, so its continuations
tend to be what the target says). Like every draft, a guess only decides how many tokens a cycle
commits, never which: the output is unchanged.

The index keeps, for 3-grams and 2-grams of the answers, the sorted n-gram keys (token ids are
below 2**16, so an n-gram packs into one integer) and where each occurrence continues. A guess
looks the text's last 3 tokens up, else its last 2; among the occurrences (at most
``MAX_CANDIDATES``, spread evenly) it keeps those whose earlier tokens match the text furthest
back (up to ``MAX_BACK`` more), then follows them token by token, taking the continuation most of
them share and dropping the others.

How likely each guessed token is to be kept depends on how long the match is and on how many of
the occurrences agree on that token: ``chance_keys`` puts each token in a bucket of both, whose
chance ``lookup.LookupStats`` learns online.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .errors import DFlashError

NGRAMS = (3, 2)  # n-gram sizes looked up, longest first (a longer match is still found by MAX_BACK)
MAX_CANDIDATES = 512  # occurrences of an n-gram weighed at most (spread evenly over all of them)
FEW_OCCURRENCES = 32  # from this many occurrences down, a guess is made in Python lists, not numpy calls
MAX_BACK = 12  # how many tokens before the n-gram a match is extended to, to rank occurrences
END = np.iinfo(np.uint16).max  # between answers: no guess runs across it (token ids are below it)
MATCH_BUCKETS = (3, 4, 5, 7, 10)  # a match shorter than each of these goes in that bucket (10 and longer: the last)
SHARE_BUCKETS = (0.5, 0.8)  # the same for the share of occurrences agreeing on a token (one occurrence: its own bucket)


class AnswerCorpus:
    """Answers (token ids) indexed by their 2- and 3-grams; see the module's docstring.
    ``answers``: a list of answers, or one array of them already joined, each followed by ``END``."""

    def __init__(self, answers: Sequence[Sequence[int]] | np.ndarray) -> None:
        if isinstance(answers, np.ndarray):
            tokens = answers.astype(np.uint16)
        else:
            arrays = [np.asarray(a, dtype=np.int64) for a in answers]
            _check_ids(arrays)
            tokens = np.concatenate([np.append(a, END) for a in arrays] or [np.zeros(0, dtype=np.int64)])
            tokens = tokens.astype(np.uint16)
        self.tokens = tokens  # (N,) answers, each followed by END
        self.answers = int((tokens == END).sum())
        self._index = {n: self._build(n) for n in NGRAMS}

    def __len__(self) -> int:
        return len(self.tokens) - self.answers

    def _build(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Sorted keys of the n-grams that have a token after them, and where each continues."""
        tokens, size = self.tokens, len(self.tokens)
        count = max(size - n, 0)  # n-grams tokens[i : i + n] with a token at i + n
        keys = np.zeros(count, dtype=np.int64)  # n <= 3: at most 48 bits
        usable = tokens[n : n + count] != END  # the continuation's first token is an answer's
        for j in range(n):
            part = tokens[j : j + count]
            keys = (keys << 16) | part.astype(np.int64)
            usable &= part != END
        # torch's sort: several times numpy's argsort on millions of keys (it is loaded anyway)
        keys, order = torch.sort(torch.from_numpy(keys[usable]), stable=True)
        starts = np.flatnonzero(usable).astype(np.int32) + np.int32(n)
        return keys.numpy(), starts[order.numpy()]

    def continuation(self, text: Sequence[int], length: int) -> tuple[list[int], int, list[tuple[int, int]]]:
        """Up to ``length`` tokens guessed to follow ``text`` (its last ``NGRAMS[0] + MAX_BACK``
        tokens are enough), the length of the match behind the guess, and for each token how
        many of the occurrences still followed continue with it, of how many;
        ``[], 0, []`` where the text's last tokens occur nowhere."""
        if length <= 0:
            return [], 0, []
        for n in NGRAMS:
            if len(text) < n:
                continue
            key = 0
            for token in text[-n:]:
                key = (key << 16) | int(token)
            keys, starts = self._index[n]
            lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
            if hi == lo:
                continue
            found = starts[lo:hi]
            if len(found) <= FEW_OCCURRENCES:
                return self._few(found.tolist(), text, n, length)
            if len(found) > MAX_CANDIDATES:
                found = found[np.linspace(0, len(found) - 1, MAX_CANDIDATES).astype(np.int64)]
            found, back = self._longest_matches(found.astype(np.int64), text, n)
            guess, support = self._follow(found, length)
            return guess, n + back, support
        return [], 0, []

    def _few(self, found: list[int], text: Sequence[int], n: int,
             length: int) -> tuple[list[int], int, list[tuple[int, int]]]:
        """``continuation`` for a few occurrences (``found``, of the text's last ``n`` tokens), in
        Python lists: each occurrence's earlier and next tokens read in one slice, where numpy's
        calls would cost more than the tokens they read (scripts/corpus_speed.py)."""
        reach = min(MAX_BACK, len(text) - n)
        wanted = [text[-n - k] for k in range(1, reach + 1)]  # the text's tokens before the n-gram, going back
        best, kept = -1, []
        for at in found:
            first = max(at - n - reach, 0)
            window = self.tokens[first : at + length].tolist()
            ahead = window[at - first :]  # shorter only at the corpus's end, which is an END: never read past
            back, before = 0, at - n - first  # the earlier tokens in window[:before]
            while back < reach and back < before and window[before - 1 - back] == wanted[back]:
                back += 1
            if back > best:
                best, kept = back, [ahead]
            elif back == best:
                kept.append(ahead)
        guess, support = _follow_few(kept, [], [], length)
        return guess, n + best, support

    def _longest_matches(self, found: np.ndarray, text: Sequence[int], n: int) -> tuple[np.ndarray, int]:
        """Of the occurrences continuing at ``found`` (of the text's last ``n`` tokens), those
        whose earlier tokens match the text furthest back (at most ``MAX_BACK``), in their order,
        and how far. Every occurrence's earlier tokens are read in one gather (a numpy call per
        token back was a good part of a guess's time: scripts/corpus_speed.py)."""
        reach = min(MAX_BACK, len(text) - n)
        if reach <= 0:
            return found, 0
        at = found[:, None] - n - np.arange(1, reach + 1)  # (C, reach): each earlier token's place
        wanted = np.asarray(text[len(text) - n - reach : len(text) - n][::-1], dtype=np.int64)
        same = (at >= 0) & (self.tokens[np.maximum(at, 0)] == wanted)
        back = np.logical_and.accumulate(same, axis=1).sum(axis=1)  # tokens matched before the first that differs
        longest = int(back.max())
        return found[back == longest], longest

    def _follow(self, found: np.ndarray, length: int) -> tuple[list[int], list[tuple[int, int]]]:
        """The continuation most of the occurrences starting at ``found`` share, token by token,
        and how many of them continue with each token, of how many (a tie: the smallest token
        id). Their next ``length`` tokens are read in one gather (past the corpus's end: its last
        token, an ``END``); once ``FEW_OCCURRENCES`` or fewer are left, the walk goes on in Python
        lists: a numpy call costs more than a few occurrences' tokens (scripts/corpus_speed.py)."""
        tokens = self.tokens
        window = tokens[np.minimum(found[:, None] + np.arange(length), len(tokens) - 1)]  # (C, length)
        guess: list[int] = []
        support: list[tuple[int, int]] = []
        while len(window) > FEW_OCCURRENCES and len(guess) < length:
            following = window[:, len(guess)]
            token, count = following[0], len(window)
            if not (following == token).all():  # they part here: the continuation most share
                values, counts = np.unique(following, return_counts=True)
                token, count = values[counts.argmax()], int(counts.max())
            if token == END:
                return guess, support
            guess.append(int(token))
            support.append((count, len(window)))
            if count < len(window):
                window = window[following == token]
        return _follow_few(window.tolist(), guess, support, length)


def _follow_few(rows: list[list[int]], guess: list[int], support: list[tuple[int, int]],
                length: int) -> tuple[list[int], list[tuple[int, int]]]:
    """``AnswerCorpus._follow``'s walk over a few occurrences' next tokens (``rows``, from the
    token ``len(guess)`` on), extending ``guess`` and ``support``."""
    while len(guess) < length:
        at = len(guess)
        if len(rows) == 1:  # one occurrence left: copy it to its answer's end
            run = rows[0][at:]
            if END in run:
                run = run[: run.index(END)]
            guess += run
            support += [(1, 1)] * len(run)
            break
        following = [row[at] for row in rows]
        token, count = following[0], len(rows)
        if following.count(token) != count:  # they part here: the continuation most share
            counts = Counter(following)
            count = max(counts.values())
            token = min(t for t, c in counts.items() if c == count)
        if token == END:
            break
        guess.append(token)
        support.append((count, len(rows)))
        rows = [row for row in rows if row[at] == token]
    return guess, support


def chance_keys(match: int, support: Sequence[tuple[int, int]]) -> list[int]:
    """Each guessed token's bucket for ``LookupStats``, from the guess's match length
    (``MATCH_BUCKETS``) and the token's support (``continuation``): the share of occurrences
    agreeing on it (``SHARE_BUCKETS``), or a bucket of its own where one occurrence was left."""
    match_bucket = sum(match >= edge for edge in MATCH_BUCKETS)
    per_match = len(SHARE_BUCKETS) + 2  # the share buckets, then the lone occurrence's
    return [match_bucket * per_match + (per_match - 1 if of == 1 else sum(agree >= edge * of for edge in SHARE_BUCKETS))
            for agree, of in support]


def _check_ids(answers: Sequence[np.ndarray]) -> None:
    largest = max((int(a.max()) for a in answers if len(a)), default=0)
    if largest >= END:
        raise DFlashError(f"answer token id {largest}: lookup guesses from answers take token ids below {END} "
                          f"(this vocabulary is too large); remove lookup_answers for this pair")


@functools.lru_cache(maxsize=4)
def load_corpus(directory: str) -> AnswerCorpus:
    """Every answer in the shards of ``directory`` (``training/shards.py``'s layout), indexed
    once per process (pairs sharing a target share it)."""
    from .training.shards import read_answers

    shards = sorted(Path(directory).glob("shard-*.npz"))
    if not shards:
        raise DFlashError(f"lookup_answers = {directory!r}: no answer shards (shard-NNNNN.npz) there; "
                          f"point it at a directory `make gen-data` wrote, or remove the key")
    parts = []
    for shard in shards:
        flat, lengths = read_answers(shard)
        _check_ids([flat])
        parts.append(np.insert(flat.astype(np.int64), np.cumsum(lengths), END))
    return AnswerCorpus(np.concatenate(parts))
