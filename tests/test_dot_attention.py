"""The target's attention in one C++ call per layer (``dot_attention``): the writes exact, the
eager attention's numbers to rounding, every row's numbers independent of the rows beside it (a lone
row included), preferred to the compiled kernel where it runs, and lossless in a fused target."""

from __future__ import annotations

import pytest
import torch

from dflash_core import aoti_attention, aoti_kernels, dot_attention, int8_dot, q4_dot
from dflash_core.target import FastTarget
from dflash_core.testing import assert_greedy_lossless, assert_greedy_tree_lossless, tiny_target, two_shape_llama

needs_kernel = pytest.mark.skipif(dot_attention.cannot_build() is not None,
                                  reason=f"the C++ kernels cannot run here: {dot_attention.cannot_build()}")


def inputs(rows: list[int], heads: int = 6, kv_heads: int = 2, d: int = 32, capacity: int = 160, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    t = len(rows)
    q = torch.randn(t, heads, d, generator=generator) * d**-0.5
    k, v = (torch.randn(t, kv_heads, d, generator=generator) for _ in range(2))
    keys, values = (torch.randn(kv_heads, capacity, d, generator=generator) for _ in range(2))
    return q, k, v, keys, values, torch.tensor(rows)


@needs_kernel
@pytest.mark.parametrize("rows", [[0], [5, 6], list(range(40, 56)), [0, 1, 2, 15, 16, 17, 33, 159]])
def test_writes_then_attends_over_each_rows_own_positions_as_the_eager_math(rows):
    q, k, v, keys, values = inputs(rows)[:5]
    positions = torch.tensor(rows)
    want_keys, want_values = keys.clone(), values.clone()
    want = aoti_attention.write_and_attend(q, k, v, want_keys, want_values, positions)
    got = dot_attention.DotAttention()(q, k, v, keys, values, positions)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@needs_kernel
def test_a_rows_numbers_never_change_with_the_rows_beside_it():
    attention = dot_attention.DotAttention()
    rows = list(range(90, 106))
    q, k, v, keys, values, positions = inputs(rows)
    together = attention(q, k, v, keys, values, positions)  # the cache now holds every row's keys
    for lo, hi in ((0, 1), (15, 16), (3, 9), (1, 16)):
        assert torch.equal(attention(q[lo:hi], k[lo:hi], v[lo:hi], keys, values, positions[lo:hi]), together[lo:hi])
    assert aoti_attention.exact_here(attention, aoti_attention.AttentionSpec(heads=6, kv_heads=2, head_dim=32)) is None
    # CompiledAttention's calls, as the fused layers make them
    assert attention.runs(rows, 160) == [(0, 16, None)]
    assert torch.equal(attention.runner.run([q, k, v, keys, values, positions, None])[0], together)


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (32, 1, 16), (4, 4, 32), (8, 2, 256)])
def test_query_heads_that_share_reads_of_their_kv_head_get_their_lone_numbers(heads, kv_heads, d):
    """The kernel splits each KV head's queries (rows x its query heads) into runs that share reads
    of its keys and values, as many as the threads and the run length allow: whatever the runs,
    every row's numbers are its own, and the eager math's to rounding."""
    rows = list(range(70, 86))
    q, k, v, keys, values, positions = inputs(rows, heads=heads, kv_heads=kv_heads, d=d, capacity=128, seed=3)
    attention = dot_attention.DotAttention()
    want = aoti_attention.write_and_attend(q, k, v, keys.clone(), values.clone(), positions)
    together = attention(q, k, v, keys, values, positions)
    torch.testing.assert_close(together, want, rtol=1e-4, atol=1e-5)
    for t in (0, 7, 15):
        assert torch.equal(attention(q[t:t + 1], k[t:t + 1], v[t:t + 1], keys, values, positions[t:t + 1]),
                           together[t:t + 1])


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (4, 2, 16), (8, 2, 256)])
def test_the_avx2_build_attends_with_the_avx512_builds_numbers(heads, kv_heads, d, kernel_cache):
    # The AVX2 build sums each key's products four keys at a time in 256-bit halves, the AVX-512
    # build sixteen keys in 512-bit registers: the same tree for every key's lanes. An AVX-512 CPU
    # runs both builds; rows whose positions end inside a run of four keys and of sixteen included.
    if int8_dot.build_isa() != "avx512":
        pytest.skip(f"only a CPU that runs the AVX-512 build runs both (this one: {int8_dot.build_isa()})")
    avx512, avx2 = dot_attention.DotAttention(), dot_attention.DotAttention()
    avx2._kernel = q4_dot.library("avx2").write_and_attend
    for rows in ([0], [1, 2], list(range(13, 30)), [37, 38, 39, 40, 41, 63, 64, 65, 100]):
        q, k, v, keys, values, positions = inputs(rows, heads=heads, kv_heads=kv_heads, d=d, capacity=128, seed=5)
        got = avx2(q, k, v, keys.clone(), values.clone(), positions)
        assert torch.equal(got, avx512(q, k, v, keys, values, positions)), rows


def test_it_refuses_head_sizes_it_does_not_take_and_cpus_without_the_kernels(monkeypatch):
    monkeypatch.setattr(dot_attention, "cannot_build", lambda: None)
    assert dot_attention.refusal(FastTarget(tiny_target("llama"))) is None  # head_dim 16
    runner = FastTarget(tiny_target("llama"))
    runner.head_dim = 24
    assert dot_attention.refusal(runner) == "head_dim 24 is not a multiple of 16 up to 256"
    monkeypatch.setattr(dot_attention, "cannot_build", lambda: "this CPU has no AVX512-BF16")
    assert dot_attention.refusal(runner) == "this CPU has no AVX512-BF16"


@needs_kernel
@pytest.mark.skipif(not aoti_kernels.available(), reason="no C++ compiler or AOTInductor here")
@pytest.mark.slow
def test_a_fused_target_runs_it_and_stays_lossless(kernel_cache):
    model = two_shape_llama()
    runner = FastTarget(model, kernels="aoti")
    if runner.kernels != "aoti":  # a CPU where the compiled layers' rows depend on their company
        return
    assert isinstance(runner.attention, dot_attention.DotAttention)
    assert f"; {dot_attention.NOTE}; " in runner.kernel_note
    assert_greedy_lossless(runner, model, max_new_tokens=60)
    assert_greedy_tree_lossless(runner, model, max_new_tokens=40)
