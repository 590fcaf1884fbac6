"""Lossless acceptance rules, in one table (``RULES``) with one signature.

Notation: a cycle verifies ``k`` drafts after the anchor (a chain: block slots 1..k; or a tree's
nodes), and the target's distribution at a node is its prediction for the token that follows
it. A rule decides which drafts are kept; the target then supplies one more token, ``bonus``, so
a cycle commits ``num_accepted + 1`` tokens (the "acceptance length").

A rule is ``decide(target_output, sampling, draft) -> Verdict`` (the verify pass's
``TargetOutput``, whose logits it reads; the draft it verified). Most rules name the target's
own token after every verified node (``Verdict.choices``) and leave the keeping to the walk every
draft shape knows: keep drafts while they equal the target's token (a chain's prefix, a tree's
path; see ``tree.walk``). A rule that decides itself how many drafts to keep says so in
``Verdict.num_accepted`` and works on chains only (``Rule.trees``).

* ``greedy``: the target's argmax at every node the walk reaches (``greedy_choices``); the output
  is exactly the target's greedy decoding.
* ``match`` (z-lab's rule at temperature > 0): the target's own sample at every node. Each
  committed token is a sample of the target given the committed prefix, so the output follows
  the target's distribution exactly.
* ``pq`` (Leviathan et al. speculative sampling): a draft token ``x ~ q`` is kept with
  probability ``min(1, p(x) / q(x))``; at the first rejection the target's token is drawn from
  ``norm(max(0, p - q))``. Also exact, and it keeps more drafts when ``q`` is close to ``p``; it
  needs drafts drawn from the drafter's distribution (``SampledDrafts``).

Adding a rule is adding its function and a ``RULES`` entry: the loop looks the rule up once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

if TYPE_CHECKING:
    from .proposers import ChainDraft, TreeDraft
    from .target import TargetOutput


def warp(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The distribution a sampler draws from: softmax(logits / T), optionally top-k / top-p
    truncated and renormalised. fp32. ``logits``: (..., V)."""
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of ``probs`` (..., V) -> (...), by inverting the cumulative distribution:
    the first token whose running sum exceeds ``u * total`` for a uniform ``u``. On this CPU
    ``torch.multinomial`` takes 18 ms for a verified block's 17 rows of 49,152 probabilities,
    this 0.5 ms. It is as exact: ``cumsum`` accumulates float32 in double and rounds each running
    sum once (relative error <= 6e-8), and a token of probability 0 is never drawn (its running
    sum equals its predecessor's, and ``u * total`` stays strictly below the total)."""
    flat = probs.reshape(-1, probs.shape[-1]).float()
    cdf = flat.cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand(flat.shape[0], 1, generator=generator, device=flat.device)
    # u < 1, but u * total may round up to total: stay strictly below it.
    point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).view(probs.shape[:-1])


