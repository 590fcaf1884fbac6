"""CUDA graphs for ``FastTarget``'s short passes: the one-token step and the verify block.

On a GPU, a small target's decode step is bound by kernel launches rather than by the GPU's
arithmetic: every layer is a dozen kernels, each launched from Python. A CUDA graph records a
pass's kernels once and replays them with a single launch (what gpt-fast and vLLM do for decode).
``FastTarget.positions_pass`` takes its positions as a tensor, and its shapes are fixed by the
number of rows, the number of new rows and the cache's capacity, so one graph per pass shape
replays at any position: the inputs are copied into the graph's own buffers before each replay.

A replay runs the same kernels on the same shapes as the eager pass, so its numbers are the eager
pass's bit for bit; greedy DFlash stays equal to AR (``scripts/gpu_check.py`` checks both on the
GPU). Prompts (passes over ``MAX_ROWS`` rows) and trees stay eager: they are few per answer.
``DFLASH_CUDA_GRAPHS=0`` turns graphs off, to measure one against the other.

The bookkeeping (which graph serves which pass, fresh buffers after the cache is reallocated,
outputs that the next replay does not overwrite) is tested on the CPU with ``eager_capture``,
a stand-in that re-runs the pass where a graph would replay it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

if TYPE_CHECKING:
    from .target import FastTarget, TargetOutput

SWITCH = "DFLASH_CUDA_GRAPHS"  # "0": every pass runs eager
MAX_ROWS = 64  # longer passes (prompt chunks) run eager
MAX_GRAPHS = 32  # pass shapes kept per cache allocation; a loop uses two or three

Pass = Callable[[], "TargetOutput"]
# A capture takes a pass over the graph's static buffers and returns (replay, outputs): the pass
# already ran once, ``outputs`` holds its results, and ``replay()`` recomputes them in place.
Capture = Callable[[Pass], "tuple[Callable[[], None], TargetOutput]"]


def wanted(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get(SWITCH, "1") != "0"


def cuda_capture(run: Pass) -> tuple[Callable[[], None], "TargetOutput"]:
    """Record ``run`` as a CUDA graph, after warm-up runs on a side stream (cuBLAS workspaces and
    lazy initialisation must not happen inside a capture). The warm-ups compute the pass for real:
    they write the same keys and values the replay writes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = run()
    graph.replay()  # capturing records the kernels without running them
    return graph.replay, outputs


def eager_capture(run: Pass) -> tuple[Callable[[], None], "TargetOutput"]:
    """What a graph does, without CUDA: outputs in fixed tensors that each replay refills by
    running the pass again over the same static input buffers."""
    outputs = run()

    def replay() -> None:
        fresh = run()
        outputs.logits.copy_(fresh.logits)
        if outputs.features is not None:
            outputs.features.copy_(fresh.features)

    return replay, outputs


@dataclass
class _Graph:
    ids: torch.Tensor  # the graph's input buffers, refilled before each replay
    rows: torch.Tensor
    replay: Callable[[], None]
    outputs: "TargetOutput"


class CudaGraphs:
    """One graph per pass shape (rows, new rows, layers asked for, last_only) of a cache allocation."""

    def __init__(self, target: "FastTarget", capture: Capture = cuda_capture) -> None:
        self.target = target
        self.capture = capture
        self.graphs: dict[tuple, _Graph] = {}
        self._allocation: tuple | None = None
        self.captures = self.replays = 0
        self.broken: str | None = None  # why graphs were given up on (a capture failed), else None

    def forward(self, ids: torch.Tensor, rows: torch.Tensor, real: int, layer_ids: Sequence[int] | None,
                last_only: bool) -> "TargetOutput | None":
        """The pass through a graph, or None where it runs eager (too long, too many shapes, broken)."""
        from .target import TargetOutput

        if self.broken is not None or ids.shape[0] > MAX_ROWS:
            return None
        t = self.target
        # A graph reads the cache and the rotary tables at the addresses it was captured with.
        allocation = (t.cache.capacity, t.cache.k.data_ptr(), t.cache.v.data_ptr(), t.cos.data_ptr(), t.sin.data_ptr())
        if allocation != self._allocation:
            self.graphs.clear()
            self._allocation = allocation
        key = (ids.shape[0], real, tuple(layer_ids or ()), last_only)
        graph = self.graphs.get(key)
        if graph is None:
            if len(self.graphs) >= MAX_GRAPHS:
                return None
            buffers = ids.clone(), rows.clone()
            try:
                replay, outputs = self.capture(lambda: t.positions_pass(*buffers, real, layer_ids, last_only))
            except RuntimeError as error:  # an op that cannot be captured: eager from now on
                self.broken = f"capture failed ({error}); running eager"
                return None
            graph = self.graphs[key] = _Graph(*buffers, replay, outputs)
            self.captures += 1
        else:
            graph.ids.copy_(ids)
            graph.rows.copy_(rows)
            graph.replay()
            self.replays += 1
        out = graph.outputs
        # Copies: the next replay refills the graph's outputs, and callers keep logits across passes.
        return TargetOutput(out.logits.clone(), None if out.features is None else out.features.clone())
