"""Prompt lookup as a second source of drafts, verified in the same target pass as the drafter's.

Code and answers that quote their question repeat long runs of earlier tokens: a function's
signature, a docstring, a variable name. Where the last ``n`` tokens occurred before, the tokens
that followed that occurrence are a cheap guess at what comes next (transformers'
``prompt_lookup_num_tokens`` decodes with this guess alone). The DFlash drafter's slots decay
with depth, while a copied run, once its first tokens are right, tends to stay right for many
tokens: the two fail in different places. ``graft`` adds the lookup's continuation to the
cycle's draft tree as one more path, so one target pass checks both and the walk keeps whichever
the target agrees with. Like every draft, it only decides how many tokens a cycle commits, never
which ones: the output is unchanged.

How likely a lookup token is to be kept is estimated online (``LookupStats``): per n-gram size
and depth, from what the target kept in earlier cycles (an engine carries the estimates from one
generation to the next). Those estimates rank the lookup's nodes against the drafter's, price
them in adaptive drafting, and decide when a guess is confident enough to be verified without
running the drafter (``worth_drafting``).
"""

from __future__ import annotations

from typing import Sequence

from .tree import DraftTree

# Longest suffix matched. A one-off replay on greedy HumanEval answers preferred 3..1 to 2..1,
# 3..2 and 4..2 (lookup alone); not tuned further.
MAX_NGRAM = 3
MIN_NGRAM = 1
# How far back a match is measured (beyond the n-gram that found it), for the chance estimates:
# in that replay, the first guessed token was right 24-30% of the time after a 1-token match,
# ~60% after 3 tokens, 95% after 8 or more.
MAX_MATCH = 8


