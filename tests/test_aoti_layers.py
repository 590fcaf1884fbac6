"""Decoder layers compiled whole around attention (``aoti_layers``, tried first with ``kernels =
"aoti"``): one kernel per half for all of a model's layers, each layer's weights swapped in, used
only where a probe finds it the eager layer to rounding, lossless when used, and a clear fallback
to the matrix-by-matrix kernels otherwise."""

from __future__ import annotations

import pytest
import torch

from dflash_core import aoti_attention, aoti_kernels, aoti_layers, dot_attention, int8_dot
from dflash_core.target import FastTarget
from dflash_core.testing import (PROMPTS, assert_greedy_lossless, assert_greedy_tree_lossless, assert_same_logits,
                                 assert_tree_nodes_are_their_paths, attention_note, tiny_drafter, tiny_target,
                                 two_shape_llama)

pytestmark = pytest.mark.skipif(not aoti_kernels.available(), reason="no C++ compiler or AOTInductor here")

SPEC = aoti_layers.LayerSpec(kind="float32", hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=64, eps=1e-6)


def test_the_wrappers_declared_constants_are_read_with_their_shapes():
    source = '''
    constants_info_[0].name = "ln1";
    constants_info_[0].shape = {64};
    constants_info_[1].name = "constant1";
    constants_info_[1].shape = {5, 64, 24};
    '''
    assert aoti_layers._constants_of(source) == {"ln1": (64,), "constant1": (5, 64, 24)}


def test_constants_are_matched_to_parameters_and_blocked_matrices_by_shape():
    declared = {"constant3": (8, 64, 16), "constant2": (4, 64, 16), "constant4": (4, 64, 16), "ln2": (64,)}
    plan = aoti_layers._assign(SPEC, "after", declared, {"ln2": "ln2"})
    # o (64x64) and down (64x64) share a shape: the graph's order (constant2 before constant4) decides.
    assert plan == [{"name": "constant2", "source": "o.weight", "block": 16},
                    {"name": "constant3", "source": "gate_up.weight", "block": 16},
                    {"name": "constant4", "source": "down.weight", "block": 16},
                    {"name": "ln2", "source": "ln2", "block": None}]
    with pytest.raises(RuntimeError, match="neither a parameter nor a blocked matrix"):
        aoti_layers._assign(SPEC, "after", {**declared, "constant5": (3, 7)}, {})
    with pytest.raises(RuntimeError, match="no blocked weight found in the kernel for down"):
        aoti_layers._assign(SPEC, "after", {k: v for k, v in declared.items() if k != "constant4"}, {})


def test_constants_the_graph_made_from_the_parameters_are_told_apart_by_value():
    # w8a8's kernels are built with distinct random parameters packaged: each constant inductor
    # derived from them (the int8 GEMM's fp32 scales, its zero-point compensation, unit scalars)
    # is named by what it equals, and rebuilt from each layer's own parameters.
    params = {"o.scales": torch.tensor([0.5, 0.25]), "o.smoothing": torch.tensor([2.0, 3.0])}
    assert aoti_layers._derived("c", torch.tensor([0.5, 0.25], dtype=torch.float64), params) == {
        "name": "c", "source": "o.scales", "block": None, "dtype": "float64"}
    assert aoti_layers._derived("z", torch.zeros(3), params) == {"name": "z", "zeros": [3], "block": None, "dtype": "float32"}
    assert aoti_layers._derived("s", torch.tensor(1.0), params) == {"name": "s", "value": 1.0, "block": None, "dtype": "float32"}
    assert aoti_layers._derived("u", torch.tensor([7.0, 8.0]), params) is None
    plan = [{"name": "c", "source": "o.scales", "block": None, "dtype": "float64"}, {"name": "z", "zeros": [3], "block": None,
            "dtype": "float32"}, {"name": "s", "value": 1.0, "block": None, "dtype": "float32"}]
    built = aoti_layers._constants(plan, params)
    assert built["c"].dtype == torch.float64 and torch.equal(built["c"].float(), params["o.scales"])
    assert torch.equal(built["z"], torch.zeros(3)) and built["s"].item() == 1.0
    # Blocked matrices are placed by their built values: which matrix (two of one shape included)
    # and which VNNI interleave (int8 x int8 and bf16-row matrices of one kernel differ); one the
    # runner gives no value for (renamed apart from another of its name) keeps the shape rule.
    codes = {name: torch.randint(-127, 128, (32, 8), dtype=torch.int8) for name in ("o.weight", "down.weight")}
    plan = [{"name": "constant1", "source": "o.weight", "block": 16}, {"name": "constant1_0", "source": "down.weight", "block": 16},
            {"name": "constant2", "source": "down.weight", "block": 16}]
    values = {"constant1": aoti_kernels.blocked(codes["down.weight"], 16, 4), "constant2": aoti_kernels.blocked(codes["o.weight"], 16, 2)}
    fqns = {"constant1": "constant1", "constant1_0": "constant1", "constant2": "constant2"}
    placed = aoti_layers._match_blocked_by_value(plan[:1] + plan[2:], codes, values, fqns)
    assert placed == [{"name": "constant1", "source": "down.weight", "block": 16, "built_vnni": 4},
                      {"name": "constant2", "source": "o.weight", "block": 16, "built_vnni": 2}]
    del values["constant1"]
    plan = [{"name": "constant1_0", "source": "o.weight", "block": 16}, {"name": "constant2", "source": "down.weight", "block": 16}]
    placed = aoti_layers._match_blocked_by_value(plan, codes, values, fqns)
    assert placed == [{"name": "constant1_0", "source": "down.weight", "block": 16},
                      {"name": "constant2", "source": "o.weight", "block": 16, "built_vnni": 2}]