# Columns per block of ``argmax``'s first step.
ARGMAX_BLOCK = 128


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The greedy choice of every row (ties to the first index, NaN as ATen's argmax does).

    In float32: widening is exact, so the index is the same, and argmax over bf16 rows is slower.
    ATen's argmax over a long row runs one element at a time while its ``amax`` is vectorized
    (docs/BENCHMARKS.md: 16 rows of 49,152 logits, a verify block's), so where the vocabulary is
    a multiple of ``ARGMAX_BLOCK`` it goes in two steps: every block's maximum, the first block
    holding the row's maximum, then the first maximum within that block: ATen's index, since no
    earlier block holds a value as large."""
    x = logits.float()
    vocab = x.shape[-1]
    if vocab % ARGMAX_BLOCK or vocab == ARGMAX_BLOCK:
        return x.argmax(-1)
    blocks = x.reshape(-1, vocab // ARGMAX_BLOCK, ARGMAX_BLOCK)
    first = blocks.amax(-1).argmax(-1)
    within = blocks[torch.arange(blocks.shape[0], device=x.device), first].argmax(-1)
    return (first * ARGMAX_BLOCK + within).view(x.shape[:-1])


# A row's chance of being on a greedy walk's path (the drafts before it kept, as the proposer
# estimates it) at which ``greedy_choices`` computes its logits beside the row the walk needs
# now: a row computed in vain costs its share of the head's product, a row missed costs another
# call, which reads the whole head again (both measured in docs/benchmark-notes-avx2.md).
REACH_CHANCE = 0.3


def greedy_choices(out: TargetOutput, draft: ChainDraft | TreeDraft | None) -> torch.Tensor:
    """The target's argmax at the rows of ``out`` that a greedy walk over ``draft`` reaches (rows,
    with -1 at rows left out). ``draft.row_needed(choices)`` names the next row whose choice the
    walk needs, given the choices known so far (-1: not computed), or None once the walk has ended;
    ``draft.likely_after(row)`` lists that row and the rows the walk likely needs after it. Where
    ``out`` computes its logits as they are read, only those rows go through the head, in one call
    per row the walk needs that no earlier call computed: a verify whose drafts part from the
    target early pays the head for a few rows, not for the whole block. A computed row's choice is
    ``argmax``'s over all rows; with no draft, or logits computed already, every row's."""
    if draft is None or out.computed == out.rows:
        return argmax(out.logits)
    choices = [-1] * out.rows
    while (row := draft.row_needed(choices)) is not None:
        rows = [r for r in draft.likely_after(row) if choices[r] < 0]
        for r, choice in zip(rows, argmax(out.logits_at(rows)).tolist()):
            choices[r] = choice
    return torch.tensor(choices)  # logits computed as read are a CPU runner's


@dataclass(frozen=True)
class Sampling:
    """How the target's own tokens are chosen: the argmax at temperature 0, else a draw with
    ``generator`` from ``warp``'s distribution."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    generator: torch.Generator | None = None

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return warp(logits, self.temperature, self.top_p, self.top_k)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of ``logits`` (..., V) -> (...)."""
        return sample(self.probs(logits), self.generator) if self.temperature > 0 else argmax(logits)


@dataclass(frozen=True)
class SampledDrafts:
    """A chain of drafts drawn from the drafter's warped distribution ``q`` (what ``pq`` reads)."""

    tokens: torch.Tensor  # (k,) token ids
    probs: torch.Tensor  # (k, V') the distribution each draft was drawn from
    columns: torch.Tensor | None  # (V',) sorted: the token id of each column; None: the whole vocabulary


class Verdict(NamedTuple):
    """A rule's decision, still on the device (the loop moves it to the host once per cycle)."""

    choices: torch.Tensor  # (nodes,) the target's token after each verified node; (0,) if the rule draws none
    num_accepted: torch.Tensor | None = None  # () drafts kept, when the rule decides it (not by walking)
    bonus: torch.Tensor | None = None  # () with ``num_accepted``: the target's token after the kept drafts


def greedy(out: TargetOutput, sampling: Sampling, draft: ChainDraft | TreeDraft | None) -> Verdict:
    """Walk the target's argmax (``greedy_choices``: only the rows the walk reaches)."""
    return Verdict(greedy_choices(out, draft))


def match(out: TargetOutput, sampling: Sampling, draft: ChainDraft | TreeDraft | None) -> Verdict:
    """z-lab's rule: walk the target's own samples."""
    return Verdict(sample(sampling.probs(out.logits), sampling.generator))


def pq(out: TargetOutput, sampling: Sampling, draft: ChainDraft | TreeDraft | None) -> Verdict:
    """Speculative sampling of a chain; with nothing drawn from ``q`` (no drafts), ``match``."""
    sampled = None if draft is None else draft.sampled
    if sampled is None:
        return match(out, sampling, draft)
    accepted, bonus = pq_accept(sampled.tokens, sampled.probs, sampling.probs(out.logits), sampling.generator,
                                sampled.columns)
    return Verdict(sampled.tokens[:0], accepted, bonus)


@dataclass(frozen=True)
class Rule:
    """A ``RULES`` entry: ``decide(target output, sampling, draft) -> Verdict`` and what it needs."""

    decide: Callable[[TargetOutput, Sampling, ChainDraft | TreeDraft | None], Verdict]
    trees: bool = True  # decides by walking the target's choices, so it verifies trees too
    samples_drafts: bool = False  # reads ``SampledDrafts``: chain drafts must be drawn from q


RULES: dict[str, Rule] = {
    "greedy": Rule(greedy),
    "match": Rule(match),
    "pq": Rule(pq, trees=False, samples_drafts=True),
}
SAMPLED_RULES = tuple(name for name in RULES if name != "greedy")  # what temperature > 0 may use


def rule_for(temperature: float, name: str) -> Rule:
    """The rule a generation uses: ``greedy`` at temperature 0, else the named one."""
    return RULES["greedy" if temperature == 0 else name]


def pq_accept(
    draft: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    columns: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling with the drafter's own distribution ``draft_probs`` (k, V'), from
    which ``draft`` (k,) was sampled. ``columns`` (V',) sorted: the token id of each column of
    ``draft_probs`` when the drafter proposes from a draft vocabulary (q is zero elsewhere);
    ``None``: the whole vocabulary in order. -> (num_accepted, bonus)."""
    k = draft.shape[0]
    p = target_probs[:k].gather(-1, draft[:, None])[:, 0]
    where = draft if columns is None else torch.searchsorted(columns, draft)
    q = draft_probs.gather(-1, where[:, None])[:, 0]
    u = torch.rand(k, generator=generator, device=draft.device) if k else p
    # u < p/q, written without a division; q > 0 because x was drawn from q.
    accepted = _prefix_length(u * q < p)
    n = int(accepted)  # the one host sync this rule needs
    if n == k:
        return accepted, sample(target_probs[k], generator)
    if columns is None:
        residual = (target_probs[n] - draft_probs[n]).clamp_min(0)
    else:
        residual = target_probs[n].index_add(0, columns, draft_probs[n], alpha=-1).clamp_min(0)
    total = residual.sum()
    # total == 0 only when p == q exactly, where rejection has probability 0; guard anyway.
    dist = residual / total if float(total) > 0 else target_probs[n]
    return accepted, sample(dist, generator)


def _prefix_length(matches: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in a 1-D bool tensor (0-d tensor, no host sync)."""
    return matches.to(torch.int64).cumprod(0).sum()
