"""The DFlash speculative loop, as a stream of per-cycle events (batch size 1).

One cycle reads as four steps::

    draft   the drafter fills the block [last token, MASK x (B-1)] in one forward pass
    verify  the target scores the whole block in one forward pass
    accept  keep the longest prefix of drafts the target agrees with, plus one target token
    update  roll the target's KV cache back to the committed length; keep the new features

The autoregressive baseline is the same loop with block size 1 (no drafter): the target alone,
one token per forward, same caches, same numerics. Everything else — the CLI, the benchmark,
the UI — consumes the ``CycleEvent`` stream this module yields.
"""

from __future__ import annotations

import itertools
import math
import operator
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import torch

from . import acceptance
from .drafter import DFlashDrafter
from .errors import SettingsError
from .lookup import LookupStats, NgramIndex, graft, worth_drafting
from .target import TargetRunner
from .tree import BRANCHING, DraftTree, build_tree, chain_tree, depth_first, walk

RULES = ("match", "pq")
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
        if self.rule not in RULES:
            raise SettingsError(f"rule = {self.rule!r}; allowed: {', '.join(RULES)}")
        if not isinstance(self.adaptive, bool):
            raise SettingsError(f"adaptive = {self.adaptive!r}; allowed: true or false")
        if not isinstance(self.tree, bool):
            raise SettingsError(f"tree = {self.tree!r}; allowed: true or false")
        if not isinstance(self.lookup, bool):
            raise SettingsError(f"lookup = {self.lookup!r}; allowed: true or false")
        for name in ("tree", "lookup"):
            if getattr(self, name) and t > 0 and self.rule == "pq":
                raise SettingsError(f"{name} = true works with greedy decoding and rule = 'match'; rule = 'pq' needs "
                                    f"the drafter's own chain")
        return replace(self, block_size=block, temperature=float(t), top_p=float(self.top_p))


@dataclass
class CycleEvent:
    """What one step of the loop did. ``index`` 0 is the prefill (the first token)."""

    index: int
    position: int  # absolute position of the first token in ``committed``
    drafted: list[int]  # drafts for block slots 1..k (empty for the prefill and in AR mode)
    draft_confidence: list[float]  # drafter probability of each drafted token
    target_choices: list[int]  # target's token at each verified slot (k + 1 of them)
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
    lookup_only: bool = False  # the drafter did not run: prompt lookup's guess alone was verified
    lookup_drafted: int = 0  # how many of ``drafted`` (from the first) prompt lookup guessed

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


