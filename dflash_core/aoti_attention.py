"""The target's attention compiled (AOTInductor), on CPU, beside the compiled layers.

With ``kernels = "aoti"`` the two halves of every decoder layer run compiled (``aoti_layers``);
between them, attention ran as a dozen eager PyTorch ops (the mask, two batched products, softmax,
the reshapes), each dispatched from Python: on a 135M model with int8 matrices about a quarter of
an autoregressive step. Here it is one kernel, (queries, their keys and values, one layer's cache,
their positions) -> attention output: the keys and values written into the cache in place, then
the mask and softmax fused between the two products. It is built once per machine and head layout
into the cache beside ``aoti_kernels``' and shared by all layers (it holds no weights).

A row at position p attends over the cache's first ``span_of(p)`` positions (p rounded up to a
multiple of ``SPAN``), not the whole capacity: attention's cost grows with the span it reads
(docs/BENCHMARKS.md), and early in a long answer most of the cache is still empty. The span is a
function of the row's position alone, the same in every pass that computes that position; a pass
whose rows straddle a multiple of ``SPAN`` is two calls (``CompiledAttention.runs``).

Its sums are rounded their own way (the fused softmax), so its results are the eager attention's
only to rounding. What keeps decoding lossless is that every caller runs the same kernel on the
same layout: a chain's pass over its positions (``FastTarget.positions_pass``), and a draft tree's
pass path by path (``tree_attention``: each path's new nodes, its ancestors already in the cache at
their depths), so every node's arithmetic is the chain's. That holds only if a row's result does not
depend on the rows beside it in a call: a probe checks that here (a lone row, and runs of rows,
against the same rows in one call) and against the eager math, and FastTarget's min-rows probe
then covers the whole pass; otherwise attention stays eager and the load log says why.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .aoti_kernels import cached, compile_shared_object, install, kernel_dir, load_runner, spec_digest
from .kernels import padded_rows

# In the cached kernel's name: a kernel built by an earlier version (other inputs) is never loaded.
KERNEL_VERSION = "v3"  # v2: the rows' keys and values are the kernel's inputs, written by it; v3: spans
# Set to 0 to run attention eager between the compiled halves (to measure one against the other).
SWITCH = "DFLASH_AOTI_ATTENTION"
# A row attends over its position rounded up to this many positions (a divisor of
# kv_cache.CAPACITY_ALIGN, so that a span never passes a cache's capacity): smaller spans waste
# fewer columns, but split more passes in two.
SPAN = 64
# Fewest rows the kernel is called with: a lone row's products take a matrix-vector path that
# rounds differently on some CPUs (seen with MKL on AMD EPYC, not on the AMX Xeon), as
# FastTarget's passes do (its ``min_rows``); a shorter call repeats its last row (the same
# position, so the same write), and the probe checks the padded calls like the others.
MIN_CALL_ROWS = 2


@dataclass(frozen=True)
class AttentionSpec:
    """What the kernel depends on besides the machine: the head layout (fp32 queries and cache)."""

    heads: int
    kv_heads: int
    head_dim: int


def eager_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
                    hidden_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``FastTarget.positions_pass``'s attention for one layer: queries ``q`` (T, heads, D),
    already scaled, at cache positions ``rows`` (T,), each seeing the positions up to its own of
    ``keys`` and ``values`` (kv_heads, capacity, D); returns (T, heads * D). ``hidden_mask`` (T,
    capacity), True where a query may not look, is the same for every layer of a pass: the caller
    may make it once."""
    t, h, d = q.shape
    kv, cap = keys.shape[0], keys.shape[1]
    group = h // kv
    if hidden_mask is None:
        # Every query row spans the whole cache whatever T is -> identical arithmetic per position.
        hidden_mask = ~(torch.arange(cap, device=q.device)[None, :] <= rows[:, None])
    qg = q.reshape(t, kv, group, d).permute(1, 2, 0, 3).reshape(kv, group * t, d)
    scores = torch.matmul(qg, keys.transpose(1, 2)).view(kv, group, t, cap).masked_fill(hidden_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).view(kv, group * t, cap)
    att = torch.matmul(probs, values)
    return att.view(kv, group, t, d).permute(2, 0, 1, 3).reshape(t, h * d)


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     rows: torch.Tensor) -> torch.Tensor:
    """The attention's math: the rows' keys and values ``k``, ``v`` (T, kv_heads, D) written into
    one layer's cache at positions ``rows``, then ``eager_attention`` over the whole cache."""
    return write_and_attend_span(q, k, v, keys, values, rows, torch.arange(keys.shape[1], device=keys.device))


