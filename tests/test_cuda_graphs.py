"""CUDA graphs' bookkeeping on the CPU (``cuda_graphs.eager_capture`` re-runs a pass where a graph
would replay it): which graph serves which pass, fresh graphs after the cache is reallocated,
outputs that the next replay does not overwrite, and the eager fallbacks. The graphs themselves
are checked on a GPU by ``scripts/gpu_check.py``."""

from __future__ import annotations

import torch

from dflash_core import cuda_graphs
from dflash_core.cuda_graphs import CudaGraphs, eager_capture
from dflash_core.speculative import GenerationConfig, collect, stream
from dflash_core.target import FastTarget
from dflash_core.testing import assert_greedy_lossless, tiny_drafter, tiny_target


def _graphed(model) -> FastTarget:
    runner = FastTarget(model)
    runner.graphs = CudaGraphs(runner, capture=eager_capture)
    return runner


def _greedy(runner, drafter, prompt, block):
    cfg = GenerationConfig(max_new_tokens=40, block_size=block).validated(16)
    return collect(stream(runner, drafter, prompt, cfg)).token_ids


def test_graphed_passes_give_the_eager_tokens_and_dflash_stays_lossless():
    model = tiny_target("qwen3", vocab=96, layers=2, seed=1)
    eager, graphed = FastTarget(model), _graphed(model)
    drafter = tiny_drafter(model, layers=1)
    prompt = [5, 17, 42, 8, 9, 60, 3]
    for block in (1, 4, 16):
        assert _greedy(graphed, drafter, prompt, block) == _greedy(eager, drafter, prompt, block)
    graphs = graphed.graphs
    # Each pass shape is captured once and then replayed: the AR step, the verify blocks, the prefill.
    assert graphs.replays > 2 * graphs.captures > 0 and graphs.broken is None
    assert_greedy_lossless(graphed, model, max_new_tokens=24)


def test_a_reallocated_cache_gets_fresh_graphs_and_outputs_are_copies():
    model = tiny_target("llama", vocab=96, layers=2, seed=2)
    eager, graphed = FastTarget(model), _graphed(model)
    for runner in (eager, graphed):
        runner.reset(64)
    first = graphed.forward(torch.tensor([4, 5, 6, 7]), [0, 1])
    kept = first.logits.clone()
    second = graphed.forward(torch.tensor([8, 9, 10, 11]), [0, 1])  # same shape: a replay
    assert graphed.graphs.replays == 1 and torch.equal(first.logits, kept)  # not overwritten by it
    want = [eager.forward(torch.tensor(ids), [0, 1]) for ids in ([4, 5, 6, 7], [8, 9, 10, 11])]
    assert torch.equal(second.logits, want[1].logits) and torch.equal(second.features, want[1].features)
    # A larger cache is a new allocation: the graphs of the old one would read freed memory.
    for runner in (eager, graphed):
        runner.reset(200)
    again = graphed.forward(torch.tensor([4, 5, 6, 7]), [0, 1])
    assert graphed.graphs.captures == 2 and len(graphed.graphs.graphs) == 1
    assert torch.equal(again.logits, eager.forward(torch.tensor([4, 5, 6, 7]), [0, 1]).logits)


def test_long_passes_and_failed_captures_run_eager():
    model = tiny_target("llama", vocab=96, layers=2, seed=3)
    eager, graphed = FastTarget(model), _graphed(model)
    prompt = torch.randint(4, 96, (cuda_graphs.MAX_ROWS + 1,), generator=torch.Generator().manual_seed(0))
    for runner in (eager, graphed):
        runner.reset(128)
    assert torch.equal(graphed.forward(prompt, None).logits, eager.forward(prompt, None).logits)
    assert graphed.graphs.captures == 0  # a prompt runs eager

    def refuse(run):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphed.graphs.capture = refuse
    step = torch.tensor([7])
    assert torch.equal(graphed.forward(step, None).logits, eager.forward(step, None).logits)
    assert "capture failed" in graphed.graphs.broken


def test_graphs_are_for_cuda_only(monkeypatch):
    assert FastTarget(tiny_target("llama", vocab=96, layers=1)).graphs is None  # the CPU runs eager
    assert cuda_graphs.wanted(torch.device("cuda")) and not cuda_graphs.wanted(torch.device("cpu"))
    monkeypatch.setenv(cuda_graphs.SWITCH, "0")
    assert not cuda_graphs.wanted(torch.device("cuda"))
