"""The position-indexed KV caches: allocation by capacity, rolling back by length."""

import pytest
import torch

from dflash_core.kv_cache import CAPACITY_ALIGN, KVCache, SlotKVCache, round_capacity


def test_capacity_rounds_up_to_the_alignment():
    assert [round_capacity(n) for n in (1, CAPACITY_ALIGN, CAPACITY_ALIGN + 1)] == [
        CAPACITY_ALIGN, CAPACITY_ALIGN, 2 * CAPACITY_ALIGN]


def test_a_new_sequence_of_the_same_rounded_capacity_reuses_the_cache():
    cache = KVCache(layers=2, kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"))
    cache.reset(10)
    assert cache.k.shape == cache.v.shape == (2, 2, CAPACITY_ALIGN, 8) and not cache.k.any()
    keys = cache.k
    cache.length = 7
    cache.reset(CAPACITY_ALIGN)
    assert cache.k is keys and cache.length == 0
    cache.reset(CAPACITY_ALIGN + 1)
    assert cache.k.shape[2] == 2 * CAPACITY_ALIGN and cache.capacity == 2 * CAPACITY_ALIGN


def test_rolling_back_forgets_a_length_and_never_extends_it():
    cache = KVCache(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    cache.reset(8)
    cache.length = 5
    cache.truncate(9)
    assert cache.length == 5
    cache.truncate(3)
    assert cache.length == 3


def test_a_pass_past_the_capacity_is_refused():
    cache = KVCache(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    cache.reset(8)
    cache.check_room(CAPACITY_ALIGN)
    with pytest.raises(ValueError, match=f"holds {CAPACITY_ALIGN} positions; {CAPACITY_ALIGN + 1} requested"):
        cache.check_room(CAPACITY_ALIGN + 1)


def test_slot_cache_stores_keys_transposed_and_releases_one_slot():
    cache = SlotKVCache(layers=2, slots=3, kv_heads=2, head_dim=8, capacity=70, dtype=torch.float32,
                        device=torch.device("cpu"))
    assert cache.capacity == 2 * CAPACITY_ALIGN
    assert cache.k_t.shape == (2, 3, 2, 8, cache.capacity) and cache.v.shape == (2, 3, 2, cache.capacity, 8)
    cache.lengths[:] = torch.tensor([4, 5, 6])
    cache.release(1)
    assert cache.lengths.tolist() == [4, 0, 6]
