"""Draft trees: construction, the target's tree pass (bit-exact against decoding each path), and
the speculative loop verifying trees (lossless, and more tokens per cycle than a chain)."""

from __future__ import annotations

import pytest
import torch

from dflash_core.errors import SettingsError
from dflash_core.speculative import GenerationConfig, collect, stream
from dflash_core.target import FastTarget, HFTarget
from dflash_core.testing import (PROMPTS, SecondChoiceDrafter, assert_greedy_tree_lossless, assert_tree_nodes_are_their_paths,
                                 random_tree, tiny_drafter, tiny_target)
from dflash_core.tree import DraftTree, build_tree, depth_first, walk


def test_build_tree_keeps_the_best_scored_nodes_parents_first():
    probs = [[0.6, 0.3], [0.5, 0.4], [0.9, 0.05]]
    tokens = [[10, 11], [20, 21], [30, 31]]
    tree = build_tree(7, probs, tokens, 4)
    # Scores: 10: .6, 11: .3, 10-20: .3 (a tie: the first pushed wins), 10-20-30: .27, 10-21: .24
    assert tree.tokens == [7, 10, 11, 20, 30]
    assert tree.parents == [-1, 0, 0, 1, 3]
    assert tree.depths == [0, 1, 1, 2, 3]
    assert tree.scores == pytest.approx([1, 0.6, 0.3, 0.3, 0.27])
    for seed in range(20):
        t = random_tree(seed)
        assert len(t) == 13
        assert all(t.parents[n] < n and t.depths[n] == t.depths[t.parents[n]] + 1 for n in range(1, len(t)))
        assert all(a >= b for a, b in zip(t.scores, t.scores[1:]))


def test_depth_first_order_makes_every_path_one_run_of_nodes():
    for seed in range(20):
        tree = random_tree(seed)
        dfs = depth_first(tree)
        assert sorted(zip(dfs.tokens, dfs.depths)) == sorted(zip(tree.tokens, tree.depths))
        runs = [nodes for _, nodes in dfs.leaf_groups()]
        assert [n for nodes in runs for n in nodes] == list(range(len(dfs)))
        assert all(nodes == list(range(nodes[0], nodes[-1] + 1)) for nodes in runs)
        first_path, _ = dfs.leaf_groups()[0]
        assert first_path == list(range(len(first_path)))


def test_walk_follows_the_target_choices():
    tree = DraftTree([7, 10, 11, 20, 21], [-1, 0, 0, 2, 2], [0, 1, 1, 2, 2], [1, 0.5, 0.4, 0.3, 0.1])
    assert walk(tree, [11, 0, 21, 0, 0]) == ([0, 2, 4], 0)
    assert walk(tree, [12, 0, 0, 0, 0]) == ([0], 12)
    assert walk(tree, [10, 5, 0, 0, 0]) == ([0, 1], 5)


