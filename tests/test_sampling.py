"""Sampling stays lossless: DFlash's output follows the target's own distribution.

Tolerance: each test is a chi-square goodness-of-fit test at significance 1e-3 (cells with an
expected count below 5 are pooled). A correct sampler fails it once in a thousand runs; the seeds
are fixed, so the suite is deterministic. A rule that, say, always accepted drafts would be
rejected with a p-value below 1e-30.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from dflash_core import acceptance
from dflash_core.corpus import AnswerCorpus
from dflash_core.lookup import LookupStats
from dflash_core.proposers import ChainDraft
from dflash_core.speculative import GenerationConfig, collect, stream
from dflash_core.target import FastTarget, TargetOutput
from dflash_core.testing import exact_three_tokens, chi_square_passes, tiny_drafter, tiny_target


@pytest.mark.parametrize("rule", ["match", "pq", "pq-draft-vocab"])
def test_acceptance_rules_keep_the_first_token_distributed_as_the_target(rule):
    gen = torch.Generator().manual_seed(0)
    vocab, k = 6, 3
    target_probs = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, -1)
    draft_probs = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, -1)
    columns = torch.tensor([0, 2, 3, 5])  # the drafter proposes from these tokens only (q = 0 elsewhere)
    if rule == "pq-draft-vocab":
        draft_probs = draft_probs[:, columns] / draft_probs[:, columns].sum(-1, keepdim=True)
    n = 30000
    counts: dict[int, int] = {}
    accepted_total = 0
    for _ in range(n):
        if rule == "pq":
            draft = acceptance.sample(draft_probs, gen)
            a, bonus = acceptance.pq_accept(draft, draft_probs, target_probs, gen)
        elif rule == "pq-draft-vocab":
            draft = columns[acceptance.sample(draft_probs, gen)]
            a, bonus = acceptance.pq_accept(draft, draft_probs, target_probs, gen, columns)
        else:
            draft = draft_probs.argmax(-1)
            verdict = acceptance.match(TargetOutput(target_probs.log(), None), acceptance.Sampling(temperature=1.0, generator=gen), None)
            settled = ChainDraft(anchor=0, tokens=draft, confidence=torch.ones(k)).settle(verdict)
            a, bonus = settled.num_accepted, settled.bonus
        a = int(a)
        accepted_total += a
        first = int(draft[0]) if a > 0 else int(bonus)
        counts[first] = counts.get(first, 0) + 1
    expected = {x: float(target_probs[0, x]) for x in range(vocab)}
    ok, stat, critical = chi_square_passes(counts, expected, n)
    assert ok, (stat, critical, counts)
    assert accepted_total > 0.2 * n  # the test exercises acceptance, not only the bonus path


def test_sample_draws_each_row_from_its_distribution_and_never_a_zero():
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(3, 12, generator=gen) * 1.2, -1)
    probs[:, [0, 5, 11]] = 0.0  # truncated tokens, at both ends and inside
    probs[1, 4] = 1e-3  # a rare token keeps its (small) share
    probs = probs / probs.sum(-1, keepdim=True)
    n = 20000
    draws = torch.stack([acceptance.sample(probs.view(3, 1, 12), gen) for _ in range(n)])  # (n, 3, 1)
    assert draws.shape == (n, 3, 1)
    for row in range(3):
        got = draws[:, row, 0]
        assert not torch.isin(got, torch.tensor([0, 5, 11])).any()
        counts = dict(zip(*[t.tolist() for t in got.unique(return_counts=True)]))
        ok, stat, critical = chi_square_passes(counts, {x: float(probs[row, x]) for x in range(12)}, n)
        assert ok, (row, stat, critical, counts)
    # A point mass, and weights that do not sum to 1 (drawn in proportion).
    assert int(acceptance.sample(torch.tensor([0.0, 0.0, 1.0, 0.0]), gen)) == 2
    weights = torch.tensor([0.0, 3.0, 1.0])
    drawn = [int(acceptance.sample(weights, gen)) for _ in range(4000)]
    assert 0 not in drawn and abs(drawn.count(1) / 4000 - 0.75) < 0.03


def test_pq_rule_accepts_everything_when_draft_equals_target():
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(5, 7, generator=gen), -1)
    for _ in range(200):
        draft = acceptance.sample(probs[:4], gen)
        a, _ = acceptance.pq_accept(draft, probs[:4], probs, gen)
        assert int(a) == 4


def test_greedy_rule_is_the_argmax_prefix():
    logits = torch.tensor([[0.0, 5, 0], [9, 0, 0], [0, 0, 4], [1, 0, 0]])
    draft = ChainDraft(anchor=0, tokens=torch.tensor([1, 0, 1]), confidence=torch.ones(3))
    out = draft.settle(acceptance.greedy(TargetOutput(logits, None), acceptance.Sampling(), draft))
    assert (out.num_accepted, out.bonus, out.target_choices) == (2, 2, [1, 0, 2, 0])


@pytest.mark.parametrize("vocab", [300, 4 * acceptance.ARGMAX_BLOCK, 384 * acceptance.ARGMAX_BLOCK])
def test_argmax_is_the_model_dtypes_argmax_ties_included(vocab):
    # 300: ATen's argmax itself; multiples of the block: the two-step argmax, which must agree.
    g = torch.Generator().manual_seed(0)
    # Few distinct bf16 values per row, so most rows have a tied maximum somewhere.
    logits = (torch.randint(0, 6, (64, vocab), generator=g) * 0.37).to(torch.bfloat16)
    logits[5, [7, 9, 200]] = 9.0  # ties within a block and across blocks: the first wins
    logits[6, -1] = float("nan")  # NaN wins in both
    logits[7, [3, 250]] = float("nan")
    logits[8] = float("-inf")
    logits[9, 250] = 1e30
    assert torch.equal(acceptance.argmax(logits), logits.argmax(-1))
    assert int(acceptance.argmax(logits)[5]) == 7
    assert torch.equal(acceptance.argmax(logits[3]), logits[3].argmax(-1))  # one row, no batch dimension
    assert acceptance.argmax(logits[:2].float()).shape == (2,)


def test_warp_applies_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(acceptance.warp(logits, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=1e-6)
    assert torch.allclose(acceptance.warp(logits, 1.0, top_k=2), torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    assert torch.allclose(acceptance.warp(logits, 1.0, top_p=0.7), torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)


@pytest.mark.parametrize("draft_vocab", [None, [0, 1, 3]], ids=["full-vocab", "draft-vocab"])
@pytest.mark.parametrize("rule", ["match", "pq", "match-tree", "match-lookup", "match-answers"])
def test_dflash_sampling_follows_the_targets_distribution_end_to_end(rule, draft_vocab):
    """Joint distribution of 3 generated tokens over a 5-token vocabulary (125 outcomes); with a
    draft vocabulary the drafter can never propose token 2, which the target still produces.
    ``match-tree`` verifies draft trees (4 tokens are generated so that the first cycle has room
    for two drafts, which may branch; the first 3 are counted); ``match-lookup`` adds prompt
    lookup's guesses (in a 5-token vocabulary the last token has usually occurred before);
    ``match-answers`` adds guesses from a corpus of answers too (``corpus.py``: random ones here,
    holding every pair of tokens)."""
    rule, tree, lookup = rule.split("-")[0], rule.endswith("tree"), rule.endswith(("lookup", "answers"))
    answers = None
    if rule.endswith("answers"):
        corpus_rows = torch.randint(0, 5, (50, 30), generator=torch.Generator().manual_seed(9)).tolist()
        answers = (AnswerCorpus(corpus_rows), LookupStats())
    vocab, temperature = 5, 1.3
    model = tiny_target("llama", vocab=vocab, layers=2, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)  # soften: every outcome has some mass
    runner = FastTarget(model)
    drafter = tiny_drafter(model, layers=1, block_size=4, mask_token_id=4, seed=2)
    drafter.set_draft_vocab(None if draft_vocab is None else torch.tensor(draft_vocab))
    prompt = [1, 3, 0, 2]

    # The exact distribution of 3 tokens, from the target alone.
    expected = exact_three_tokens(model, prompt, temperature, vocab)

    n = 2000
    observed: dict[tuple, int] = {}
    accepted = branched = looked_up = from_answers = 0
    for seed in range(n):
        config = GenerationConfig(max_new_tokens=4 if tree or lookup else 3, block_size=4, temperature=temperature,
                                  seed=seed, rule=rule, tree=tree, lookup=lookup)
        out = collect(stream(runner, drafter, prompt, config.validated(4), answers=answers))
        key = tuple(out.token_ids[:3])
        branched += any(c.tree_nodes > len(c.drafted) for c in out.cycles)
        looked_up += any(c.lookup_nodes for c in out.cycles)
        from_answers += any(c.answer_nodes for c in out.cycles)
        observed[key] = observed.get(key, 0) + 1
        accepted += sum(c.num_accepted for c in out.cycles)
    assert set(observed) <= set(itertools.product(range(vocab), repeat=3))
    ok, stat, critical = chi_square_passes(observed, expected, n)
    assert ok, (stat, critical)
    assert accepted > 0.1 * n  # drafts were really accepted, not only bonus tokens
    if tree:
        assert branched > 0.1 * n  # the trees really branched
    if lookup:
        assert looked_up > 0.5 * n  # lookup's guesses were really verified
    if answers:
        assert from_answers > 0.5 * n  # and the answers' guesses too


def test_sampling_is_reproducible_for_a_seed():
    model = tiny_target("qwen3", seed=4)
    runner = FastTarget(model)
    drafter = tiny_drafter(model)
    config = GenerationConfig(max_new_tokens=30, block_size=8, temperature=0.9, seed=123).validated(16)
    a = collect(stream(runner, drafter, [5, 6, 7], config)).token_ids
    b = collect(stream(runner, drafter, [5, 6, 7], config)).token_ids
    c = collect(stream(runner, drafter, [5, 6, 7], GenerationConfig(max_new_tokens=30, block_size=8, temperature=0.9, seed=7).validated(16))).token_ids
    assert a == b
    assert a != c


def test_a_rule_added_to_the_table_is_the_one_the_loop_uses(monkeypatch):
    """The loop looks its rule up in ``acceptance.RULES`` once and applies it to every cycle's
    verified drafts, whatever their shape: a chain here, a tree with ``tree = true``."""
    model = tiny_target("llama", seed=3)
    runner = FastTarget(model)
    drafter = tiny_drafter(model)
    calls = []

    def counted_match(out, sampling, draft):
        calls.append(out.rows)
        return acceptance.match(out, sampling, draft)

    monkeypatch.setitem(acceptance.RULES, "counted", acceptance.Rule(counted_match))
    for tree in (False, True):
        config = GenerationConfig(max_new_tokens=24, block_size=8, temperature=0.8, seed=5, tree=tree).validated(16)
        reference = collect(stream(runner, drafter, [5, 6, 7], config))
        calls.clear()
        out = collect(stream(runner, drafter, [5, 6, 7], replace(config, rule="counted")))
        assert out.token_ids == reference.token_ids
        assert calls == [1 + max(c.tree_nodes, len(c.drafted)) for c in out.cycles]
