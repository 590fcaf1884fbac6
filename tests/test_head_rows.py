"""A verify pass's LM head computed as its rows are read: the same logits as all at once, and a
greedy walk computes only the rows on its path (acceptance.greedy_choices)."""

from __future__ import annotations

import pytest
import torch

from dflash_core import acceptance
from dflash_core.acceptance import argmax, greedy_choices
from dflash_core.proposers import ChainDraft, TreeDraft
from dflash_core.speculative import GenerationConfig, collect, stream
from dflash_core.target import FastTarget, TargetOutput
from dflash_core.testing import PROMPTS, OracleDrafter, random_tree, tiny_drafter, tiny_target
from dflash_core.tree import DraftTree, depth_first, node_needed, walk


def same(a: torch.Tensor, b: torch.Tensor, runner: FastTarget) -> None:
    if runner.batch_invariant:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def block_pass(runner: FastTarget, prompt: list[int], block: list[int]) -> TargetOutput:
    runner.reset(64)
    runner.forward(torch.tensor(prompt), None, last_only=True)
    return runner.forward(torch.tensor(block), None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rows_computed_as_read_are_the_rows_computed_at_once(family, dtype):
    model = tiny_target(family, dtype=dtype)
    runner = FastTarget(model)
    prompt, block = list(PROMPTS[0]), [5, 9, 14, 2, 33, 7, 8, 41, 12, 6, 3, 19, 27, 11, 30, 22]
    whole = block_pass(runner, prompt, block)
    assert whole.computed == 0
    at_once = whole.logits
    assert whole.computed == 16 and at_once.shape == (16, model.config.vocab_size)
    piecewise = block_pass(runner, prompt, block)
    for rows in ([3], [0, 1], [9, 5, 2], [3, 4], list(range(10, 16))):
        same(piecewise.logits_at(rows), at_once[rows], runner)
    assert piecewise.computed == 13  # 0-5, 9, 10-15: each row once
    same(piecewise.logits, at_once, runner)
    # a tree pass's rows too
    tree = depth_first(random_tree(1))
    runner.reset(64)
    runner.forward(torch.tensor(prompt), None, last_only=True)
    tree_at_once = runner.forward_tree(tree, None).logits
    runner.reset(64)
    runner.forward(torch.tensor(prompt), None, last_only=True)
    tree_out = runner.forward_tree(tree, None)
    same(tree_out.logits_at([len(tree) - 1, 0]), tree_at_once[[len(tree) - 1, 0]], runner)
    same(tree_out.logits, tree_at_once, runner)


def test_an_output_takes_logits_or_what_computes_them():
    with pytest.raises(ValueError, match="logits, or the rows and head"):
        TargetOutput(None, None)
    with pytest.raises(ValueError, match="logits, or the rows and head"):
        TargetOutput(torch.zeros(2, 4), None, torch.zeros(2, 3), lambda x: x)
    given = TargetOutput(torch.arange(8.0).view(2, 4), None)
    assert given.computed == 2 and torch.equal(given.logits_at([1]), torch.tensor([[4.0, 5, 6, 7]]))


def chain(anchor: int, drafts: list[int], confidence: float) -> ChainDraft:
    return ChainDraft(anchor=anchor, tokens=torch.tensor(drafts), confidence=torch.full((len(drafts),), confidence))


def test_a_greedy_walk_computes_the_head_for_the_rows_on_its_path_only():
    model = tiny_target("llama")
    runner = FastTarget(model)
    prompt = list(PROMPTS[1])
    ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=12, block_size=1).validated(16)))
    anchor, reference = ar.token_ids[0], ar.token_ids[1:]
    wrong = [(t + 1) % model.config.vocab_size for t in reference]
    # The first three drafts right, the fourth wrong: the walk reads rows 0-3 (the fourth row's
    # choice, after the third draft, is the bonus).
    drafts = reference[:3] + wrong[3:11]
    for confidence in (0.99, 0.01):
        out = block_pass(runner, prompt, [anchor] + drafts)
        reads = []
        original = out.logits_at
        out.logits_at = lambda rows: reads.append(list(rows)) or original(rows)
        draft = chain(anchor, drafts, confidence)
        choices = greedy_choices(out, draft).tolist()
        assert choices[:4] == reference[:4] and choices[3] != drafts[3]
        full = argmax(block_pass(runner, prompt, [anchor] + drafts).logits).tolist()
        if confidence < acceptance.REACH_CHANCE:  # nothing beyond the row the walk needs next
            assert reads == [[0], [1], [2], [3]] and choices[4:] == [-1] * 8 and out.computed == 4
        else:  # every row likely: one call for all
            assert reads == [list(range(12))] and choices == full and out.computed == 12
        outcome = draft.settle(acceptance.Verdict(torch.tensor(choices)))
        assert (outcome.num_accepted, outcome.bonus) == (3, full[3])
        assert outcome.target_choices == full[: len(outcome.target_choices)] and len(outcome.target_choices) >= 4
        assert outcome.drafted == drafts


def test_a_tree_walk_asks_for_the_nodes_on_its_path():
    tree = DraftTree([7, 10, 11, 20, 21], [-1, 0, 0, 2, 2], [0, 1, 1, 2, 2], [1, 0.5, 0.4, 0.3, 0.1])
    assert node_needed(tree, [-1] * 5) == 0
    assert node_needed(tree, [11, -1, -1, -1, -1]) == 2
    assert node_needed(tree, [11, -1, 21, -1, -1]) == 4
    assert node_needed(tree, [11, -1, 21, -1, 0]) is None
    assert node_needed(tree, [12, -1, -1, -1, -1]) is None
    assert walk(tree, [11, -1, 21, -1, 0]) == ([0, 2, 4], 0)
    draft = TreeDraft(tree=tree)
    assert draft.likely_after(0) == [0, 1]  # the best child (0.5), not its sibling
    assert draft.likely_after(2) == [2, 3]  # 0.3 of 0.4 reached; 0.1 of 0.4 too unlikely
    outcome = draft.settle(acceptance.Verdict(torch.tensor([11, -1, 21, -1, 0])))
    assert outcome.kept_nodes == [0, 2, 4] and outcome.bonus == 0 and outcome.target_choices == [11, 21, 0]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_greedy_dflash_with_the_head_as_read_equals_ar_whether_drafts_are_right_or_not(tree):
    model = tiny_target("qwen3", seed=3)
    runner = FastTarget(model)
    assert runner.logits_as_read
    drafter = tiny_drafter(model)
    for prompt in PROMPTS:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=40, block_size=1).validated(16)))
        cfg = GenerationConfig(max_new_tokens=40, block_size=16, tree=tree).validated(16)
        oracle = OracleDrafter(drafter, list(prompt) + ar.token_ids)
        for proposer in (drafter, oracle):
            out = collect(stream(runner, proposer, prompt, cfg))
            assert out.token_ids == ar.token_ids
            for cycle in out.cycles:  # the kept drafts and the bonus are the target's choices
                assert cycle.target_choices[: cycle.num_accepted + 1] == cycle.drafted[: cycle.num_accepted] + [cycle.bonus]
