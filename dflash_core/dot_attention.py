"""The target's attention in one C++ call per layer, beside the compiled layers, on AVX-512 or AVX2 CPUs.

``aoti_attention``'s compiled kernel runs attention as batched matrix products over a span of the
cache (the mask and softmax fused between them), each row padded to its span: on SmolLM2 with
fast quantized layers it was about a fifth of an autoregressive step (2 ms of 9 at 2 rows, 4 of 20
at 16; ``scripts/pass_parts.py``), mostly the calls' own cost at so few rows. ``csrc/q4_dot.cpp``'s
``write_and_attend`` writes the rows' keys and values into the cache and attends each (row, query
head) over exactly its own positions 0..p in vector dot products: no padding to a span, no mask,
one call. The query heads that share a KV head, over several rows, are attended together: they
share the reads of its keys and values, which at a few rows bound the kernel more than its
arithmetic (``scripts/csrc_ab.py``).

Each (row, head) is summed alone, in an order set by its position only, so a row's numbers never
depend on the rows beside it in a call, and a draft tree's paths (``tree_attention``) get the
chain's numbers as with the compiled kernel. Its sums are rounded their own way: ``aoti_attention``'s
probe (``exact_here``: the writes exact, the eager attention to rounding, rows independent of their
company) decides whether it runs; otherwise the compiled kernel runs.
"""

from __future__ import annotations

import torch

from .int8_dot import cannot_build
from .q4_dot import library

NOTE = "attention in one C++ call per layer (each row over its own positions)"


class DotAttention:
    """``aoti_attention.write_and_attend``'s signature and ``CompiledAttention``'s calls (``runs``,
    ``runner.run``) through ``write_and_attend`` in C++: ``keys`` and ``values`` (one layer's
    cache, (kv_heads, capacity, D)) are written in place."""

    def __init__(self) -> None:
        self._kernel = library().write_and_attend
        self.runner = self  # CompiledAttention's callers call runner.run

    def runs(self, positions: list[int], capacity: int) -> list[tuple[int, int, None]]:
        """One call for every pass: each row reads its own positions, whatever its company."""
        return [(0, len(positions), None)]

    def run(self, inputs: list) -> list[torch.Tensor]:
        """``CompiledAttention.runner.run``'s call: [q, k, v, keys, values, rows, columns (unused)]."""
        return [self(*inputs[:6])]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 rows: torch.Tensor, runs=None) -> torch.Tensor:
        t, heads, d = q.shape
        kv_heads, capacity = keys.shape[0], keys.shape[1]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        rows = rows.to(torch.int64).contiguous()
        out = torch.empty(t, heads * d)
        self._kernel(q.data_ptr(), k.data_ptr(), v.data_ptr(), keys.data_ptr(), values.data_ptr(), rows.data_ptr(),
                     t, heads, kv_heads, d, capacity, out.data_ptr(), torch.get_num_threads())
        return out


def refusal(target) -> str | None:
    """Why ``DotAttention`` cannot serve ``target`` here (None where it can; its probe still decides)."""
    why = cannot_build()
    if why:
        return why
    if target.head_dim % 16 or target.head_dim > 256:
        return f"head_dim {target.head_dim} is not a multiple of 16 up to 256"
    return None
