"""The target's attention as one compiled kernel beside the compiled layers (``aoti_attention``):
used only where a probe finds it the eager attention to rounding with every row independent of
the rows beside it, and a clear note where it is not used. That decoding stays lossless with it
(chains and trees) is test_aoti_layers.py's."""

from __future__ import annotations

import pytest
import torch

from dflash_core import aoti_attention, aoti_kernels, dot_attention
from dflash_core.aoti_attention import AttentionSpec, compiled_attention, eager_attention, exact_here, write_and_attend
from dflash_core.kernels import padded_rows
from dflash_core.target import FastTarget
from dflash_core.testing import tiny_target, two_shape_llama

SPEC = AttentionSpec(heads=4, kv_heads=2, head_dim=16)


def _inputs(t: int = 5, cap: int = 32, first: int = 10):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(t, SPEC.heads, SPEC.head_dim, generator=g)
    keys = torch.randn(SPEC.kv_heads, cap, SPEC.head_dim, generator=g)
    values = torch.randn(SPEC.kv_heads, cap, SPEC.head_dim, generator=g)
    return q, keys, values, torch.arange(first, first + t)


def test_eager_attention_is_causal_attention_over_the_cache_up_to_each_position():
    q, keys, values, rows = _inputs()
    got = eager_attention(q, keys, values, rows)
    group = SPEC.heads // SPEC.kv_heads
    for i, p in enumerate(rows.tolist()):
        for head in range(SPEC.heads):
            k, v = keys[head // group, : p + 1], values[head // group, : p + 1]
            want = torch.softmax(k @ q[i, head], dim=0) @ v
            torch.testing.assert_close(got[i, head * 16 : (head + 1) * 16], want, rtol=1e-5, atol=1e-6)
    # The mask a pass makes once gives the same numbers.
    hidden = ~(torch.arange(keys.shape[1])[None, :] <= rows[:, None])
    assert torch.equal(eager_attention(q, keys, values, rows, hidden), got)


def _eager_as_called(q, k, v, keys, values, rows):
    """The eager math called as the kernel is: never on fewer than ``MIN_CALL_ROWS`` rows."""
    q, k, v, padded = padded_rows(aoti_attention.MIN_CALL_ROWS, q, k, v, rows)
    return write_and_attend(q, k, v, keys, values, padded)[: rows.shape[0]]


def test_the_probe_accepts_the_eager_math_and_refuses_other_numbers_rows_that_depend_on_their_company_or_lost_writes():
    assert exact_here(_eager_as_called, SPEC) is None

    def off(q, k, v, keys, values, rows):
        return _eager_as_called(q, k, v, keys, values, rows) * 1.01

    def company(q, k, v, keys, values, rows):  # a result that moves with the number of rows in the call
        return _eager_as_called(q, k, v, keys, values, rows) + q.shape[0] * 1e-7

    def forgetful(q, k, v, keys, values, rows):  # attends over its rows but leaves the cache as it was
        return _eager_as_called(q, k, v, keys.clone(), values.clone(), rows)

    assert exact_here(off, SPEC) == "its results are not the eager attention's"
    assert exact_here(company, SPEC) == "a row's result changes with the rows beside it in a call"
    assert exact_here(forgetful, SPEC) == "it does not write the keys and values where they belong"


def test_write_and_attend_writes_the_rows_then_attends_over_them():
    q, keys, values, rows = _inputs()
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    want_keys, want_values = keys.clone(), values.clone()
    want_keys[:, rows], want_values[:, rows] = k.transpose(0, 1), v.transpose(0, 1)
    got = write_and_attend(q, k, v, keys, values, rows)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    assert torch.equal(got, eager_attention(q, want_keys, want_values, rows))


def test_a_rows_span_is_its_position_rounded_up_and_a_pass_splits_where_the_span_changes():
    span = aoti_attention.SPAN
    assert [aoti_attention.span_of(p, 8 * span) for p in (0, span - 1, span, 3 * span + 5)] == [span, span, 2 * span, 4 * span]
    assert aoti_attention.span_of(5 * span, 5 * span + 16) == 5 * span + 16  # never past the cache
    kernel = object.__new__(aoti_attention.CompiledAttention)  # runs() needs no kernel
    kernel._columns = torch.arange(0)
    runs = kernel.runs(list(range(span - 3, span + 2)), 4 * span)
    assert [(lo, hi, columns.tolist()) for lo, hi, columns in runs] == [
        (0, 3, list(range(span))), (3, 5, list(range(2 * span)))]
    assert [(lo, hi, len(c)) for lo, hi, c in kernel.runs([7, 8], 4 * span)] == [(0, 2, span)]


def test_a_call_shorter_than_the_fewest_rows_repeats_its_last_row_and_returns_its_own():
    calls = []

    class Recorder:  # the kernel's math in place of its runner, keeping what each call got
        def run(self, inputs):
            calls.append(inputs[0].shape[0])
            return [aoti_attention.write_and_attend_span(*inputs)]

    kernel = object.__new__(aoti_attention.CompiledAttention)
    kernel.runner, kernel._columns = Recorder(), torch.arange(0)
    q, keys, values, rows = _inputs(t=1, cap=48)
    k, v = torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    want_keys, want_values = keys.clone(), values.clone()
    want = write_and_attend(q, k, v, want_keys, want_values, rows)
    got = kernel(q, k, v, keys, values, rows)
    assert calls == [aoti_attention.MIN_CALL_ROWS] and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_the_switch_and_the_target_decide_before_anything_is_built(monkeypatch):
    monkeypatch.setattr(aoti_attention, "attention_library", lambda spec: pytest.fail("nothing is built"))
    monkeypatch.setenv(aoti_attention.SWITCH, "0")
    assert compiled_attention(FastTarget(tiny_target("llama"))) == (None, "turned off (DFLASH_AOTI_ATTENTION=0)")
    monkeypatch.delenv(aoti_attention.SWITCH)
    assert compiled_attention(FastTarget(tiny_target("llama", dtype=torch.bfloat16))) == (
        None, "only fp32 targets on CPU are compiled, not torch.bfloat16 on cpu")


@pytest.mark.skipif(not aoti_kernels.available(), reason="no C++ compiler or AOTInductor here")
def test_a_failed_attention_build_leaves_attention_eager_beside_the_compiled_layers(monkeypatch, kernel_cache):
    def broken(spec):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(aoti_attention, "attention_library", broken)
    monkeypatch.setattr(dot_attention, "refusal", lambda target: "not today")  # the compiled kernel's turn
    runner = FastTarget(two_shape_llama(), kernels="aoti")
    if runner.kernels != "aoti":  # a CPU where the kernels' rows depend on their company
        return
    assert runner.attention is None and runner.compiled_layers
    assert "attention eager (building the attention kernel failed: RuntimeError: no compiler today)" in runner.kernel_note


@pytest.mark.skipif(not aoti_kernels.available(), reason="no C++ compiler or AOTInductor here")
def test_the_built_kernel_is_the_eager_attention_to_rounding_and_loads_from_the_cache(kernel_cache):
    library, meta = aoti_attention.attention_library(SPEC)
    assert meta == {"spec": {"heads": 4, "kv_heads": 2, "head_dim": 16}}
    kernel = aoti_attention.CompiledAttention(library)
    # Its rows independent of their company on this CPU, or the probe says so (and attention stays eager).
    assert exact_here(kernel, SPEC) in (None, "a row's result changes with the rows beside it in a call")
    q, keys, values, rows = _inputs(t=7, cap=48)
    k, v = torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    want_keys, want_values = keys.clone(), values.clone()
    want = write_and_attend(q, k, v, want_keys, want_values, rows)
    torch.testing.assert_close(kernel(q, k, v, keys, values, rows), want, rtol=1e-4, atol=1e-5)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)  # written in place
    # Rows on both sides of a span's end: two calls, each row over its own span, the same numbers.
    q, keys, values, rows = _inputs(t=7, cap=3 * aoti_attention.SPAN, first=aoti_attention.SPAN - 4)
    want_keys, want_values = keys.clone(), values.clone()
    want = write_and_attend(q, k, v, want_keys, want_values, rows)
    assert len(kernel.runs(rows.tolist(), keys.shape[1])) == 2
    torch.testing.assert_close(kernel(q, k, v, keys, values, rows), want, rtol=1e-4, atol=1e-5)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    stamp = library.stat().st_mtime_ns
    assert aoti_attention.attention_library(SPEC)[0].stat().st_mtime_ns == stamp
