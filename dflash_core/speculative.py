"""The DFlash speculative loop, as a stream of per-cycle events (batch size 1).

One cycle reads as four steps::

    propose  a proposer drafts after the last token: a chain or a tree (proposers.py)
    verify   the target scores every draft in one forward pass
    accept   the rule (acceptance.RULES) keeps the drafts the target agrees with, plus one
             target token; its verdict reaches the host in one transfer
    commit   the target's KV cache keeps the committed positions; the proposer learns from them

The autoregressive baseline is the same loop without drafts (``proposers.NoDrafts``): the target
alone, one token per forward, same caches, same numerics. Everything else — the CLI, the
benchmark, the UI — consumes the ``CycleEvent`` stream this module yields.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import torch

from . import acceptance, proposers
from .drafter import DFlashDrafter
from .errors import SettingsError
from .corpus import AnswerCorpus
from .lookup import LookupStats, NgramIndex
from .proposers import best_count_and_rate, choose_draft_length  # noqa: F401  (public here too)
from .target import TargetOutput, TargetRunner
from .tree import BRANCHING, DraftTree, chain_tree, depth_first

MAX_TEMPERATURE = 10.0


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate. ``block_size`` None means the drafter's own; 1 means autoregressive."""

    max_new_tokens: int = 256
    block_size: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    rule: str = "match"  # acceptance rule at temperature > 0 (see acceptance.py)
    adaptive: bool = False  # verify only the drafts worth their cost (needs verify_costs)
    tree: bool = False  # verify a tree of the drafter's likeliest continuations (see tree.py)
    lookup: bool = False  # also verify what followed the last tokens' earlier occurrence (lookup.py)

    def validated(self, max_block_size: int, max_new_tokens_limit: int = 1 << 20) -> "GenerationConfig":
        """This config with ``block_size`` resolved, or a ``SettingsError`` naming what is allowed."""

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_new_tokens) or not 1 <= self.max_new_tokens <= max_new_tokens_limit:
            raise SettingsError(f"max_new_tokens = {self.max_new_tokens!r}; allowed: an integer from 1 to {max_new_tokens_limit}")
        block = max_block_size if self.block_size is None else self.block_size
        if not is_int(block) or not 1 <= block <= max_block_size:
            raise SettingsError(
                f"block_size = {self.block_size!r}; allowed: an integer from 1 (autoregressive) to {max_block_size} "
                f"(what this drafter was trained for)"
            )
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t <= MAX_TEMPERATURE:
            raise SettingsError(f"temperature = {t!r}; allowed: a number from 0 (greedy) to {MAX_TEMPERATURE}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise SettingsError(f"top_p = {self.top_p!r}; allowed: a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            raise SettingsError(f"top_k = {self.top_k!r}; allowed: an integer >= 0 (0 = off)")
        if self.seed is not None and not is_int(self.seed):
            raise SettingsError(f"seed = {self.seed!r}; allowed: an integer or nothing")
        if self.rule not in acceptance.SAMPLED_RULES:
            raise SettingsError(f"rule = {self.rule!r}; allowed: {', '.join(acceptance.SAMPLED_RULES)}")
        if not isinstance(self.adaptive, bool):
            raise SettingsError(f"adaptive = {self.adaptive!r}; allowed: true or false")
        if not isinstance(self.tree, bool):
            raise SettingsError(f"tree = {self.tree!r}; allowed: true or false")
        if not isinstance(self.lookup, bool):
            raise SettingsError(f"lookup = {self.lookup!r}; allowed: true or false")
        for name in ("tree", "lookup"):
            if getattr(self, name) and t > 0 and not acceptance.RULES[self.rule].trees:
                walked = " or ".join(f"rule = {r!r}" for r in acceptance.SAMPLED_RULES if acceptance.RULES[r].trees)
                raise SettingsError(f"{name} = true works with greedy decoding and {walked}; rule = {self.rule!r} "
                                    f"needs the drafter's own chain")
        return replace(self, block_size=block, temperature=float(t), top_p=float(self.top_p))


@dataclass
class CycleEvent:
    """What one step of the loop did. ``index`` 0 is the prefill (the first token)."""

    index: int
    position: int  # absolute position of the first token in ``committed``
    drafted: list[int]  # drafts for block slots 1..k (empty for the prefill and in AR mode)
    draft_confidence: list[float]  # drafter probability of each drafted token
    # the target's token at each verified slot (k + 1 of them; greedy, on a runner computing its
    # logits as read: up to the first disagreement at least, acceptance.greedy_choices)
    target_choices: list[int]
    num_accepted: int  # drafts kept
    bonus: int  # the target's own token after the kept drafts
    committed: list[int]  # tokens added to the output (cut at a stop token / max_new_tokens)
    draft_s: float
    verify_s: float
    tokens_so_far: int
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" when this is the last event
    # Tree cycles: drafts the target verified (``drafted`` shows one path through them: the kept
    # nodes, then the likeliest drafts below the last kept one). 0 for a chain.
    tree_nodes: int = 0
    lookup_nodes: int = 0  # verified drafts on prompt lookup's path (shared with the drafter's or not)
    lookup_only: bool = False  # the drafter did not run: lookup's guesses alone were verified
    lookup_drafted: int = 0  # how many of ``drafted`` (from the first) a lookup (prompt or answers) guessed
    answer_nodes: int = 0  # verified drafts on the guess from the target's earlier answers (corpus.py)

    @property
    def accept_len(self) -> int:
        """Drafts kept + the bonus token: tokens this cycle produced before any cut."""
        return self.num_accepted + 1

    @property
    def is_prefill(self) -> bool:
        return self.index == 0


@dataclass
class GenerationResult:
    """A whole generation, assembled from its events (see ``collect``)."""

    token_ids: list[int]
    finish_reason: str
    events: list[CycleEvent] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def cycles(self) -> list[CycleEvent]:
        return [e for e in self.events if not e.is_prefill]

    @property
    def acceptance_lengths(self) -> list[int]:
        return [e.accept_len for e in self.cycles if e.drafted]

    @property
    def tau(self) -> float:
        lengths = self.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else 1.0


class _Clock:
    """Per-phase wall time. On CUDA it synchronises first, so a phase is charged its own kernels;
    on CPU it is a plain ``perf_counter`` (operations finish before they return)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


@dataclass
class LoopState:
    """Where the loop stands between cycles."""

    anchor: int  # the newest committed token: block slot 0 of the next cycle, not yet in the target's cache
    start: int  # the anchor's absolute position
    produced: int  # tokens committed so far
    index: int = 0  # the latest event's index (0: the prefill)


def _proposer(config: GenerationConfig, rule: acceptance.Rule, sampling: acceptance.Sampling, target: TargetRunner,
              drafter: DFlashDrafter | None, features: torch.Tensor | None, committed: list[int],
              verify_costs: Sequence[float] | None, tree_costs: tuple[float, float], lookup_stats: LookupStats | None,
              now: Callable[[], float], answers: tuple[AnswerCorpus, LookupStats] | None = None,
              meter: proposers.DraftingMeter | None = None) -> proposers.Proposer:
    """The proposer ``config`` asks for (``drafter`` None: the target alone). ``features``: the
    prompt's; ``committed``: every token so far, prompt included."""
    if drafter is None:
        return proposers.NoDrafts(target.device)
    block = proposers.DrafterBlock(drafter, target, features)
    costs = verify_costs if config.adaptive and verify_costs else None
    if not (config.tree or config.lookup):
        return proposers.ChainProposer(block, sampling, rule.samples_drafts, costs, now, meter)
    lookup = (NgramIndex(committed), lookup_stats or LookupStats()) if config.lookup else None
    return proposers.TreeProposer(block, BRANCHING if config.tree else 1, lookup, costs, tree_costs, now, answers, meter)


@torch.inference_mode()
def stream(
    target: TargetRunner,
    drafter: DFlashDrafter | None,
    prompt_ids: Sequence[int],
    config: GenerationConfig,
    stop_ids: Sequence[int] = (),
    should_stop: Callable[[], bool] | None = None,
    verify_costs: Sequence[float] | None = None,
    tree_costs: tuple[float, float] = (0.0, 0.0),
    lookup_stats: LookupStats | None = None,
    answers: tuple[AnswerCorpus, LookupStats] | None = None,
    meter: proposers.DraftingMeter | None = None,
) -> Iterator[CycleEvent]:
    """Generate after ``prompt_ids``, yielding one ``CycleEvent`` per cycle.

    ``config`` must be validated (``GenerationConfig.validated``). ``should_stop`` is polled once
    per cycle; when it returns True the stream ends with ``finish_reason == "cancelled"``.
    ``verify_costs[s - 1]`` is the measured time of verifying ``s`` tokens; with
    ``config.adaptive`` it decides how many drafts each cycle verifies (see ``choose_draft_length``);
    a tree also pays ``tree_costs`` for branching, then per root-to-leaf path after the second
    (``measure_tree_costs``). ``lookup_stats``: the estimates prompt lookup starts from (an
    engine keeps one across generations); a fresh ``LookupStats`` when None. ``answers``: the
    target's own earlier answers and their chances, guessed from beside prompt lookup (``corpus.py``).
    ``meter``: with ``config.adaptive``, whether drafting has been paying (``proposers.DraftingMeter``),
    as earlier generations left it (an engine keeps one per kind of generation); a new one when None.
    """
    block_size = int(config.block_size or 1)
    speculative = drafter is not None and block_size > 1
    if speculative and (config.tree or config.lookup) and not hasattr(target, "forward_tree"):
        raise SettingsError("tree = true and lookup = true need the fast target runner (Llama-family targets, "
                            "engine 'auto' or 'fast')")
    layer_ids = drafter.target_layer_ids if speculative else None
    generator = None
    if config.temperature > 0:
        generator = torch.Generator(device=target.device)
        generator.manual_seed(config.seed if config.seed is not None else torch.seed())
    sampling = acceptance.Sampling(config.temperature, config.top_p, config.top_k, generator)
    rule = acceptance.rule_for(config.temperature, config.rule)
    stops = set(int(s) for s in stop_ids)
    clock = _Clock(target.device)
    n = len(prompt_ids)
    target.reset(n + config.max_new_tokens)

    def finish(tokens: list[int], produced: int) -> tuple[list[int], str | None]:
        """Cut ``tokens`` at the first stop token or at the token budget."""
        for i, tok in enumerate(tokens):
            if tok in stops:
                return tokens[: i + 1], "stop"
        room = config.max_new_tokens - produced
        if len(tokens) >= room:
            return tokens[:room], "length"
        return tokens, None

    # ---- prefill: the first token comes from the target alone
    t0 = clock.now()
    out = target.forward(torch.tensor(prompt_ids, dtype=torch.long), layer_ids, last_only=True)
    first = int(sampling.choose(out.logits[-1]))
    t1 = clock.now()
    committed, reason = finish([first], 0)
    state = LoopState(anchor=first, start=n, produced=len(committed))
    yield CycleEvent(index=0, position=n, drafted=[], draft_confidence=[], target_choices=[first], num_accepted=0,
                     bonus=first, committed=committed, draft_s=0.0, verify_s=t1 - t0, tokens_so_far=state.produced,
                     finish_reason=reason)
    if reason:
        return
    proposer = _proposer(config, rule, sampling, target, drafter if speculative else None, out.features,
                         list(prompt_ids) + committed, verify_costs, tree_costs, lookup_stats, clock.now, answers,
                         meter)
    while True:
        state.index += 1
        if should_stop is not None and should_stop():
            yield CycleEvent(index=state.index, position=state.start + 1, drafted=[], draft_confidence=[],
                             target_choices=[], num_accepted=0, bonus=state.anchor, committed=[], draft_s=0.0,
                             verify_s=0.0, tokens_so_far=state.produced, finish_reason="cancelled")
            return
        t0 = clock.now()
        draft = proposer.propose(state.anchor, state.start, min(block_size, config.max_new_tokens - state.produced), t0)
        t1 = clock.now()
        out = draft.verify(target, layer_ids)
        outcome = draft.settle(rule.decide(out, sampling, draft))
        t2 = clock.now()
        features = draft.commit(target, outcome, out.features, state.start)
        accepted = outcome.num_accepted
        committed, reason = finish(outcome.drafted[:accepted] + [outcome.bonus], state.produced)
        state.produced += len(committed)
        proposer.observe(draft, outcome, committed, features, state.start, t1 - t0, clock.now() - t0)
        yield CycleEvent(index=state.index, position=state.start + 1, drafted=outcome.drafted,
                         draft_confidence=outcome.confidence, target_choices=outcome.target_choices,
                         num_accepted=accepted, bonus=outcome.bonus, committed=committed, draft_s=t1 - t0,
                         verify_s=t2 - t1, tokens_so_far=state.produced, finish_reason=reason,
                         tree_nodes=draft.tree_nodes, lookup_nodes=len(draft.lookup_path),
                         lookup_only=draft.lookup_only, lookup_drafted=outcome.lookup_drafted,
                         answer_nodes=len(draft.answers_path))
        if reason:
            return
        state.anchor = outcome.bonus
        state.start += accepted + 1


def _interleaved_medians(target: TargetRunner, calls: Sequence[Callable[[], object]], context: int,
                         repeats: int) -> list[float]:
    """Median time of each of ``calls`` over ``repeats`` rounds after a warm-up round; every call
    runs once per round, so machine drift hits all of them alike. The target's cache is cut
    back to ``context`` positions after each call."""
    clock = _Clock(target.device)
    times: list[list[float]] = [[] for _ in calls]
    for round_ in range(repeats + 1):
        for i, call in enumerate(calls):
            t0 = clock.now()
            call()
            if round_:
                times[i].append(clock.now() - t0)
            target.truncate(context)
    return [sorted(t)[len(t) // 2] for t in times]


def verify_pass(out: TargetOutput) -> TargetOutput:
    """``out`` with every row's logits: what a timed verify pass includes, however its logits are
    computed. A greedy verify computes fewer (``acceptance.greedy_choices``), but measured with
    the head for two rows, the costs made the adaptive variants no faster
    (docs/benchmark-notes-avx2.md)."""
    out.logits
    return out


def measure_verify_costs(target: TargetRunner, max_block: int, context: int = 128, repeats: int = 5) -> list[float]:
    """Time of a target forward over 1..max_block tokens after ``context`` tokens (interleaved
    medians; ``verify_pass``), made non-decreasing in the number of tokens (``monotone``): a dip
    or a spike in one size is noise, and adaptive drafting would chase it."""
    ids = torch.arange(context + max_block, dtype=torch.long) % 1000 + 10
    target.reset(context + max_block)
    target.forward(ids[:context], None, last_only=True)
    calls = [lambda size=size: verify_pass(target.forward(ids[context : context + size], None))
             for size in range(1, max_block + 1)]
    return monotone(_interleaved_medians(target, calls, context, repeats))


def monotone(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in squared error (pool adjacent
    violators: a run that decreases is replaced by its mean)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def measure_tree_costs(target: TargetRunner, max_block: int, context: int = 128, repeats: int = 9) -> tuple[float, float]:
    """What a verified tree costs beyond a chain of as many nodes (``FastTarget.forward_tree``):
    ``(branching, per_path)``: the first branch, then each further root-to-leaf path. Measured
    on a chain, a tree of two paths and a star of ``max_block - 1`` leaves, after ``context``
    tokens. (0, 0) below 4 tokens."""
    if max_block < 4:
        return 0.0, 0.0
    ids = torch.arange(context, dtype=torch.long) % 1000 + 10
    nodes = list(range(max_block))
    tokens = [20 + n for n in nodes]
    chain = chain_tree(tokens[0], tokens[1:], [1.0] * (max_block - 1))
    fork = depth_first(DraftTree(tokens, [n - 1 for n in nodes[:-1]] + [0], nodes[:-1] + [1], [1.0] * max_block))
    star = DraftTree(tokens, [-1] + [0] * (max_block - 1), [0] + [1] * (max_block - 1), [1.0] * max_block)
    target.reset(context + max_block)
    target.forward(ids, None, last_only=True)
    calls = [lambda tree=tree: verify_pass(target.forward_tree(tree, None)) for tree in (chain, fork, star)]
    medians = _interleaved_medians(target, calls, context, repeats)
    branching = max(0.0, medians[1] - medians[0])
    return branching, max(0.0, (medians[2] - medians[1]) / (max_block - 3))


def collect(events: Iterator[CycleEvent]) -> GenerationResult:
    """Drain a stream into a ``GenerationResult`` (token ids, finish reason, timings)."""
    tokens: list[int] = []
    kept: list[CycleEvent] = []
    # Wall-clock time as a user sees it (every overhead included), not the sum of phases.
    started = time.perf_counter()
    first_at = started
    for event in events:
        if not kept:
            first_at = time.perf_counter()
        kept.append(event)
        tokens.extend(event.committed)
    ended = time.perf_counter()
    last = kept[-1]
    return GenerationResult(tokens, last.finish_reason or "length", kept, first_at - started, ended - first_at)
