"""Prompt lookup verified with the drafter's drafts: the n-gram index, the online estimates, the
graft into the draft tree, and the loop (lossless, and more tokens per cycle where text repeats)."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_core.errors import SettingsError
from dflash_core.lookup import MAX_MATCH, MAX_NGRAM, MIN_NGRAM, LookupStats, NgramIndex, graft, worth_drafting
from dflash_core.speculative import GenerationConfig, collect, stream
from dflash_core.target import FastTarget, HFTarget
from dflash_core.testing import PROMPTS, RecordingDrafter, tiny_drafter, tiny_target
from dflash_core.tree import DraftTree, build_tree


def naive_continuation(tokens: list[int], length: int) -> tuple[list[int], int]:
    """The latest earlier occurrence of the longest suffix, found by scanning, copied overlapping;
    and the longest m <= MAX_MATCH for which the m tokens before it equal the last m."""
    for n in range(min(MAX_NGRAM, len(tokens)), MIN_NGRAM - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                ext = list(tokens)
                while len(ext) < start + n + length:
                    ext.append(ext[len(ext) - (len(tokens) - start - n)])
                end = start + n
                match = max(m for m in range(n, min(MAX_MATCH, end) + 1) if tokens[end - m : end] == tokens[-m:])
                return ext[start + n : start + n + length], match
    return [], 0


def test_continuation_copies_after_the_latest_occurrence_of_the_longest_suffix():
    assert NgramIndex([5, 6, 7, 8, 5, 6]).continuation(3) == ([7, 8, 5], 2)
    assert NgramIndex([1, 2, 9, 1, 2, 7, 1, 2]).continuation(2) == ([7, 1], 2)
    assert NgramIndex([4, 1, 2, 3, 9, 2, 3]).continuation(2) == ([9, 2], 2)
    assert NgramIndex([1, 2, 3]).continuation(4) == ([], 0)
    assert NgramIndex([1, 2, 1]).continuation(0) == ([], 0)
    # Runs and periods are copied past the end of what is known.
    assert NgramIndex([9, 7, 7, 7, 7]).continuation(5) == ([7] * 5, 3)
    assert NgramIndex([3, 1, 2, 1, 2]).continuation(5) == ([1, 2, 1, 2, 1], 2)
    # The match is measured back past the n-gram that found it, up to MAX_MATCH tokens.
    assert NgramIndex([1, 2, 3, 4, 5, 9, 7, 2, 3, 4, 5]).continuation(2) == ([9, 7], 4)
    run = list(range(10, 30))
    assert NgramIndex(run + [0] + run[:-1]).continuation(2) == ([29, 0], MAX_MATCH)
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        cut = rng.randrange(len(tokens) + 1)
        index = NgramIndex(tokens[:cut])
        index.extend(tokens[cut:])  # built in two steps, as the loop builds it
        length = rng.randrange(1, 8)
        assert index.continuation(length) == naive_continuation(tokens, length), tokens


def test_lookup_stats_start_at_the_prior_and_learn_per_match_length_and_depth():
    stats = LookupStats(prior=0.5, prior_weight=2)
    assert stats.chances([2] * 4) == [0.5] * 4
    stats.record([2] * 5, kept=1)  # depth 1 kept, depth 2 rejected, depths 3..5 never reached
    assert stats.probability(2, 1) == pytest.approx(2 / 3)
    assert stats.probability(2, 2) == pytest.approx(1 / 3)
    assert stats.probability(2, 3) == 0.5
    stats.record([2] * 6, kept=6)  # all kept: depths 1..6 tried and kept
    assert stats.probability(2, 7) == stats.probability(2, 3) == pytest.approx((4 + 1) / (4 + 2))  # depth 3+ share
    assert stats.probability(1, 1) == 0.5  # other match lengths untouched


def check_best_first(tree: DraftTree) -> None:
    assert tree.parents[0] == -1 and tree.scores[0] == 1.0
    for n in range(1, len(tree)):
        parent = tree.parents[n]
        assert 0 <= parent < n and tree.depths[n] == tree.depths[parent] + 1
        assert tree.scores[n] <= tree.scores[parent]
    assert all(a >= b for a, b in zip(tree.scores[1:], tree.scores[2:]))
    siblings = [(tree.parents[n], tree.tokens[n]) for n in range(1, len(tree))]
    assert len(siblings) == len(set(siblings))  # no token twice under one parent


def test_graft_merges_shared_drafts_ranks_all_nodes_and_keeps_the_budget():
    drafter = build_tree(7, [[0.6, 0.3], [0.5, 0.4]], [[10, 11], [20, 21]], 6)
    # The guess shares its first token with the drafter's best node: one node, the larger chance.
    tree = graft(drafter, [10, 30, 31], [0.9, 0.8, 0.8], budget=6)
    check_best_first(tree)
    assert tree.tokens.count(10) == 1
    assert tree.find_path([10, 30, 31]) == [1, 2, 3]  # 0.9, 0.72, 0.576: ahead of every drafter node
    assert tree.scores[1:4] == pytest.approx([0.9, 0.72, 0.576])
    assert tree.find_path([10, 20]) != [] and tree.scores[tree.find_path([10, 20])[-1]] == pytest.approx(0.45)
    # A small budget keeps the best nodes; the guess survives as far as it scores.
    small = graft(drafter, [12, 13], [0.35, 0.1], budget=3)
    check_best_first(small)
    assert small.tokens == [7, 10, 12, 11] and small.find_path([12, 13]) == [2]
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        probs = torch.rand(5, 3, generator=g).sort(descending=True).values.tolist()
        ids = torch.randint(4, 9, (5, 3), generator=g)
        ids = [list(dict.fromkeys(row))[:3] for row in ids.tolist()]
        probs = [p[: len(row)] for p, row in zip(probs, ids)]
        guess = torch.randint(4, 9, (6,), generator=g).tolist()
        tree = graft(build_tree(1, probs, ids, 8), guess, torch.rand(6, generator=g).tolist(), budget=8)
        check_best_first(tree)
        assert len(tree) <= 9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_lookup_equals_greedy_ar_and_keeps_more_where_text_repeats(family, dtype):
    model = tiny_target(family, dtype=dtype)
    runner = FastTarget(model)
    drafter = tiny_drafter(model)  # random: its drafts are almost never kept
    gained = 0
    for prompt in PROMPTS:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=48, block_size=1).validated(16)))
        chain = collect(stream(runner, drafter, prompt, GenerationConfig(max_new_tokens=48, block_size=16).validated(16)))
        for block in (2, 5, 16):
            for tree in (False, True):
                cfg = GenerationConfig(max_new_tokens=48, block_size=block, tree=tree, lookup=True).validated(16)
                out = collect(stream(runner, drafter, prompt, cfg))
                assert out.token_ids == ar.token_ids, (family, block, tree)
                assert all(c.lookup_nodes <= block - 1 and c.tree_nodes <= block - 1 for c in out.cycles)
                if block == 16 and not tree:
                    assert any(c.lookup_nodes for c in out.cycles)
                    gained += out.tau > chain.tau + 0.5
    # The random targets' greedy text repeats itself; the lookup's guesses are kept there.
    assert gained >= 3


def test_adaptive_lookup_stays_lossless_at_any_verify_cost():
    model = tiny_target("llama", seed=6)
    runner = FastTarget(model)
    drafter = tiny_drafter(model)
    for prompt in PROMPTS:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=40, block_size=1).validated(16)))
        for tree in (False, True):
            cfg = GenerationConfig(max_new_tokens=40, block_size=16, adaptive=True, tree=tree, lookup=True).validated(16)
            cheap = collect(stream(runner, drafter, prompt, cfg, verify_costs=[0.001] * 16))
            steep = collect(stream(runner, drafter, prompt, cfg, verify_costs=[0.001 * 4 ** k for k in range(16)],
                                   tree_costs=(1.0, 1.0)))
            assert cheap.token_ids == steep.token_ids == ar.token_ids
            # Free verification fills the budget; a steep cost verifies short runs of drafts.
            assert max(len(c.drafted) for c in cheap.cycles) > max(len(c.drafted) for c in steep.cycles)


def test_lookup_refuses_what_it_cannot_do():
    with pytest.raises(SettingsError, match="rule = 'pq'"):
        GenerationConfig(block_size=16, temperature=0.7, rule="pq", lookup=True).validated(16)
    with pytest.raises(SettingsError, match="lookup"):
        GenerationConfig(lookup=1).validated(16)
    model = tiny_target("llama")
    with pytest.raises(SettingsError, match="fast target runner"):
        collect(stream(HFTarget(model), tiny_drafter(model), PROMPTS[0], GenerationConfig(block_size=4, lookup=True).validated(16)))
    # Autoregressive mode has nothing to verify: lookup is a no-op there.
    runner = FastTarget(model)
    ar = collect(stream(runner, None, PROMPTS[0], GenerationConfig(max_new_tokens=8, block_size=1, lookup=True).validated(16)))
    assert len(ar.token_ids) == 8 and not ar.cycles[0].drafted


def test_worth_drafting_weighs_the_drafters_cost_against_what_it_adds_where_the_guess_fails():
    assert worth_drafting(0.0, 0.0, 0.05, 0.007, 1.0)  # no guess: always draft
    # A sure guess of 10 tokens: the drafter could only help where the guess fails (never).
    assert not worth_drafting(10.0, 1.0, 0.05, 0.007, 1.0)
    # A doubtful guess (0.3, then 0.1 more): the drafter's expected 1.1 tokens are worth 7 ms.
    assert worth_drafting(0.4, 0.3, 0.05, 0.007, 1.1)
    # The same doubtful guess, but a drafter that adds nothing: skip it.
    assert not worth_drafting(0.4, 0.3, 0.05, 0.007, 0.0)
    # Two guesses whose first tokens differ: together likelier to start right, less left to the drafter.
    assert not worth_drafting(1.2, 0.9, 0.05, 0.007, 1.1)


def test_lookup_stats_with_memory_follow_recent_text():
    stats = LookupStats(memory=10)
    for _ in range(100):
        stats.record([3], kept=1)
    assert stats.probability(3, 1) > 0.9
    for _ in range(30):
        stats.record([3], kept=0)
    assert stats.probability(3, 1) < 0.15  # without memory: 101 / 132
    forever = LookupStats()
    for kept in [1] * 100 + [0] * 30:
        forever.record([3], kept=kept)
    assert forever.probability(3, 1) == pytest.approx(101 / 132)


def test_confident_guesses_skip_the_drafter_and_its_context_stays_whole():
    model = tiny_target("llama")
    runner = FastTarget(model)
    base = tiny_drafter(model)
    skipped = 0
    for prompt in PROMPTS:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=60, block_size=1).validated(16)))
        drafter = RecordingDrafter(base)
        cfg = GenerationConfig(max_new_tokens=60, block_size=16, adaptive=True, lookup=True).validated(16)
        out = collect(stream(runner, drafter, prompt, cfg, verify_costs=[0.001 + 0.0001 * k for k in range(16)]))
        assert out.token_ids == ar.token_ids
        skipped += sum(c.lookup_only for c in out.cycles)
        assert all(c.lookup_nodes == len(c.drafted) for c in out.cycles if c.lookup_only)
        # After cycles without the drafter, its next call still sees every position before the anchor.
        assert drafter.calls and all(start == cached for start, cached in drafter.calls), drafter.calls
        assert len(drafter.calls) < len(out.cycles) or not any(c.lookup_only for c in out.cycles)
    assert skipped >= 5


def test_an_engines_lookup_estimates_carry_over_to_the_next_generation():
    model = tiny_target("llama")
    runner = FastTarget(model)
    drafter = tiny_drafter(model)
    shared = LookupStats(memory=50)
    cfg = GenerationConfig(max_new_tokens=48, block_size=16, lookup=True).validated(16)
    first = collect(stream(runner, drafter, PROMPTS[0], cfg, lookup_stats=shared))
    learnt = {n: shared.probability(n, 1) for n in range(MIN_NGRAM, MAX_MATCH + 1)}
    assert any(p != 0.5 for p in learnt.values())  # measured, no longer the prior
    second = collect(stream(runner, drafter, PROMPTS[0], cfg, lookup_stats=shared))
    assert second.token_ids == first.token_ids


def test_events_say_which_shown_drafts_the_lookup_guessed():
    model = tiny_target("llama")
    runner = FastTarget(model)
    drafter = tiny_drafter(model)
    for tree in (False, True):
        ar = collect(stream(runner, None, PROMPTS[3], GenerationConfig(max_new_tokens=48, block_size=1).validated(16)))
        index = NgramIndex(list(PROMPTS[3]) + ar.token_ids[:1])
        cfg = GenerationConfig(max_new_tokens=48, block_size=16, tree=tree, lookup=True).validated(16)
        marked = 0
        measured, expected = LookupStats(), LookupStats()
        for event in stream(runner, drafter, PROMPTS[3], cfg, lookup_stats=measured):
            if event.is_prefill:
                continue
            # Recompute the cycle's guess from the committed text: the marked drafts are its prefix.
            guess, match = index.continuation(15)
            assert event.drafted[: event.lookup_drafted] == guess[: event.lookup_drafted]
            assert event.lookup_drafted <= event.lookup_nodes
            marked += event.lookup_drafted
            if event.lookup_nodes:  # the kept drafts are the first shown ones
                expected.record([match] * event.lookup_nodes, min(event.lookup_drafted, event.num_accepted))
            index.extend(event.committed)
        assert marked > 0
        # The loop recorded exactly what its events say the guesses verified and kept.
        cells = [(n, d) for n in range(MIN_NGRAM, MAX_MATCH + 1) for d in (1, 2, 3)]
        assert [measured.probability(*c) for c in cells] == pytest.approx([expected.probability(*c) for c in cells])
        assert any(measured.probability(*c) != 0.5 for c in cells)
