"""Property-based tests (hypothesis) of the acceptance rules and of cache rollback."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_core import acceptance
from dflash_core.proposers import ChainDraft
from dflash_core.speculative import choose_draft_length
from dflash_core.target import FastTarget, TargetOutput
from dflash_core.testing import tiny_drafter, tiny_target

MODEL = tiny_target("llama", vocab=64, layers=2, seed=11)
DRAFTER = tiny_drafter(MODEL, layers=1)


@settings(max_examples=200, deadline=None)
@given(k=st.integers(0, 15), vocab=st.integers(2, 9), seed=st.integers(0, 10**6))
def test_greedy_accepts_exactly_the_matching_prefix(k, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, vocab, generator=gen)
    choices = logits.argmax(-1)
    draft = torch.where(torch.rand(k, generator=gen) < 0.6, choices[:k], torch.randint(vocab, (k,), generator=gen))
    out = ChainDraft(anchor=0, tokens=draft, confidence=torch.ones(k)).settle(
        acceptance.greedy(TargetOutput(logits, None), acceptance.Sampling(), None))
    a = out.num_accepted
    assert out.drafted == draft.tolist() and out.target_choices == choices.tolist()
    assert torch.equal(draft[:a], choices[:a])
    assert a == k or draft[a] != choices[a]
    assert out.bonus == int(choices[a])


@settings(max_examples=200, deadline=None)
@given(k=st.integers(0, 15), vocab=st.integers(2, 9), seed=st.integers(0, 10**6))
def test_match_rule_keeps_drafts_while_they_equal_the_targets_samples(k, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, vocab, generator=gen) * 3
    logits[:, 0] = float("-inf")  # token 0 has probability 0: never a sample
    draft = torch.randint(vocab, (k,), generator=gen)
    out = ChainDraft(anchor=0, tokens=draft, confidence=torch.ones(k)).settle(
        acceptance.match(TargetOutput(logits, None), acceptance.Sampling(temperature=1.0, generator=gen), None))
    a, samples = out.num_accepted, out.target_choices
    assert 0 <= a <= k and len(samples) == k + 1
    assert draft[:a].tolist() == samples[:a]
    assert a == k or draft[a] != samples[a]
    assert out.bonus == samples[a]
    assert 0 not in samples


@settings(max_examples=200, deadline=None)
@given(conf=st.lists(st.floats(0.0, 1.0), min_size=0, max_size=15),
       costs=st.lists(st.floats(0.001, 1.0), min_size=1, max_size=16), draft_cost=st.floats(0.0, 0.5))
def test_adaptive_draft_length_maximises_expected_tokens_per_second(conf, costs, draft_cost):
    costs = sorted(costs)
    c = torch.tensor(conf)
    k = choose_draft_length(c, costs, draft_cost)
    limit = min(len(conf), len(costs) - 1)
    assert 0 <= k <= max(0, limit)

    def rate(n: int) -> float:
        expected, run = 1.0, 1.0
        for p in conf[:n]:
            run *= p
            expected += run
        return expected / (draft_cost + costs[n])

    best = max(rate(n) for n in range(0, limit + 1)) if limit >= 0 else rate(0)
    assert rate(k) >= best * (1 - 1e-5)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8)), min_size=1, max_size=10),
       seed=st.integers(0, 1000))
def test_target_cache_rolls_back_to_exactly_the_committed_prefix(ops, seed):
    """After any sequence of (append T tokens, drop D of them), the next logits equal those of a
    fresh run over the committed tokens alone."""
    gen = torch.Generator().manual_seed(seed)
    runner = FastTarget(MODEL)
    runner.reset(128)
    committed: list[int] = list(torch.randint(4, 64, (5,), generator=gen).tolist())
    runner.forward(torch.tensor(committed), None)
    for append, drop in ops:
        new = torch.randint(4, 64, (append,), generator=gen).tolist()
        runner.forward(torch.tensor(new), None)
        keep = len(committed) + append - min(drop, append)
        committed = (committed + new)[:keep]
        runner.truncate(keep)
        assert runner.length == len(committed)
    probe = torch.tensor([7])
    got = runner.forward(probe, [0, 1]).logits
    fresh = FastTarget(MODEL)
    fresh.reset(128)
    fresh.forward(torch.tensor(committed), None)
    want = fresh.forward(probe, [0, 1]).logits
    assert torch.allclose(got, want, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(chunks=st.lists(st.integers(1, 7), min_size=1, max_size=5), seed=st.integers(0, 1000))
def test_drafter_context_cache_equals_one_shot_context(chunks, seed):
    """Feeding the context in pieces across cycles gives the same drafts as all at once."""
    gen = torch.Generator().manual_seed(seed)
    width = 64 * len(DRAFTER.target_layer_ids)
    total = sum(chunks)
    feats = torch.randn(1, total, width, generator=gen)
    noise = torch.randn(1, 16, 64, generator=gen)
    cache = DRAFTER.new_cache()
    start = 0
    with torch.no_grad():
        for size in chunks:
            DRAFTER(noise, torch.arange(start + size, start + size + 16), feats[:, start : start + size],
                    torch.arange(start, start + size), cache=cache)
            start += size
        incremental = DRAFTER(noise, torch.arange(total, total + 16), None, None, cache=cache)
        one_shot = DRAFTER(noise, torch.arange(total, total + 16), feats, torch.arange(total))
    assert cache.length == total
    assert torch.allclose(incremental, one_shot, atol=1e-5)