def test_unsigned_rows_zero_point_compensation_is_told_apart_and_rebuilt_bit_for_bit():
    # With unsigned rows inductor's int8 GEMM takes the zero point off through a constant it
    # computes from the weight at build: each output's weight sum x its scale x 128. The plan
    # names it by the matrix it comes from, and each layer's is rebuilt from its own weights.
    generator = torch.Generator().manual_seed(0)
    params = {"o.weight": torch.randint(-127, 128, (24, 40), generator=generator, dtype=torch.int8),
              "o.scales": torch.rand(24, generator=generator) / 64 + 1 / 128, "o.smoothing": torch.rand(40) + 0.5}
    built = (params["o.weight"].t().float().sum(0) * (torch.tensor(1.0) * params["o.scales"])
             * torch.tensor(aoti_layers.ROW_ZERO_POINT, dtype=torch.int32))  # inductor's order of operations
    rule = aoti_layers._derived("w_BMatrixCompens", built, params)
    assert rule == {"name": "w_BMatrixCompens", "compensation": "o.weight", "block": None, "dtype": "float32"}
    other = {"o.weight": torch.randint(-127, 128, (24, 40), generator=generator, dtype=torch.int8),
             "o.scales": torch.rand(24, generator=generator) / 64 + 1 / 128}
    want = other["o.weight"].float().sum(1) * other["o.scales"] * aoti_layers.ROW_ZERO_POINT
    assert torch.equal(aoti_layers._constants([rule], other)["w_BMatrixCompens"], want)
    # Off by one code in one weight: no longer this matrix's compensation.
    params["o.weight"][3, 5] += 1
    assert aoti_layers._derived("w_BMatrixCompens", built, params) is None


def test_unsigned_rows_give_the_signed_products():
    # The product written as inductor's pattern for unsigned rows: w8a8's integer sums, rescaled.
    from dflash_core.weight_formats import quantize_rows

    generator = torch.Generator().manual_seed(1)
    weight = torch.randint(-127, 128, (48, 64), generator=generator, dtype=torch.int8)
    scales, smoothing = torch.rand(48, generator=generator) / 64 + 1 / 128, torch.rand(64, generator=generator) + 0.5
    x = torch.randn(5, 64, generator=generator)
    got = aoti_layers.unsigned_rows_product(x, weight, scales, torch.zeros(48, dtype=torch.int64), smoothing)
    codes, row_scales = quantize_rows(x / smoothing)
    want = ((codes.double() @ weight.double().t()) * row_scales.double() * scales.double()).float()
    assert (got - want).norm() <= 1e-6 * want.norm()


@pytest.mark.parametrize("signed, unsigned, want", [
    (True, True, ("int8", None)),  # AMX
    (False, True, ("uint8", None)),  # AVX-512 VNNI without AMX
    (None, False, ("int8", None)),  # an inductor that cannot say: the build and the probes decide
    (False, False, (None, "inductor has no int8 x int8 kernel for this CPU (avx2), only its reference loops; "
                          "none for unsigned rows either")),  # AVX2
])
def test_w8a8_rows_follow_inductors_table_of_kernels(monkeypatch, signed, unsigned, want):
    table = {torch.int8: (signed, "avx2"), torch.uint8: (unsigned, "avx2")}
    monkeypatch.setattr(aoti_kernels, "_int8_micro_gemm", lambda rows: table[rows])
    assert aoti_kernels.w8a8_rows() == want


