"""KV caches indexed by absolute position, for ``FastTarget`` and the batched decoder.

Every position owns a fixed slot, allocated up front: appending writes rows in place, and
rolling back is forgetting a length (rejected slots are overwritten later, nothing is copied).
Attention reads the cache in place, so the layouts below are what the attention products want.
Caches start as zeros, not ``empty``: masked-out slots are multiplied by exactly 0 in attention,
and 0 * NaN would poison the row.
"""

from __future__ import annotations

import torch

CAPACITY_ALIGN = 64  # cache capacity granularity (positions)


def round_capacity(positions: int) -> int:
    return -(-positions // CAPACITY_ALIGN) * CAPACITY_ALIGN


class KVCache:
    """One sequence: ``k`` and ``v``, each (layers, kv_heads, capacity, D); positions below
    ``length`` are the sequence's."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.capacity = 0
        self.length = 0

    def reset(self, capacity: int) -> None:
        """Empty, holding at least ``capacity`` positions (rounded up to ``CAPACITY_ALIGN``);
        the tensors are reallocated only when the rounded capacity changes."""
        capacity = round_capacity(capacity)
        if capacity != self.capacity:
            shape = (self.layers, self.kv_heads, capacity, self.head_dim)
            self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.capacity = capacity
        self.length = 0

    def check_room(self, end: int) -> None:
        """Refuse a pass that would write past the cache."""
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; {end} requested (call reset with more)")

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions (a longer ``length`` changes nothing)."""
        self.length = min(self.length, length)


class SlotKVCache:
    """Many sequences decoded together (``training/batched_decode.py``): slot ``s`` holds its
    sequence at positions ``0 .. lengths[s] - 1``.

    ``k_t`` is (layers, slots, kv_heads, D, capacity), keys stored transposed so that the score
    product takes the filled span as (D, span) rows: bf16 matmul still gathers a strided span into
    a contiguous copy, but from this layout the gather is cheap (measured against slicing and
    transposing the (capacity, D) layout). ``v`` is (layers, slots, kv_heads, capacity, D)."""

    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.capacity = round_capacity(capacity)
        self.k_t = torch.zeros(layers, slots, kv_heads, head_dim, self.capacity, dtype=dtype, device=device)
        self.v = torch.zeros(layers, slots, kv_heads, self.capacity, head_dim, dtype=dtype, device=device)
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)

    def release(self, slot: int) -> None:
        """Forget ``slot``'s sequence."""
        self.lengths[slot] = 0