def _draft_block(
    drafter: DFlashDrafter,
    target: TargetRunner,
    cache,
    anchor: int,
    start: int,
    size: int,
    context: torch.Tensor,
    context_start: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafter logits for block slots 1..size-1, (size - 1, V'), and the token id of each of the V'
    columns (``None`` when they are the whole vocabulary in order; see ``DFlashDrafter.draft_vocab``)."""
    device = next(drafter.parameters()).device
    dtype = next(drafter.parameters()).dtype
    block = torch.full((size,), drafter.mask_token_id, dtype=torch.long, device=target.device)
    block[0] = anchor
    noise = target.embed(block).to(device=device, dtype=dtype)[None]
    block_pos = torch.arange(start, start + size, device=device)
    ctx_pos = torch.arange(context_start, context_start + context.shape[0], device=device)
    hidden = drafter(noise, block_pos, context.to(device)[None], ctx_pos, cache=cache)[0, 1:]
    return drafter.draft_logits(hidden.to(device=target.device, dtype=target.lm_head_weight.dtype), target.lm_head_weight)


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
) -> Iterator[CycleEvent]:
    """Generate after ``prompt_ids``, yielding one ``CycleEvent`` per cycle.

    ``config`` must be validated (``GenerationConfig.validated``). ``should_stop`` is polled once
    per cycle; when it returns True the stream ends with ``finish_reason == "cancelled"``.
    ``verify_costs[s - 1]`` is the measured time of verifying ``s`` tokens; with
    ``config.adaptive`` it decides how many drafts each cycle verifies (see ``choose_draft_length``);
    a tree also pays ``tree_costs`` for branching, then per root-to-leaf path after the second
    (``measure_tree_costs``). ``lookup_stats``: the estimates prompt lookup starts from (an
    engine keeps one across generations); a fresh ``LookupStats`` when None.
    """
    block_size = int(config.block_size or 1)
    speculative = drafter is not None and block_size > 1
    use_tree = speculative and (config.tree or config.lookup)
    if use_tree and not hasattr(target, "forward_tree"):
        raise SettingsError("tree = true and lookup = true need the fast target runner (Llama-family targets, "
                            "engine 'auto' or 'fast')")
    layer_ids = drafter.target_layer_ids if speculative else None
    sampling = config.temperature > 0
    generator = None
    if sampling:
        generator = torch.Generator(device=target.device)
        generator.manual_seed(config.seed if config.seed is not None else torch.seed())
    stops = set(int(s) for s in stop_ids)
    clock = _Clock(target.device)
    n = len(prompt_ids)
    target.reset(n + config.max_new_tokens)

    def choose(logits: torch.Tensor) -> torch.Tensor:
        if sampling:
            return acceptance.sample(acceptance.warp(logits, config.temperature, config.top_p, config.top_k), generator)
        return acceptance.argmax(logits)

    def finish(committed: list[int], produced: int) -> tuple[list[int], str | None]:
        """Cut ``committed`` at the first stop token or at the token budget."""
        for i, tok in enumerate(committed):
            if tok in stops:
                return committed[: i + 1], "stop"
        room = config.max_new_tokens - produced
        if len(committed) >= room:
            return committed[:room], "length"
        return committed, None

    # ---- prefill: the first token comes from the target alone
    t0 = clock.now()
    out = target.forward(torch.tensor(prompt_ids, dtype=torch.long), layer_ids, last_only=True)
    first = int(choose(out.logits[-1]))
    t1 = clock.now()
    committed, reason = finish([first], 0)
    produced = len(committed)
    yield CycleEvent(0, n, [], [], [first], 0, first, committed, 0.0, t1 - t0, produced, reason)
    if reason:
        return

    context = out.features  # (n, F) features not yet seen by the drafter
    ngrams = NgramIndex(list(prompt_ids) + committed) if speculative and config.lookup else None
    lookup_stats = lookup_stats or LookupStats()
    draft_cost, drafter_gain = None, 1.0  # running means, for skipping the drafter (adaptive lookup)
    context_start = 0
    cache = drafter.new_cache() if speculative else None
    last = first
    start = n  # absolute position of ``last``
    index = 0
    while True:
        index += 1
        if should_stop is not None and should_stop():
            yield CycleEvent(index, start + 1, [], [], [], 0, last, [], 0.0, 0.0, produced, "cancelled")
            return
        size = min(block_size, config.max_new_tokens - produced) if speculative else 1
        t0 = clock.now()
        draft = torch.empty(0, dtype=torch.long, device=target.device)
        conf = torch.empty(0, device=target.device)
        draft_probs = None
        tree = None
        guess, match_len, lookup_path = [], 0, []
        drafting = size > 1
        if size > 1 and use_tree:
            if ngrams is not None:
                guess, match_len = ngrams.continuation(size - 1)
            chances = lookup_stats.probabilities(match_len, len(guess))
            if config.adaptive and verify_costs and guess and draft_cost is not None:
                # A confident guess may be worth verifying alone, without paying for the drafter.
                gains = list(itertools.accumulate(chances, operator.mul))
                keep = best_count_and_rate(gains, verify_costs)[0]
                drafting = keep == 0 or worth_drafting(gains[:keep], verify_costs[keep], draft_cost, drafter_gain)
            if drafting:
                logits, columns = _draft_block(drafter, target, cache, last, start, size, context, context_start)
                tree = _draft_tree(logits, columns, last, size - 1, verify_costs if config.adaptive else None,
                                   clock.now() - t0, tree_costs, BRANCHING if config.tree else 1, (guess, chances))
            else:
                tree = chain_tree(last, guess[:keep], gains[:keep])
            lookup_path = tree.find_path(guess)
            if tree.is_chain():  # verified as a chain below: the plain forward is cheaper
                draft = torch.tensor(tree.tokens[1:], dtype=torch.long, device=target.device)
                conf = torch.tensor([tree.scores[n] / tree.scores[n - 1] for n in range(1, len(tree))], device=target.device)
                tree = None
        elif size > 1:
            logits, columns = _draft_block(drafter, target, cache, last, start, size, context, context_start)
            if sampling and config.rule == "pq":
                draft_probs = acceptance.warp(logits, config.temperature, config.top_p, config.top_k)
                draft = acceptance.sample(draft_probs, generator)
                conf = draft_probs.gather(-1, draft[:, None])[:, 0]
            else:
                probs = torch.softmax(logits.float(), -1)
                conf, draft = probs.max(-1)
            if columns is not None:
                draft = columns[draft]
            if config.adaptive and verify_costs:
                keep = choose_draft_length(conf, verify_costs, t1_cost=clock.now() - t0)
                draft, conf = draft[:keep], conf[:keep]
                if draft_probs is not None:
                    draft_probs = draft_probs[:keep]
        t1 = clock.now()
        if drafting and use_tree:
            draft_cost = t1 - t0 if draft_cost is None else 0.9 * draft_cost + 0.1 * (t1 - t0)
        if tree is not None:
            out = target.forward_tree(tree, layer_ids)
            choices = choose(out.logits).tolist()  # the cycle's one host transfer
            kept, bonus_id = walk(tree, choices)
            t2 = clock.now()
            a = len(kept) - 1
            # The event shows one path: the kept nodes, then the likeliest drafts below them.
            shown = _shown_path(tree, kept)
            # All three are paths from the root: what they share with the lookup's is a prefix.
            shown_from_lookup = len(set(shown[1:]).intersection(lookup_path))
            lookup_kept = len(set(kept).intersection(lookup_path))
            drafted = [tree.tokens[n] for n in shown[1:]]
            confidence = [tree.scores[n] / tree.scores[tree.parents[n]] for n in shown[1:]]
            target_choices = [choices[n] for n in shown]
            target.keep_path(kept)
            kept_features = out.features[kept]
        else:
            block = torch.cat((torch.tensor([last], device=target.device), draft))
            out = target.forward(block, layer_ids)
            if not sampling:
                accepted, bonus, choices = acceptance.greedy(draft, out.logits)
            else:
                target_probs = acceptance.warp(out.logits, config.temperature, config.top_p, config.top_k)
                if draft_probs is not None:
                    accepted, bonus = acceptance.pq(draft, draft_probs, target_probs, generator, columns)
                    choices = None
                else:
                    accepted, bonus, choices = acceptance.match(draft, target_probs, generator)
            # One host transfer for the whole cycle (token ids are exact in float32 below 2**24).
            k = len(draft)
            choices = choices if choices is not None else draft[:0]
            packed = torch.cat((accepted.view(1), bonus.view(1), draft, choices)).float()
            values = torch.cat((packed, conf.float())).tolist()
            t2 = clock.now()
            a, bonus_id = int(values[0]), int(values[1])
            drafted = [int(v) for v in values[2 : 2 + k]]
            target_choices = [int(v) for v in values[2 + k : 2 + k + len(choices)]]
            confidence = values[2 + k + len(choices) :]
            # update: positions start..start+a hold the kept tokens; everything after is forgotten.
            target.truncate(start + a + 1)
            kept_features = out.features[: a + 1] if speculative else None
            # A chain: the lookup's nodes are its first ones.
            shown_from_lookup, lookup_kept = len(lookup_path), min(len(lookup_path), a)
        if lookup_path:
            lookup_stats.record(match_len, len(lookup_path), lookup_kept)
        if drafting and use_tree and lookup_kept == 0:
            drafter_gain = 0.9 * drafter_gain + 0.1 * a  # what the drafter adds where the guess fails at once
        committed, reason = finish(drafted[:a] + [bonus_id], produced)
        produced += len(committed)
        if ngrams is not None:
            ngrams.extend(committed)
        if speculative:
            if drafting:  # the drafter has now seen the old context
                context, context_start = kept_features, start
            else:
                context = torch.cat((context, kept_features))
        yield CycleEvent(index, start + 1, drafted, confidence, target_choices, a, bonus_id, committed,
                         t1 - t0, t2 - t1, produced, reason, tree_nodes=len(tree) - 1 if tree is not None else 0,
                         lookup_nodes=len(lookup_path), lookup_only=not drafting and size > 1,
                         lookup_drafted=shown_from_lookup)
        if reason:
            return
        last = bonus_id
        start += a + 1


def _draft_tree(logits: torch.Tensor, columns: torch.Tensor | None, anchor: int, budget: int,
                verify_costs: Sequence[float] | None, t1_cost: float,
                tree_costs: tuple[float, float] = (0.0, 0.0), branching: int = BRANCHING,
                lookup: tuple[Sequence[int], Sequence[float]] = ((), ())) -> DraftTree:
    """The draft tree of a cycle: the ``budget`` likeliest drafts (each node branching into at
    most ``branching`` candidates; 1: the drafter's chain), with ``lookup``'s path (tokens, the
    chance of each) grafted in; or with ``verify_costs`` the prefix of them (best first) that
    maximises expected tokens per second, a tree with ``P > 1`` root-to-leaf paths costing
    ``branching + (P - 2) * per_path`` more than a chain."""
    top_probs, top_ids = torch.softmax(logits.float(), -1).topk(min(branching, logits.shape[-1]), -1)
    if columns is not None:
        top_ids = columns[top_ids]
    tree = build_tree(anchor, top_probs.tolist(), top_ids.tolist(), budget)
    if len(lookup[0]):
        tree = graft(tree, lookup[0], lookup[1], budget)
    if verify_costs:
        # Node scores never increase along the node order, and parents come first: any prefix
        # of the nodes is a tree, and the best prefix is found like a chain's best length.
        extra, leaves, has_child = [], 0, set()
        for parent in tree.parents[1:]:
            leaves += 1 if parent in has_child or not has_child else 0  # a new branch, or the first node
            has_child.add(parent)
            extra.append(0.0 if leaves < 2 else tree_costs[0] + tree_costs[1] * (leaves - 2))
        keep, rate = best_count_and_rate(tree.scores[1:], verify_costs, t1_cost, extra)
        # A prefix of the best-first order stops the chain where the first branch would come; a
        # longer chain of top drafts may pay better than any branching.
        chain_scores = top_probs[:, 0].cumprod(0).tolist()
        chain_keep, chain_rate = best_count_and_rate(chain_scores, verify_costs, t1_cost)
        if chain_rate > rate:
            return chain_tree(anchor, top_ids[:chain_keep, 0].tolist(), chain_scores[:chain_keep])
        keep += 1
        tree = DraftTree(tree.tokens[:keep], tree.parents[:keep], tree.depths[:keep], tree.scores[:keep])
    return depth_first(tree)


def _shown_path(tree: DraftTree, kept: list[int]) -> list[int]:
    """The path a cycle's event shows: the kept nodes, then the best-scored child downwards."""
    path = list(kept)
    while True:
        children = [n for n in range(1, len(tree)) if tree.parents[n] == path[-1]]
        if not children:
            return path
        path.append(children[0])  # depth-first order lists children best first


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


def measure_verify_costs(target: TargetRunner, max_block: int, context: int = 128, repeats: int = 5) -> list[float]:
    """Time of a target forward over 1..max_block tokens after ``context`` tokens (interleaved
    medians), made non-decreasing in the number of tokens (``monotone``): a dip or a spike in
    one size is noise, and adaptive drafting would chase it."""
    ids = torch.arange(context + max_block, dtype=torch.long) % 1000 + 10
    target.reset(context + max_block)
    target.forward(ids[:context], None, last_only=True)
    calls = [lambda size=size: target.forward(ids[context : context + size], None) for size in range(1, max_block + 1)]
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
    calls = [lambda tree=tree: target.forward_tree(tree, None) for tree in (chain, fork, star)]
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