def test_a_spec_field_at_its_default_keeps_the_kernels_names():
    # LayerSpec.rows and .down_apart came after kernels were built: at their defaults they leave
    # their names alone.
    from dataclasses import asdict
    import hashlib
    import json

    fields = asdict(SPEC)
    del fields["rows"], fields["down_apart"]
    assert aoti_kernels.spec_digest(SPEC) == hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    w8a8 = aoti_layers.LayerSpec(**{**asdict(SPEC), "kind": "w8a8"})
    for changed in ({"rows": "uint8"}, {"down_apart": True}):
        assert aoti_kernels.spec_digest(aoti_layers.LayerSpec(**{**asdict(w8a8), **changed})) != aoti_kernels.spec_digest(w8a8)


def test_a_bf16_target_is_not_compiled():
    runner = FastTarget(tiny_target("llama", dtype=torch.bfloat16))
    spec, why = aoti_layers.layer_spec(runner.layers[0], runner)
    assert spec is None and why == "only fp32 targets on CPU are compiled, not torch.bfloat16 on cpu"


def test_the_switch_turns_whole_layers_off(monkeypatch):
    monkeypatch.setenv(aoti_layers.SWITCH, "0")
    runner = FastTarget(tiny_target("llama"))
    assert aoti_layers.compiled_layers(runner) == (None, "turned off (DFLASH_AOTI_WHOLE_LAYERS=0)")


def test_a_failed_layer_build_falls_back_to_the_matrices_and_says_why(monkeypatch, kernel_cache):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(aoti_layers, "layer_library", broken)
    monkeypatch.setattr(aoti_kernels, "kernel_library", broken)
    runner = FastTarget(two_shape_llama(), kernels="aoti")
    assert not any(isinstance(layer, aoti_layers.CompiledLayer) for layer in runner.layers)
    assert runner.kernels == "onednn"
    assert "building or loading the kernel failed: RuntimeError: no compiler today" in runner.kernel_note


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["bf16", "int8", "w8a8"])
def test_compiled_layers_are_the_eager_ones_and_lossless(weights, kernel_cache):
    model = two_shape_llama()
    calibration = torch.tensor([t for prompt in PROMPTS for t in prompt])  # w8a8's smoothing factors
    runner = FastTarget(model, weights=weights, kernels="aoti", calibration_ids=calibration)
    kind = "float32" if weights == "bf16" else weights
    rows, missing = aoti_kernels.w8a8_rows()
    if weights == "w8a8" and missing:
        # inductor would run the int8 x int8 products through its reference loops here (AVX2: no
        # vector kernel for signed or unsigned rows): the int8 weight-only layers run instead,
        # and the note says why
        assert rows is None and missing.startswith("inductor has no int8 x int8 kernel")
        assert missing.endswith("; none for unsigned rows either")
        assert runner.weight_format == "int8"
        assert runner.weight_note.startswith(f"asked for w8a8, running int8 ({missing}): int8")
        kind = "int8"
    elif weights == "w8a8":
        # signed rows where inductor has a kernel for them (AMX), else unsigned ones (AVX-512 VNNI)
        assert runner.weight_format == "w8a8" and rows == ("int8" if aoti_kernels.int8_rows_gemm_missing() is None else "uint8")
    if runner.kernels != "aoti":  # a CPU where the kernels' rows depend on their company: and why
        assert runner.kernel_note.startswith("asked for aoti, running oneDNN")
        return
    if kind == "w8a8" and "layers not compiled whole" in runner.kernel_note:
        # an int8 x int8 GEMM that gives other numbers than the eager int8 product: the probe
        # refuses it, and says so
        assert "building the layer kernels failed: RuntimeError: the compiled layer's results are not the eager layer's" \
            in runner.kernel_note
        return
    # int8_dot's bf16 dot products for the weight-only int8 head and down where they run (AVX512-BF16, no AMX)
    dot = kind != "float32" and int8_dot.unavailable() is None
    head = "through the C++ GEMM" if kind == "float32" else f"int8 through {'bf16 dot products' if dot else 'the int8 GEMM'}"
    unsigned = ", rows unsigned" if kind == "w8a8" and rows == "uint8" else ""
    down = ", down through bf16 dot products" if dot else ""
    assert runner.kernel_note == (f"3 of 3 decoder layers compiled whole around attention ({kind} matrices{unsigned}{down}); "
                                  f"{attention_note(runner)}; the LM head {head}")
    assert all(isinstance(layer.after, aoti_layers.HalfThenDown) == dot for layer in runner.layers)
    assert isinstance(runner.attention, (aoti_attention.CompiledAttention, dot_attention.DotAttention))
    # The drafter reads the full-precision head whatever runs the target's.
    assert runner.lm_head_weight is model.lm_head.weight or torch.equal(runner.lm_head_weight, model.lm_head.weight)
    assert all(isinstance(layer, aoti_layers.CompiledLayer) for layer in runner.layers)
    built = {p.name for p in kernel_cache.rglob("layer-*.so")}
    for half in ("before", "after"):
        assert len([name for name in built if name.startswith(f"layer-{half}-{kind}-")]) == 1, built
    assert runner.batch_invariant
    # The eager layers of the same weights: the same logits to rounding (fp32's, or bf16 rows' for int8).
    eager = FastTarget(model, weights=weights, calibration_ids=calibration)
    if eager.weight_format == runner.weight_format:
        assert_same_logits(runner, eager, PROMPTS[0], 1e-4 if kind == "float32" else 2e-2)
        # A prompt of 170 positions: one pass whose rows span three attention spans (three calls).
        long = torch.tensor(list(range(4, 89)) * 2)
        for r in (runner, eager):
            r.reset(256)
        got, want = runner.forward(long, None).logits, eager.forward(long, None).logits
        assert (got - want).norm() <= (1e-4 if kind == "float32" else 2e-2) * want.norm()
    # 90 new tokens: passes whose rows straddle an attention span's end (aoti_attention.SPAN) too.
    assert_greedy_lossless(runner, model, max_new_tokens=90)
    # The tree pass (the fastest variant's) runs the compiled halves too: each node's numbers are
    # its path's, decoded token by token; with the compiled attention every path takes its turn
    # in the cache. After 60 prompt tokens, paths straddle a span's end.
    assert_tree_nodes_are_their_paths(runner, PROMPTS[0][:-1], seeds=range(3))
    assert_tree_nodes_are_their_paths(runner, list(range(4, 64)), seeds=range(3))
    # Where a CPU pads passes to more rows, the padding rows copy the last node.
    probed, runner.min_rows = runner.min_rows, 5
    assert_tree_nodes_are_their_paths(runner, PROMPTS[0][:-1], seeds=range(4))
    runner.min_rows = probed
    assert_greedy_tree_lossless(runner, model, max_new_tokens=90)
    if isinstance(runner.attention, aoti_attention.CompiledAttention):  # dot_attention reads no spans
        assert_each_row_attends_over_its_own_span(runner, model)
    # A second target loads the built kernels: nothing is rebuilt.
    stamps = {p: p.stat().st_mtime_ns for p in kernel_cache.rglob("layer-*.so")}
    again = FastTarget(model, weights=weights, kernels="aoti", calibration_ids=calibration)
    assert again.kernels == "aoti" and {p: p.stat().st_mtime_ns for p in kernel_cache.rglob("layer-*.so")} == stamps