def write_and_attend_span(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The kernel's math: ``write_and_attend`` with attention over the cache's first
    ``len(columns)`` positions only (``columns`` is ``arange(span)``; a tensor, so that the span
    is one of the kernel's dynamic sizes), every row's position below the span."""
    keys.index_copy_(1, rows, k.transpose(0, 1))
    values.index_copy_(1, rows, v.transpose(0, 1))
    span = columns.shape[0]
    torch._check(span <= keys.shape[1])
    hidden_mask = ~(columns[None, :] <= rows[:, None])
    return eager_attention(q, keys[:, :span], values[:, :span], rows, hidden_mask)


def span_of(position: int, capacity: int) -> int:
    """How many cache positions a row at ``position`` attends over (masked beyond its own)."""
    return min(capacity, (position // SPAN + 1) * SPAN)


class _Attention(torch.nn.Module):
    def forward(self, q, k, v, keys, values, rows, columns):
        return write_and_attend_span(q, k, v, keys, values, rows, columns)


def _example(spec: AttentionSpec, rows: int, capacity: int, first: int, generator: torch.Generator) -> tuple:
    q = torch.randn(rows, spec.heads, spec.head_dim, generator=generator) * spec.head_dim**-0.5
    k, v = (torch.randn(rows, spec.kv_heads, spec.head_dim, generator=generator) for _ in range(2))
    keys = torch.randn(spec.kv_heads, capacity, spec.head_dim, generator=generator)
    values = torch.randn(spec.kv_heads, capacity, spec.head_dim, generator=generator)
    return q, k, v, keys, values, torch.arange(first, first + rows)


def _build(spec: AttentionSpec, library: Path) -> dict:
    rows = torch.export.Dim("rows", min=1, max=1 << 16)
    capacity = torch.export.Dim("capacity", min=2, max=1 << 20)
    span = torch.export.Dim("span", min=2, max=1 << 20)
    example = (*_example(spec, 2, 128, 30, torch.Generator().manual_seed(0)), torch.arange(64))
    with tempfile.TemporaryDirectory(dir=library.parent) as folder:
        # The products stay ATen's batched matmuls (max-autotune's GEMM templates are for weights).
        staged, _ = compile_shared_object(_Attention().eval(), example, Path(folder), library.name,
                                          dynamic_shapes=({0: rows}, {0: rows}, {0: rows}, {1: capacity}, {1: capacity},
                                                          {0: rows}, {0: span}),
                                          configs={"max_autotune": False})
        return install(staged, library, {"spec": asdict(spec)})


def attention_library(spec: AttentionSpec) -> tuple[Path, dict]:
    """The compiled attention for ``spec``, built here first if the cache lacks it."""
    library = kernel_dir() / f"attention-{KERNEL_VERSION}-float32-{spec_digest(spec)}.so"
    return cached(library, lambda path: _build(spec, path))


Runs = list[tuple[int, int, torch.Tensor]]


class CompiledAttention:
    """``write_and_attend`` through the compiled kernel: the writes exactly, the attention to
    rounding, each row over its own span (see the module's docstring). ``keys`` and ``values``
    (one layer's cache) are written in place."""

    def __init__(self, library: Path) -> None:
        self.runner = load_runner(library)
        self._columns = torch.arange(0)

    def runs(self, positions: list[int], capacity: int) -> Runs:
        """The calls for rows at ``positions`` in a cache of ``capacity``: ``(first, end,
        columns)`` per run of consecutive rows sharing a span (a pass's rows ascend: one run, or
        two where they straddle a span's end). A pass computes this once for all its layers."""
        spans = [span_of(p, capacity) for p in positions]
        if self._columns.shape[0] < max(spans):
            self._columns = torch.arange(max(spans))
        bounds = [i for i in range(1, len(spans)) if spans[i] != spans[i - 1]]
        return [(lo, hi, self._columns[: spans[lo]]) for lo, hi in zip([0, *bounds], [*bounds, len(spans)])]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 rows: torch.Tensor, runs: Runs | None = None) -> torch.Tensor:
        if runs is None:
            runs = self.runs(rows.tolist(), keys.shape[1])
        if len(runs) == 1:
            return self._call(q, k, v, keys, values, rows, runs[0][2])
        return torch.cat([self._call(q[lo:hi], k[lo:hi], v[lo:hi], keys, values, rows[lo:hi], columns)
                          for lo, hi, columns in runs])

    def _call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        real = q.shape[0]
        q, k, v, rows = (t.contiguous() for t in padded_rows(MIN_CALL_ROWS, q, k, v, rows))
        return self.runner.run([q, k, v, keys, values, rows, columns])[0][:real]


def exact_here(attention, spec: AttentionSpec) -> str | None:
    """Why ``attention`` (``write_and_attend``'s signature) may not replace the eager writes and
    attention here (None when it may): it must write the rows' keys and values where they belong,
    its results must be the eager ones to fp32 rounding, and each row's must not change with the
    rows beside it in a call (a lone row, and runs of rows, against the same rows among 16, the
    cache already holding them all), at two capacities, the 16 rows straddling a span's end."""
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for capacity in (2 * SPAN, 5 * SPAN):
            q, k, v, keys, values, rows = _example(spec, 16, capacity, capacity - SPAN - 8, generator)
            want_keys, want_values = keys.clone(), values.clone()
            want = write_and_attend(q, k, v, want_keys, want_values, rows)
            own = attention(q, k, v, keys, values, rows)
            if not (torch.equal(keys, want_keys) and torch.equal(values, want_values)):
                return "it does not write the keys and values where they belong"
            if not torch.allclose(own, want, rtol=1e-4, atol=1e-5):
                return "its results are not the eager attention's"
            for lo, hi in ((0, 1), (15, 16), (0, 2), (3, 9), (1, 16)):
                if not torch.equal(attention(q[lo:hi], k[lo:hi], v[lo:hi], keys, values, rows[lo:hi]), own[lo:hi]):
                    return "a row's result changes with the rows beside it in a call"
    return None


def compiled_attention(target) -> tuple[CompiledAttention | None, str]:
    """The compiled attention for ``target`` (a ``FastTarget`` whose layers run compiled) and a
    note: ``dot_attention``'s C++ call where it runs and its probe passes, else this module's
    kernel; ``(None, why not)`` where the switch, the target, a build or the probe refuses."""
    if os.environ.get(SWITCH, "1") == "0":
        return None, f"turned off ({SWITCH}=0)"
    if target.dtype != torch.float32 or target.device.type != "cpu":
        return None, f"only fp32 targets on CPU are compiled, not {target.dtype} on {target.device.type}"
    if target.num_heads % target.num_kv_heads:
        return None, f"{target.num_heads} query heads do not share {target.num_kv_heads} KV heads evenly"
    spec = AttentionSpec(heads=target.num_heads, kv_heads=target.num_kv_heads, head_dim=target.head_dim)
    from . import dot_attention  # one C++ call per layer where it runs and its probe passes (faster)

    why = dot_attention.refusal(target)
    if why is None:
        attention = dot_attention.DotAttention()
        if exact_here(attention, spec) is None:
            return attention, dot_attention.NOTE
    try:
        attention = CompiledAttention(attention_library(spec)[0])
    except Exception as exc:  # a compiler or AOTInductor failure here: attention stays eager
        return None, f"building the attention kernel failed: {type(exc).__name__}: {str(exc)[:200]}"
    why = exact_here(attention, spec)
    return (None, why) if why else (attention, "attention compiled")