class NgramIndex:
    """Latest earlier occurrence of every 1..``MAX_NGRAM``-gram of a growing token sequence."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        # n-gram -> start of its latest occurrence that has at least one token after it
        self._latest: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            # The n-grams ending at the current last token now have a token after them.
            end = len(self.tokens)
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end >= n:
                    self._latest[tuple(self.tokens[end - n : end])] = end - n
            self.tokens.append(int(token))

    def continuation(self, length: int) -> tuple[list[int], int]:
        """``length`` tokens copied from after the latest earlier occurrence of the longest
        matching suffix (up to ``MAX_NGRAM`` tokens), and how long the match with that
        occurrence is, counted back up to ``MAX_MATCH`` tokens (``[]`` and 0 when nothing matches).

        The copy may run into the tokens it guesses (as LZ77 copies do): after ``a b a b`` the
        suffix ``a b`` last occurred two tokens back, and the guess goes on ``a b a b ...``, so
        repeated runs and periodic text are guessed to their full length."""
        if length <= 0:
            return [], 0
        tokens = self.tokens
        for n in range(min(MAX_NGRAM, len(tokens)), MIN_NGRAM - 1, -1):
            start = self._latest.get(tuple(tokens[-n:]))
            if start is not None:
                guess: list[int] = []
                for j in range(start + n, start + n + length):
                    guess.append(tokens[j] if j < len(tokens) else guess[j - len(tokens)])
                match, end = n, len(tokens)
                while match < MAX_MATCH and start - 1 - (match - n) >= 0 and \
                        tokens[start - 1 - (match - n)] == tokens[end - 1 - match]:
                    match += 1
                return guess, match
        return [], 0


class LookupStats:
    """Online estimate of the chance that a lookup token is kept given its parent was.

    Counted per (bucket, depth 1 / 2 / 3 and deeper), the bucket being what the guess's source
    says of each token: for prompt lookup the match length ``NgramIndex.continuation`` reports,
    for the earlier answers ``corpus.chance_keys``; each cell starts at ``prior`` with
    the weight of ``prior_weight`` observations, so the first cycles neither trust nor ignore
    the lookup. With ``memory``, older observations fade (each new one scales a bucket's counts
    by ``1 - 1 / memory``): an engine keeps one ``LookupStats`` across generations, so a new
    generation starts from what recent ones measured and still follows its own text.
    """

    DEPTHS = 3

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, memory: float | None = None) -> None:
        self._hits: dict[tuple[int, int], float] = {}
        self._tries: dict[tuple[int, int], float] = {}
        self.prior, self.prior_weight = prior, prior_weight
        self.keep = 1.0 - 1.0 / memory if memory else 1.0

    def _key(self, bucket: int, depth: int) -> tuple[int, int]:
        return bucket, min(depth, self.DEPTHS)

    def probability(self, bucket: int, depth: int) -> float:
        key = self._key(bucket, depth)
        return (self._hits.get(key, 0.0) + self.prior * self.prior_weight) / (self._tries.get(key, 0.0) + self.prior_weight)

    def chances(self, keys: Sequence[int]) -> list[float]:
        """The chance of each token of a guess whose ``i``-th token is in bucket ``keys[i]``
        (prompt lookup: its match length for all; the answers' guesses: ``corpus.chance_keys``)."""
        return [self.probability(key, depth) for depth, key in enumerate(keys, 1)]

    def record(self, keys: Sequence[int], kept: int) -> None:
        """A cycle verified a guess's first ``len(keys)`` tokens (their buckets, as ``chances``
        takes them) and kept the first ``kept``: the tokens up to the first rejected one were
        tried (their parents were kept)."""
        for depth in range(1, min(len(keys), kept + 1) + 1):
            key = self._key(keys[depth - 1], depth)
            self._tries[key] = self._tries.get(key, 0.0) * self.keep + 1
            self._hits[key] = self._hits.get(key, 0.0) * self.keep + (depth <= kept)


def worth_drafting(expected: float, first: float, verify_cost: float, draft_cost: float, drafter_gain: float) -> bool:
    """Whether a cycle whose lookup guesses are expected to add ``expected`` tokens (the chance
    of each guessed node being kept, summed), ``first`` of them at the first draft's place (the
    chance that one of the guesses' first tokens is kept), should also run the drafter.

    Drafting costs ``draft_cost``; its drafts mostly matter where the guesses fail at once (with
    chance ``1 - first``), and then add ``drafter_gain`` tokens on average. Taking the verify
    cost as ``verify_cost`` either way, drafting pays when
    ``(1 + E + (1 - first) * D) / (draft + verify) > (1 + E) / verify``.
    """
    if expected <= 0:
        return True
    return (1.0 - first) * drafter_gain * verify_cost > (1.0 + expected) * draft_cost


def graft(tree: DraftTree, tokens: Sequence[int], probs: Sequence[float], budget: int) -> DraftTree:
    """``tree`` with the path ``tokens`` added below its root, then cut to its ``budget`` best
    nodes (plus the root).

    ``probs[i]``: the chance that ``tokens[i]`` is kept given the token before it was. Where the
    path runs through a drafter node, that node's chance is the larger of the two estimates. A
    node's score is the product of its path's chances; nodes come best first, parents before
    children (a child never scores above its parent), as ``build_tree`` orders them.
    """
    size = len(tree)
    parents, tokens_out, depths = list(tree.parents), list(tree.tokens), list(tree.depths)
    chance = [1.0] + [tree.scores[n] / tree.scores[tree.parents[n]] if tree.scores[tree.parents[n]] > 0 else 0.0
                      for n in range(1, size)]
    children = {(parents[n], tokens_out[n]): n for n in range(1, size)}
    node = 0
    for token, p in zip(tokens, probs):
        child = children.get((node, int(token)))
        if child is None:
            child = len(tokens_out)
            tokens_out.append(int(token))
            parents.append(node)
            depths.append(depths[node] + 1)
            chance.append(float(p))
            children[(node, int(token))] = child
        else:
            chance[child] = max(chance[child], float(p))
        node = child
    scores = [1.0] * len(tokens_out)
    for n in range(1, len(tokens_out)):  # parents have lower indices than their children
        scores[n] = scores[parents[n]] * chance[n]
    # Best first; a tie goes to the shallower node, so a parent always precedes its children.
    order = [0] + sorted(range(1, len(tokens_out)), key=lambda n: (-scores[n], depths[n], n))[:budget]
    new = {old: i for i, old in enumerate(order)}
    return DraftTree([tokens_out[n] for n in order], [new.get(parents[n], -1) for n in order],
                     [depths[n] for n in order], [scores[n] for n in order])