class RecordingRunner:
    """An attention kernel's runner that records, per call, its rows' positions, its span and the
    cache's capacity."""

    def __init__(self, runner) -> None:
        self.inner, self.calls = runner, []

    def run(self, args: list) -> list:
        self.calls.append((args[5].tolist(), args[6].shape[0], args[3].shape[1]))
        return self.inner.run(args)


def assert_each_row_attends_over_its_own_span(runner, model) -> None:
    """In chains, trees and autoregressive steps alike, every call of the attention kernel spans
    ``span_of`` its rows' positions: the one thing that keeps a row's numbers those of its position
    whatever pass computes it, on a CPU where spans change the rounding (not every CPU's does)."""
    from dflash_core.speculative import GenerationConfig, collect, stream

    recorder = runner.attention.runner = RecordingRunner(runner.attention.runner)
    try:
        drafter = tiny_drafter(model)
        for cfg in (GenerationConfig(max_new_tokens=90, block_size=1), GenerationConfig(max_new_tokens=90, block_size=16),
                    GenerationConfig(max_new_tokens=90, block_size=16, tree=True)):
            collect(stream(runner, drafter, PROMPTS[2], cfg.validated(16)))
    finally:
        runner.attention.runner = recorder.inner
    spans = {span for _, span, _ in recorder.calls}
    assert {aoti_attention.SPAN, 2 * aoti_attention.SPAN} <= spans, spans
    for rows, span, capacity in recorder.calls:
        assert {aoti_attention.span_of(p, capacity) for p in rows} == {span}, (rows, span)


@pytest.mark.slow
def test_qwen3s_qk_norm_is_compiled_too(kernel_cache):
    model = tiny_target("qwen3")
    runner = FastTarget(model, kernels="aoti")
    if runner.kernels != "aoti":
        assert runner.kernel_note.startswith("asked for aoti, running oneDNN")
        return
    assert all(isinstance(layer, aoti_layers.CompiledLayer) for layer in runner.layers)
    spec, _ = aoti_layers.layer_spec(runner.layers[0], runner)
    assert spec.qk_norm
    assert_same_logits(runner, FastTarget(model), PROMPTS[2], 1e-4)
    assert_greedy_lossless(runner, model)