@pytest.mark.parametrize("replicas", [True, False], ids=["value-replicas", "paths-in-turn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_tree_pass_scores_every_node_as_decoding_its_path_does(family, dtype, replicas, monkeypatch):
    from dflash_core import tree_attention

    if not replicas:  # as for a long context or a large model: no room for per-path value copies
        monkeypatch.setattr(tree_attention, "REPLICA_BYTES", 0)
    model = tiny_target(family, dtype=dtype)
    runner = FastTarget(model)
    prompt = PROMPTS[0]
    assert_tree_nodes_are_their_paths(runner, prompt[:-1])
    for seed in range(3):
        tree = depth_first(random_tree(seed))
        # Keeping a path leaves the cache as if that path had been decoded token by token.
        leaf = max(range(len(tree)), key=lambda n: tree.depths[n] + n / 100)
        runner.reset(64)
        runner.forward(torch.tensor(prompt[:-1]), None)
        runner.forward_tree(tree, None)
        runner.keep_path(tree.path(leaf))
        after_tree = runner.forward(torch.tensor([5, 6]), None).logits
        runner.reset(64)
        runner.forward(torch.tensor(prompt[:-1]), None)
        runner.forward(torch.tensor([tree.tokens[n] for n in tree.path(leaf)]), None)
        after_path = runner.forward(torch.tensor([5, 6]), None).logits
        if runner.batch_invariant:
            assert torch.equal(after_path, after_tree)
        else:
            torch.testing.assert_close(after_path, after_tree, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_tree_verification_equals_greedy_ar_and_keeps_more_per_cycle(family, dtype):
    model = tiny_target(family, dtype=dtype)
    runner = FastTarget(model)
    assert_greedy_tree_lossless(runner, model, blocks=(2, 3, 8, 16))
    drafter = tiny_drafter(model)
    for prompt in PROMPTS:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=40, block_size=1).validated(16)))
        decoy = SecondChoiceDrafter(drafter, list(prompt) + ar.token_ids)
        chain = collect(stream(runner, decoy, prompt, GenerationConfig(max_new_tokens=40, block_size=16).validated(16)))
        tree = collect(stream(runner, decoy, prompt, GenerationConfig(max_new_tokens=40, block_size=16, tree=True).validated(16)))
        assert tree.tau > chain.tau + 1, (chain.tau, tree.tau)


def test_adaptive_trees_stay_lossless_and_shrink_when_branches_are_expensive():
    model = tiny_target("llama", seed=6)
    runner = FastTarget(model)
    drafter = tiny_drafter(model)
    flat = [0.001] * 16
    for prompt in PROMPTS:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=40, block_size=1).validated(16)))
        cfg = GenerationConfig(max_new_tokens=40, block_size=16, adaptive=True, tree=True).validated(16)
        cheap = collect(stream(runner, drafter, prompt, cfg, verify_costs=flat))
        dear = collect(stream(runner, drafter, prompt, cfg, verify_costs=flat, tree_costs=(1.0, 1.0)))
        assert cheap.token_ids == dear.token_ids == ar.token_ids
        # Free verification: the whole budget; branching priced out: chains only (verified as
        # chains, so no tree nodes).
        assert max(c.tree_nodes for c in cheap.cycles) == 15
        assert all(c.tree_nodes == 0 for c in dear.cycles) and any(c.drafted for c in dear.cycles)


def test_trees_refuse_what_they_cannot_do():
    with pytest.raises(SettingsError, match="rule = 'pq'"):
        GenerationConfig(block_size=16, temperature=0.7, rule="pq", tree=True).validated(16)
    with pytest.raises(SettingsError, match="tree"):
        GenerationConfig(tree="yes").validated(16)
    model = tiny_target("llama")
    with pytest.raises(SettingsError, match="fast target runner"):
        collect(stream(HFTarget(model), tiny_drafter(model), PROMPTS[0], GenerationConfig(block_size=4, tree=True).validated(16)))


def test_tree_costs_are_measured_on_the_runner():
    from dflash_core.speculative import measure_tree_costs

    runner = FastTarget(tiny_target("llama"))
    before = collect(stream(runner, None, PROMPTS[0], GenerationConfig(max_new_tokens=8, block_size=1).validated(16)))
    # What is timed: trees of the whole block, as a chain (1 leaf), a fork (2) and a star (15).
    leaves = []
    forward_tree = runner.forward_tree

    def recording(tree, *args, **kwargs):
        assert len(tree.tokens) == 16
        leaves.append(len(set(range(16)) - set(tree.parents)))
        return forward_tree(tree, *args, **kwargs)

    runner.forward_tree = recording
    measure_tree_costs(runner, 16, context=32, repeats=2)
    assert set(leaves) == {1, 2, 15}
    assert measure_tree_costs(runner, 3) == (0.0, 0.0)
    # The runner is left usable: a fresh sequence decodes exactly as before.
    after = collect(stream(runner, None, PROMPTS[0], GenerationConfig(max_new_tokens=8, block_size=1).validated(16)))
    assert after.token_ids == before.token_ids
