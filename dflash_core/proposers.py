"""Where a cycle's drafts come from: proposers, and the two shapes of draft they return.

A proposer's ``propose`` returns a draft for the next cycle and its ``observe`` learns from what
the target kept; the loop (``speculative.stream``) never knows which proposer it has.

* ``NoDrafts``: the target alone (autoregressive decoding).
* ``ChainProposer``: the DFlash drafter's block as one chain, each slot's likeliest token (or,
  for a rule that reads ``q``, a draw from it); adaptive: cut to the length that pays best.
* ``TreeProposer``: the drafter's likeliest continuations as a tree (``tree.py``), with prompt
  lookup's guess (``lookup.py``) and the target's earlier answers' guess (``corpus.py``) grafted
  in; adaptive: cut to the prefix that pays best, and confident guesses verified alone, without
  running the drafter.

Adaptive proposers also let the drafter sit out while drafting does not pay
(``DraftingMeter``), and fill a block only as deep as recent cycles' verified drafts went
(``DrafterReach``).

A draft is a ``ChainDraft`` (flat tensors, verified by the target's plain forward) or a
``TreeDraft`` (verified by ``forward_tree``); both answer the same calls: ``verify`` (one
target pass), ``row_needed`` and ``likely_after`` (for a greedy verdict: the next row whose
target choice the walk needs, and the rows it likely needs after it: ``acceptance.greedy_choices``),
``settle`` (the rule's verdict to the host: the cycle's one transfer) and ``commit`` (the
target's cache and features cut to what was kept).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from .acceptance import REACH_CHANCE, Sampling, SampledDrafts, Verdict, sample
from .corpus import MAX_BACK, NGRAMS, AnswerCorpus, chance_keys
from .drafter import DFlashDrafter
from .lookup import LookupStats, NgramIndex, graft, worth_drafting
from .target import TargetOutput, TargetRunner
from .tree import BRANCHING, DraftTree, best_extension, build_tree, chain_tree, depth_first, node_needed, walk

DRAFT_COST_WEIGHT = 0.1  # weight of the newest cycle in the running means of the drafter's cost and gain
PAYS_WEIGHT = 0.3  # weight of the newest drafting cycle in DraftingMeter's means (it must notice a change of text)
# DrafterReach's block holds this many times the drafts the last cycles verified (room to notice
# that more would pay); drafts beyond it come too rarely to pay for a block twice as large.
REACH_HEADROOM = 1.5
REACH_WEIGHT = 0.3  # weight of the newest drafting cycle in DrafterReach's mean depth
MAX_SKIP = 32  # the most cycles in a row DraftingMeter has the drafter sit out before it drafts again


class DrafterReach:
    """Adaptive variants: how many slots the drafter fills next. A drafter pass over a whole
    block costs more than one over a few slots (on a CPU, markedly: docs/BENCHMARKS-AMD.md, "The
    block size on this CPU"), and where drafts past the first few are rarely worth verifying
    (prose, a weak drafter) that cost buys nothing. A running mean of how deep the verified
    drafts from the drafter went (``record``) sets the next block (``block``): the smallest power
    of two whose drafts reach ``REACH_HEADROOM`` times that deep, the whole block before anything
    was recorded. Verified drafts reaching the block's end raise the mean, so the block doubles
    where the text becomes predictable again. Where verifying more rows costs next to nothing (a
    GPU), the verified drafts go as deep as the drafter is confident and the block stays whole."""

    def __init__(self) -> None:
        self.depth: float | None = None

    def block(self, size: int) -> int:
        """The drafter's block (anchor included) for a cycle that may verify ``size - 1`` drafts."""
        if self.depth is None:
            return size
        block = 2
        while block < size and block - 1 < REACH_HEADROOM * self.depth:
            block *= 2
        return min(block, size)

    def record(self, depth: int) -> None:
        """A drafting cycle verified drafts from the drafter down to ``depth`` (0: none)."""
        w = REACH_WEIGHT
        self.depth = depth if self.depth is None else (1 - w) * self.depth + w * depth


class DraftingMeter:
    """Whether running the drafter has been paying against the target alone, for adaptive
    variants: running means of a drafting cycle's committed tokens and its measured time, against
    one token per cycle of the target alone: as measured in this run's cycles without drafts
    (``record_alone``: the same context, the loop's own overhead), ``verify_costs[0]`` (the
    target's single-token pass, calibrated after a short context) until there is one. Where
    drafting has been slower, the drafter sits out the next cycles (the target alone, exact as
    ever: 1, then 2, 4 ... up to ``MAX_SKIP`` while it keeps not paying), then drafts again to
    measure anew. A fast target with a weak drafter (tau near 2) otherwise makes an adaptive
    variant slower than AR. An engine carries one meter from a generation to the next of the
    same kind (``Engine.drafting_meter``): what it measured, and where it was in sitting out."""

    def __init__(self, verify_costs: Sequence[float]) -> None:
        self.single = verify_costs[0]
        self.alone: float | None = None
        self.tokens: float | None = None
        self.seconds: float | None = None
        self.skip, self.backoff = 0, 1

    def drafting(self) -> bool:
        """Whether this cycle runs the drafter (False: it sits out, one cycle fewer to go)."""
        if self.skip:
            self.skip -= 1
            return False
        return True

    def record(self, tokens: int, seconds: float) -> None:
        """A drafting cycle committed ``tokens`` in ``seconds`` (drafting and verifying)."""
        w = PAYS_WEIGHT
        self.tokens = tokens if self.tokens is None else (1 - w) * self.tokens + w * tokens
        self.seconds = seconds if self.seconds is None else (1 - w) * self.seconds + w * seconds
        single = self.single if self.alone is None else self.alone
        if self.tokens * single < self.seconds:  # fewer tokens a second than the target alone
            self.skip, self.backoff = self.backoff, min(2 * self.backoff, MAX_SKIP)
        else:
            self.backoff = 1

    def record_alone(self, seconds: float) -> None:
        """A cycle of the target alone (no drafts) took ``seconds``."""
        w = DRAFT_COST_WEIGHT
        self.alone = seconds if self.alone is None else (1 - w) * self.alone + w * seconds

    def observe(self, draft: Draft, tokens: int, seconds: float) -> None:
        """A cycle committed ``tokens`` in ``seconds``: a drafting cycle's record, or a cycle of
        the target alone's (a lookup guess verified alone is neither)."""
        if draft.drafter_ran:
            self.record(tokens, seconds)
        elif not draft.lookup_only:
            self.record_alone(seconds)


@dataclass
class Outcome:
    """What a cycle's verification decided, on the host."""

    num_accepted: int
    bonus: int
    drafted: list[int]  # the drafts an event shows: the kept ones first
    confidence: list[float]  # the drafter's probability of each of ``drafted``
    # the target's token at each node of the shown path, as far as it was computed (a greedy walk
    # computes it up to the first disagreement at least: acceptance.greedy_choices); [] if the rule drew none
    target_choices: list[int]
    lookup_drafted: int = 0  # how many of ``drafted`` (from the first) a lookup (prompt or answers) guessed
    lookup_kept: int = 0  # how many of prompt lookup's verified nodes were kept
    answers_kept: int = 0  # how many of the answers' guess's verified nodes were kept
    kept_nodes: list[int] = field(default_factory=list)  # a tree's kept path, root first


@dataclass(kw_only=True)
class Draft:
    """What every draft shape carries besides its tokens."""

    drafter_ran: bool = False  # the drafter ran this cycle (it has now seen its old context)
    lookup_only: bool = False  # lookup's guesses alone: the drafter did not run
    lookup_path: list[int] = field(default_factory=list)  # verified nodes on prompt lookup's guess, root excluded
    lookup_keys: list[int] = field(default_factory=list)  # their chance buckets (the match behind the guess)
    answers_path: list[int] = field(default_factory=list)  # verified nodes on the answers' guess (``corpus.py``)
    answers_keys: list[int] = field(default_factory=list)  # the chance bucket of each of its tokens (``corpus.chance_keys``)
    sampled: SampledDrafts | None = None  # drafts drawn from q, for a rule that reads it

    @property
    def tree_nodes(self) -> int:
        return 0


@dataclass(kw_only=True)
class ChainDraft(Draft):
    """Drafts for block slots 1..k after the anchor, verified by a plain forward of k + 1 tokens."""

    anchor: int
    tokens: torch.Tensor  # (k,) on the target's device
    confidence: torch.Tensor  # (k,) the drafter's probability of each

    def verify(self, target: TargetRunner, layer_ids: Sequence[int] | None) -> TargetOutput:
        block = torch.cat((torch.tensor([self.anchor], device=target.device), self.tokens))
        return target.forward(block, layer_ids)

    def row_needed(self, choices: list[int]) -> int | None:
        """The next row whose target choice a greedy walk needs, given those known (-1: not yet;
        ``acceptance.greedy_choices``): the first unknown one while every draft before it matched."""
        drafts = self.tokens.tolist()
        for row, choice in enumerate(choices):
            if choice < 0:
                return row
            if row == len(drafts) or choice != drafts[row]:
                return None
        return None

    def likely_after(self, row: int) -> list[int]:
        """``row``, then the rows after it while the drafter's chance of keeping every draft from
        there is at least ``REACH_CHANCE``."""
        rows, chance = [row], 1.0
        for slot, confidence in enumerate(self.confidence.tolist()[row:], start=row):
            chance *= confidence
            if chance < REACH_CHANCE:
                break
            rows.append(slot + 1)
        return rows

    def settle(self, verdict: Verdict) -> Outcome:
        k = len(self.tokens)
        head = () if verdict.num_accepted is None else (verdict.num_accepted.view(1), verdict.bonus.view(1))
        # One host transfer for the whole cycle (token ids are exact in float32 below 2**24).
        packed = torch.cat((*head, self.tokens, verdict.choices)).float()
        values = torch.cat((packed, self.confidence.float())).tolist()
        h, c = len(head), len(verdict.choices)
        drafted = [int(v) for v in values[h : h + k]]
        # -1: a row a greedy walk left out (acceptance.greedy_choices), all after its end
        choices = [int(v) for v in itertools.takewhile(lambda v: v >= 0, values[h + k : h + k + c])]
        if head:
            accepted, bonus = int(values[0]), int(values[1])
        else:  # keep drafts while they equal the target's choice
            accepted = next((i for i, (d, t) in enumerate(zip(drafted, choices)) if d != t), k)
            bonus = choices[accepted]
        # A chain's lookup nodes are its first ones.
        return Outcome(accepted, bonus, drafted, values[h + k + c :], choices,
                       lookup_drafted=max(len(self.lookup_path), len(self.answers_path)),
                       lookup_kept=min(len(self.lookup_path), accepted), answers_kept=min(len(self.answers_path), accepted))

    def commit(self, target: TargetRunner, outcome: Outcome, features: torch.Tensor | None,
               start: int) -> torch.Tensor | None:
        """Positions ``start..start + num_accepted`` hold the kept tokens; everything after is forgotten."""
        target.truncate(start + outcome.num_accepted + 1)
        return None if features is None else features[: outcome.num_accepted + 1]


@dataclass(kw_only=True)
class TreeDraft(Draft):
    """A depth-first draft tree (root: the anchor), verified by the target's ``forward_tree``."""

    tree: DraftTree

    @property
    def tree_nodes(self) -> int:
        return len(self.tree) - 1

    def verify(self, target: TargetRunner, layer_ids: Sequence[int] | None) -> TargetOutput:
        return target.forward_tree(self.tree, layer_ids)

    def row_needed(self, choices: list[int]) -> int | None:
        """The next node whose target choice a greedy walk needs (``acceptance.greedy_choices``)."""
        return node_needed(self.tree, choices)

    def likely_after(self, node: int) -> list[int]:
        """``node``, then its likeliest descendants (``best_extension``) while their estimated
        chance of being kept, given ``node`` reached, is at least ``REACH_CHANCE``."""
        scores = self.tree.scores
        below = best_extension(self.tree, [node])
        return [n for n in below if scores[n] >= REACH_CHANCE * scores[node]]

    def settle(self, verdict: Verdict) -> Outcome:
        tree = self.tree
        choices = verdict.choices.tolist()  # the cycle's one host transfer
        kept, bonus = walk(tree, choices)
        shown = best_extension(tree, kept)
        chosen = list(itertools.takewhile(lambda n: choices[n] >= 0, shown))  # those the target computed
        lookup, answers = set(self.lookup_path), set(self.answers_path)
        # All three are paths from the root: what they share with a guess's path is a prefix.
        return Outcome(len(kept) - 1, bonus, [tree.tokens[n] for n in shown[1:]],
                       [tree.scores[n] / tree.scores[tree.parents[n]] for n in shown[1:]],
                       [choices[n] for n in chosen],
                       lookup_drafted=max(len(lookup.intersection(shown[1:])), len(answers.intersection(shown[1:]))),
                       lookup_kept=len(lookup.intersection(kept)), answers_kept=len(answers.intersection(kept)),
                       kept_nodes=kept)

    def commit(self, target: TargetRunner, outcome: Outcome, features: torch.Tensor | None,
               start: int) -> torch.Tensor | None:
        target.keep_path(outcome.kept_nodes)
        return None if features is None else features[outcome.kept_nodes]


class Proposer(Protocol):
    def propose(self, anchor: int, start: int, size: int, started: float) -> ChainDraft | TreeDraft:
        """Drafts to verify after ``anchor`` (at position ``start``), at most ``size - 1`` of
        them; ``started``: when the cycle's drafting began (``Clock.now``), for adaptive cuts."""

    def observe(self, draft: ChainDraft | TreeDraft, outcome: Outcome, committed: list[int],
                features: torch.Tensor | None, start: int, draft_s: float, cycle_s: float) -> None:
        """Learn from a settled cycle: the ``committed`` tokens, the target's ``features`` of the
        kept positions (from ``start``), the measured drafting time ``draft_s`` and the whole
        cycle's ``cycle_s`` (drafting and verifying)."""


def _meter(verify_costs: Sequence[float] | None, carried: DraftingMeter | None) -> DraftingMeter | None:
    """An adaptive proposer's meter: ``carried`` (an engine's, from its earlier generations) or a
    new one; None without ``verify_costs`` (not adaptive)."""
    if not verify_costs:
        return None
    return carried if carried is not None else DraftingMeter(verify_costs)


def _no_drafts(anchor: int, device: torch.device) -> ChainDraft:
    return ChainDraft(anchor=anchor, tokens=torch.empty(0, dtype=torch.long, device=device),
                      confidence=torch.empty(0, device=device))


class NoDrafts:
    """The target alone: every cycle verifies the anchor and commits the target's next token."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def propose(self, anchor: int, start: int, size: int, started: float) -> ChainDraft:
        return _no_drafts(anchor, self.device)

    def observe(self, *_: object) -> None:
        """Nothing to learn."""


class DrafterBlock:
    """The DFlash drafter filling a block, and the target features it has not seen yet."""

    def __init__(self, drafter: DFlashDrafter, target: TargetRunner, features: torch.Tensor) -> None:
        self.drafter, self.target = drafter, target
        self.cache = drafter.new_cache()
        # (T, F) target features of positions context_start.. not yet seen, in the pieces the
        # cycles kept: joined when the drafter runs, not at every cycle it sits out (each join
        # copied all the pieces before it again)
        self.unseen = [features]
        self.context_start = 0

    @property
    def context(self) -> torch.Tensor:
        """The features the drafter has not seen yet, (T, F), from ``context_start``."""
        if len(self.unseen) > 1:
            self.unseen = [torch.cat(self.unseen)]
        return self.unseen[0]

    def logits(self, anchor: int, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafter logits for block slots 1..size-1, (size - 1, V'), and the token id of each of
        the V' columns (``None`` when they are the whole vocabulary in order; see
        ``DFlashDrafter.draft_vocab``)."""
        drafter, target = self.drafter, self.target
        param = next(drafter.parameters())
        block = torch.full((size,), drafter.mask_token_id, dtype=torch.long, device=target.device)
        block[0] = anchor
        noise = target.embed(block).to(device=param.device, dtype=param.dtype)[None]
        block_pos = torch.arange(start, start + size, device=param.device)
        ctx_pos = torch.arange(self.context_start, self.context_start + self.context.shape[0], device=param.device)
        hidden = drafter(noise, block_pos, self.context.to(param.device)[None], ctx_pos, cache=self.cache)[0, 1:]
        return drafter.draft_logits(hidden.to(device=target.device, dtype=target.lm_head_weight.dtype),
                                    target.lm_head_weight)

    def saw(self, features: torch.Tensor, start: int, ran: bool) -> None:
        """The kept positions' features (from ``start``): the next context; when the drafter did
        not run this cycle, added to the context it has not seen yet."""
        if ran:  # the drafter has now seen the old context
            self.unseen, self.context_start = [features], start
        else:
            self.unseen.append(features)


class ChainProposer:
    """The drafter's block as one chain: each slot's likeliest token, or with ``samples_drafts``
    a draw from the drafter's warped distribution (for ``pq``). With ``verify_costs``, cut to
    the length that maximises expected tokens per second (``choose_draft_length``)."""

    def __init__(self, block: DrafterBlock, sampling: Sampling, samples_drafts: bool,
                 verify_costs: Sequence[float] | None, now: Callable[[], float],
                 meter: DraftingMeter | None = None) -> None:
        self.block, self.sampling, self.samples_drafts = block, sampling, samples_drafts
        self.verify_costs, self.now = verify_costs, now
        self.meter = _meter(verify_costs, meter)
        self.reach = DrafterReach() if verify_costs else None

    def propose(self, anchor: int, start: int, size: int, started: float) -> ChainDraft:
        if size <= 1 or (self.meter is not None and not self.meter.drafting()):
            return _no_drafts(anchor, self.block.target.device)
        logits, columns = self.block.logits(anchor, start, size if self.reach is None else self.reach.block(size))
        probs = None
        if self.samples_drafts:
            probs = self.sampling.probs(logits)
            tokens = sample(probs, self.sampling.generator)
            confidence = probs.gather(-1, tokens[:, None])[:, 0]
        else:
            confidence, tokens = torch.softmax(logits.float(), -1).max(-1)
        if columns is not None:
            tokens = columns[tokens]
        if self.verify_costs:
            keep = choose_draft_length(confidence, self.verify_costs, t1_cost=self.now() - started)
            tokens, confidence = tokens[:keep], confidence[:keep]
            self.reach.record(keep)
            probs = None if probs is None else probs[:keep]
        sampled = None if probs is None else SampledDrafts(tokens, probs, columns)
        return ChainDraft(anchor=anchor, tokens=tokens, confidence=confidence, sampled=sampled, drafter_ran=True)

    def observe(self, draft: ChainDraft, outcome: Outcome, committed: list[int], features: torch.Tensor | None,
                start: int, draft_s: float, cycle_s: float) -> None:
        if self.meter is not None:
            self.meter.observe(draft, len(committed), cycle_s)
        self.block.saw(features, start, draft.drafter_ran)


@dataclass
class Guess:
    """A lookup's guess at the next tokens: the tokens, each one's chance and chance bucket (``LookupStats``)."""

    tokens: list[int]
    chances: list[float]
    keys: list[int]


class TreeProposer:
    """The drafter's likeliest continuations as a tree (``branching`` candidates per slot; 1:
    its chain), with prompt lookup's guess grafted in when ``lookup`` is given, and the target's
    earlier answers' guess too when ``answers`` is (with ``lookup`` only: it reads lookup's text).
    With ``verify_costs``: the prefix of the tree that pays best (``_draft_tree``), and confident
    guesses verified alone when running the drafter would not pay for itself (``worth_drafting``).
    A tree that comes out as a chain is verified as one (the plain forward is cheaper)."""

    def __init__(self, block: DrafterBlock, branching: int, lookup: tuple[NgramIndex, LookupStats] | None,
                 verify_costs: Sequence[float] | None, tree_costs: tuple[float, float],
                 now: Callable[[], float], answers: tuple[AnswerCorpus, LookupStats] | None = None,
                 meter: DraftingMeter | None = None) -> None:
        self.block, self.branching, self.lookup = block, branching, lookup
        self.answers = answers if lookup is not None else None
        self.verify_costs, self.tree_costs, self.now = verify_costs, tree_costs, now
        # Running means, for skipping the drafter: a drafting phase's time, and the tokens the
        # drafter adds where the guesses fail at once.
        self.draft_cost: float | None = None
        self.drafter_gain = 1.0
        self.meter = _meter(verify_costs, meter)
        self.reach = DrafterReach() if verify_costs else None

    def _guesses(self, count: int) -> tuple[Guess, Guess]:
        """Prompt lookup's and the answers' next ``count`` tokens (empty guesses where off)."""
        none = Guess([], [], [])
        if self.lookup is None:
            return none, none
        index, stats = self.lookup
        tokens, match = index.continuation(count)
        keys = [match] * len(tokens)  # prompt lookup's buckets: the match length
        prompt = Guess(tokens, stats.chances(keys), keys)
        if self.answers is None:
            return prompt, none
        corpus, answers_stats = self.answers
        tokens, match, support = corpus.continuation(index.tokens[-(NGRAMS[0] + MAX_BACK):], count)
        keys = chance_keys(match, support)
        return prompt, Guess(tokens, answers_stats.chances(keys), keys)

    def _guess_alone(self, anchor: int, guesses: Sequence[Guess], budget: int,
                     drafter_sits_out: bool = False) -> DraftTree | None:
        """The guesses' best prefix (a chain, or a tree where both are worth verifying), when it
        is worth verifying without running the drafter (or the drafter sits out this cycle); else None."""
        guesses = [g for g in guesses if g.tokens]
        if not (self.verify_costs and guesses and (self.draft_cost is not None or drafter_sits_out)):
            return None
        tree = DraftTree([anchor], [-1], [0], [1.0])
        for guess in guesses:
            tree = graft(tree, guess.tokens, guess.chances, budget)
        tree, _ = _best_prefix(tree, self.verify_costs, 0.0, self.tree_costs)
        nodes = len(tree) - 1
        if nodes == 0:
            return None
        expected = sum(tree.scores[1:])  # the chance of each node being kept, summed: tokens kept on average
        first = sum(tree.scores[n] for n in range(1, len(tree)) if tree.depths[n] == 1)
        if not drafter_sits_out and worth_drafting(expected, first, self.verify_costs[nodes], self.draft_cost,
                                                   self.drafter_gain):
            return None
        return depth_first(tree)

    def propose(self, anchor: int, start: int, size: int, started: float) -> ChainDraft | TreeDraft:
        device = self.block.target.device
        if size <= 1:
            return _no_drafts(anchor, device)
        from_prompt, from_answers = self._guesses(size - 1)
        if self.meter is not None and not self.meter.drafting():  # the drafter sits out: the guesses alone, if any
            tree = self._guess_alone(anchor, (from_prompt, from_answers), size - 1, drafter_sits_out=True)
            if tree is None:
                return _no_drafts(anchor, device)
        else:
            tree = self._guess_alone(anchor, (from_prompt, from_answers), size - 1)
        alone = tree is not None
        if not alone:
            logits, columns = self.block.logits(anchor, start, size if self.reach is None else self.reach.block(size))
            tree = _draft_tree(logits, columns, anchor, size - 1, self.verify_costs, self.now() - started,
                               self.tree_costs, self.branching,
                               [(g.tokens, g.chances) for g in (from_prompt, from_answers) if g.tokens])
        lookup_path, answers_path = tree.find_path(from_prompt.tokens), tree.find_path(from_answers.tokens)
        if not alone and self.reach is not None:  # how deep the drafter's own nodes went
            guessed = set(lookup_path) | set(answers_path)
            self.reach.record(max((tree.depths[n] for n in range(1, len(tree)) if n not in guessed), default=0))
        shared = dict(drafter_ran=not alone, lookup_only=alone, lookup_path=lookup_path,
                      lookup_keys=from_prompt.keys[: len(lookup_path)], answers_path=answers_path,
                      answers_keys=from_answers.keys[: len(answers_path)])
        if not tree.is_chain():
            return TreeDraft(tree=tree, **shared)
        return ChainDraft(anchor=anchor, tokens=torch.tensor(tree.tokens[1:], dtype=torch.long, device=device),
                          confidence=torch.tensor([tree.scores[n] / tree.scores[n - 1] for n in range(1, len(tree))],
                                                  device=device), **shared)

    def observe(self, draft: ChainDraft | TreeDraft, outcome: Outcome, committed: list[int],
                features: torch.Tensor | None, start: int, draft_s: float, cycle_s: float) -> None:
        w = DRAFT_COST_WEIGHT
        if self.meter is not None:
            self.meter.observe(draft, len(committed), cycle_s)
        if draft.drafter_ran:
            self.draft_cost = draft_s if self.draft_cost is None else (1 - w) * self.draft_cost + w * draft_s
            if outcome.lookup_kept == 0 and outcome.answers_kept == 0:
                self.drafter_gain = (1 - w) * self.drafter_gain + w * outcome.num_accepted
        if self.lookup is not None:
            index, stats = self.lookup
            stats.record(draft.lookup_keys, outcome.lookup_kept)  # nothing where no guessed node was verified
            if self.answers is not None:
                self.answers[1].record(draft.answers_keys, outcome.answers_kept)
            index.extend(committed)
        self.block.saw(features, start, draft.drafter_ran)


def _draft_tree(logits: torch.Tensor, columns: torch.Tensor | None, anchor: int, budget: int,
                verify_costs: Sequence[float] | None, t1_cost: float,
                tree_costs: tuple[float, float] = (0.0, 0.0), branching: int = BRANCHING,
                guesses: Sequence[tuple[Sequence[int], Sequence[float]]] = ()) -> DraftTree:
    """The draft tree of a cycle: the ``budget`` likeliest drafts (each node branching into at
    most ``branching`` candidates; 1: the drafter's chain), with each of ``guesses``' paths
    (tokens, the chance of each) grafted in; or with ``verify_costs`` the prefix of them (best
    first) that maximises expected tokens per second (``_best_prefix``)."""
    top_probs, top_ids = torch.softmax(logits.float(), -1).topk(min(branching, logits.shape[-1]), -1)
    if columns is not None:
        top_ids = columns[top_ids]
    tree = build_tree(anchor, top_probs.tolist(), top_ids.tolist(), budget)
    for tokens, chances in guesses:
        if len(tokens):
            tree = graft(tree, tokens, chances, budget)
    if verify_costs:
        tree, rate = _best_prefix(tree, verify_costs, t1_cost, tree_costs)
        # A prefix of the best-first order stops the chain where the first branch would come; a
        # longer chain of top drafts may pay better than any branching.
        chain_scores = top_probs[:, 0].cumprod(0).tolist()
        chain_keep, chain_rate = best_count_and_rate(chain_scores, verify_costs, t1_cost)
        if chain_rate > rate:
            return chain_tree(anchor, top_ids[:chain_keep, 0].tolist(), chain_scores[:chain_keep])
    return depth_first(tree)


def _best_prefix(tree: DraftTree, verify_costs: Sequence[float], t1_cost: float,
                 tree_costs: tuple[float, float]) -> tuple[DraftTree, float]:
    """The prefix of ``tree``'s nodes (best first, as ``build_tree`` and ``graft`` order them)
    that maximises expected tokens per second, and that rate: a tree with ``P > 1`` root-to-leaf
    paths costs ``branching + (P - 2) * per_path`` (``tree_costs``) more than a chain."""
    # Node scores never increase along the node order, and parents come first: any prefix
    # of the nodes is a tree, and the best prefix is found like a chain's best length.
    extra, leaves, has_child = [], 0, set()
    for parent in tree.parents[1:]:
        leaves += 1 if parent in has_child or not has_child else 0  # a new branch, or the first node
        has_child.add(parent)
        extra.append(0.0 if leaves < 2 else tree_costs[0] + tree_costs[1] * (leaves - 2))
    keep, rate = best_count_and_rate(tree.scores[1:], verify_costs, t1_cost, extra)
    keep += 1
    return DraftTree(tree.tokens[:keep], tree.parents[:keep], tree.depths[:keep], tree.scores[:keep]), rate


def best_count_and_rate(gains: Sequence[float], verify_costs: Sequence[float], t1_cost: float = 0.0,
                        extra_costs: Sequence[float] | None = None) -> tuple[int, float]:
    """How many drafts to verify when the ``i``-th adds ``gains[i]`` expected tokens and ``k``
    drafts cost ``verify_costs[k]`` (a block of ``k + 1``) plus ``t1_cost`` (plus
    ``extra_costs[k - 1]``): the ``k`` that maximises expected tokens per second (0: verify the
    anchor alone), and that rate."""
    k_max = min(len(gains), len(verify_costs) - 1)
    best_k, best_rate, expected = 0, 1.0 / (t1_cost + verify_costs[0]), 1.0
    for k in range(1, k_max + 1):
        expected += gains[k - 1]
        rate = expected / (t1_cost + verify_costs[k] + (extra_costs[k - 1] if extra_costs else 0.0))
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k, best_rate


def choose_draft_length(confidence: torch.Tensor, verify_costs: Sequence[float], t1_cost: float = 0.0) -> int:
    """How many drafts to verify: the k that maximises expected tokens per second.

    Treating the drafter's confidence ``c_i`` in slot ``i`` as the chance that the draft is kept
    (given all before it were), verifying ``k`` drafts commits on average
    ``1 + sum_{j<=k} prod_{i<=j} c_i`` tokens and costs ``verify_costs[k]`` (a block of ``k + 1``).
    The drafting cost is paid whatever ``k`` is, so it only enters through ``t1_cost``.
    """
    k_max = min(len(confidence), len(verify_costs) - 1)
    if k_max <= 0:
        return 0
    return best_count_and_rate(torch.cumprod(confidence[:k_max].float(), 0).tolist(), verify_costs, t1_cost)[0]
