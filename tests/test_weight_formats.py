"""Weight-only int8 / int4 target weights (``weights`` in models.toml): used only where exact per
row on this CPU, lossless (greedy DFlash == greedy AR) when used, a clear fallback otherwise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_core import weight_formats
from dflash_core.errors import RegistryError
from dflash_core.registry import parse_registry
from dflash_core.speculative import GenerationConfig, collect, stream
from dflash_core.target import FastTarget, make_runner
from dflash_core.testing import PROMPTS, OracleDrafter, tiny_drafter, tiny_target
from dflash_core.weight_formats import (DynamicInt8Weight, Int4Weight, Int8Weight, kernel_available, quantize_q4,
                                        quantize_rows, quantized_layers, row_invariant, smoothing_factors)

PAIR = {"target": {"hub": "x/y"}, "drafter": {"random": True}}


CALIBRATION = torch.tensor([t for prompt in PROMPTS for t in prompt])  # w8a8's activation maxima


def expected_format(model: torch.nn.Module, fmt: str) -> bool:
    """Whether this machine's kernels let ``fmt`` run (what the runner's probe must decide)."""
    if not kernel_available(fmt):
        return False
    runner = FastTarget(model)
    maxima = runner.activation_maxima(CALIBRATION) if fmt == "w8a8" else None
    layers, _ = quantized_layers(runner.layers, fmt, runner.dtype, None, maxima)
    return layers is not None


def test_registry_reads_weights_and_refuses_an_unknown_format():
    registry = parse_registry({"pairs": {"a": {**PAIR, "weights": "int4"}, "b": PAIR}}, Path("models.toml"))
    assert registry.pairs["a"].weights == "int4"
    assert registry.pairs["b"].weights == "bf16"  # the default
    with pytest.raises(RegistryError, match=r"weights = 'int3'; allowed: bf16, int8, int4"):
        parse_registry({"pairs": {"a": {**PAIR, "weights": "int3"}}}, Path("models.toml"))


def test_runner_refuses_an_unknown_format():
    model = tiny_target("llama", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weights = 'fp8'"):
        FastTarget(model, "fp8")
    with pytest.raises(ValueError, match="weights = 'fp8'"):
        make_runner(model, weights="fp8")


@pytest.mark.parametrize("fmt", ["int8", "int4", "w8a8"])
def test_kernels_are_close_to_the_weight_they_stand_for(fmt):
    if not kernel_available(fmt):
        pytest.skip(f"this PyTorch has no {fmt} kernel")
    if fmt == "w8a8" and not weight_formats.int8_sums_exact():
        pytest.skip("int8 sums saturate on this CPU: FastTarget refuses w8a8 here (tested apart)")
    torch.manual_seed(0)
    weight = torch.randn(96, 128)
    if fmt == "int4":
        blocks = quantize_q4(weight)
        kernel, exact = Int4Weight(blocks), blocks.dequantize()
    elif fmt == "w8a8":  # the rows rounded too: further from the weight, still close
        kernel, exact = DynamicInt8Weight(weight, torch.rand(128) + 0.5), weight
    else:
        kernel = Int8Weight(weight)
        exact = kernel.q.float() * kernel.scales.float()[:, None]
    x = torch.randn(5, 128).bfloat16()
    truth = x.float() @ exact.T
    got = kernel(x).float()
    assert got.shape == (5, 96) and got.dtype == torch.float32
    assert (got - truth).norm() / truth.norm() < (2e-2 if fmt == "w8a8" else 1e-2)


@pytest.mark.parametrize("fmt", ["int8", "int4", "w8a8"])
def test_probe_decides_the_format_and_greedy_dflash_equals_ar(fmt):
    model = tiny_target("llama", dtype=torch.bfloat16)
    usable = expected_format(model, fmt)
    runner = FastTarget(model, fmt, calibration_ids=CALIBRATION)
    if not usable:  # a CPU whose kernel is missing or rounds a row by its company: bf16, and says why
        assert runner.weight_format == "bf16" and runner.weight_note.startswith(f"asked for {fmt}, running bf16")
        return
    if not runner.batch_invariant:
        assert runner.weight_format == "bf16" and "no padding" in runner.weight_note
        return
    assert runner.weight_format == fmt
    assert all(isinstance(layer.qkv, weight_formats.QuantizedLinear) for layer in runner.layers)
    # The quantized target is another model: its logits differ from bf16's, a little.
    bf16 = FastTarget(tiny_target("llama", dtype=torch.bfloat16))
    ids = torch.tensor(PROMPTS[0])
    for r in (runner, bf16):
        r.reset(64)
    a, b = runner.forward(ids, None).logits.float(), bf16.forward(ids, None).logits.float()
    assert not torch.equal(a, b) and (a - b).norm() / b.norm() < 0.2
    drafter = tiny_drafter(model, layers=1)
    for prompt in PROMPTS:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=40, block_size=1).validated(16)))
        for block in (2, 4, 16):
            cfg = GenerationConfig(max_new_tokens=40, block_size=block).validated(16)
            assert collect(stream(runner, drafter, prompt, cfg)).token_ids == ar.token_ids, (fmt, block)
            oracle = OracleDrafter(drafter, list(prompt) + ar.token_ids)
            assert collect(stream(runner, oracle, prompt, cfg)).token_ids == ar.token_ids, (fmt, block, "oracle")


def test_w8a8_rows_are_independent_and_smoothing_moves_an_outlier_channel_into_the_weight():
    torch.manual_seed(0)
    weight, x = torch.randn(96, 128), torch.randn(6, 128)
    x[:, 3] *= 60  # one channel carrying most of each row's magnitude, as LLMs' norms make
    plain = DynamicInt8Weight(weight)
    smoothed = DynamicInt8Weight(weight, smoothing_factors(x.abs().amax(0), weight))
    truth = x @ weight.T
    error = {name: ((k(x) - truth).norm() / truth.norm()).item() for name, k in (("plain", plain), ("smoothed", smoothed))}
    assert error["smoothed"] < error["plain"] / 2, error
    # Integer sums and per-row scales: a row's numbers never depend on its company.
    assert torch.equal(torch.cat([smoothed(x[i : i + 1]) for i in range(6)]), smoothed(x))
    assert row_invariant(smoothed, 128, torch.float32)
    codes, scales = quantize_rows(x)
    assert codes.dtype == torch.int8 and codes.abs().amax(-1).eq(127).all()
    assert torch.allclose(codes.float() * scales, x, atol=scales.max().item())


def test_w8a8_runs_only_where_int8_sums_are_exact(monkeypatch):
    # On an AVX2 CPU oneDNN's int8 product saturates 16-bit pairs of byte products: w8a8 would
    # be another, broken model there, though its rows stay independent of their company.
    a, b = torch.full((2, 64), 127, dtype=torch.int8), torch.full((64, 8), 127, dtype=torch.int8)
    assert weight_formats.int8_sums_exact() == bool((torch._int_mm(a, b) == 64 * 127 * 127).all())
    monkeypatch.setattr(weight_formats, "int8_sums_exact", lambda: False)
    runner = FastTarget(tiny_target("llama", dtype=torch.bfloat16), "w8a8", calibration_ids=CALIBRATION)
    assert runner.weight_format == "bf16"
    assert runner.weight_note == ("asked for w8a8, running bf16: torch._int_mm's int32 sums are not exact on this CPU "
                                  "(oneDNN without VNNI adds pairs of byte products in 16 bits, which saturate)")


def test_w8a8_needs_a_calibration_text_and_loading_gives_it_one():
    with pytest.raises(ValueError, match="w8a8' needs calibration_ids"):
        FastTarget(tiny_target("llama"), "w8a8")
    text = weight_formats.calibration_text()
    assert len(text.split()) > 300 and "```" in text  # prose and code
    import re

    from dflash_core.evaluation import humaneval_prompts

    names = {match for prompt in humaneval_prompts() for match in re.findall(r"def (\w+)\(", prompt)}
    assert len(names) > 150 and not [name for name in names if f"{name}(" in text]  # never a HumanEval prompt's code


def test_a_kernel_that_is_not_row_invariant_falls_back_to_bf16(monkeypatch):
    monkeypatch.setattr(weight_formats, "row_invariant", lambda *a, **k: False)
    runner = FastTarget(tiny_target("llama", dtype=torch.bfloat16), "int4")
    assert runner.weight_format == "bf16"
    if kernel_available("int4"):
        assert "different numbers depending on how many rows" in runner.weight_note
    assert not any(isinstance(layer.qkv, weight_formats.QuantizedLinear) for layer in runner.layers)


def test_a_missing_kernel_falls_back_to_bf16(monkeypatch):
    monkeypatch.setattr(weight_formats, "kernel_available", lambda fmt: fmt == "bf16")
    runner = FastTarget(tiny_target("llama", dtype=torch.bfloat16), "int8")
    assert runner.weight_format == "bf16" and "no int8 weight-only CPU kernel" in runner.weight_note


def test_row_invariance_probe_catches_a_kernel_that_depends_on_the_row_count():
    weight = torch.randn(16, 32).bfloat16()
    assert row_invariant(lambda x: x @ weight.T, 32)
    assert not row_invariant(lambda x: (x @ weight.T) + x.shape[0], 32)


def test_q4_1_blocks_read_as_gguf_dequantizes_them():
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    rows, cols = 8, 64
    raw = rng.integers(0, 256, size=(rows * cols // 32, 20), dtype=np.uint8)
    raw[:, 0:4] = np.array([0.01, -0.5], dtype=np.float16).view(np.uint8)  # finite d and m
    blocks = weight_formats._unpack_q4_1(raw.reshape(rows, -1), rows, cols)
    expected = gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType.Q4_1)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(expected))


def test_rope_unpermute_is_transformers_reverse_permutation():
    rows, heads = 24, 3
    w = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    dim = rows // heads // 2
    transformers_order = w.reshape(heads, dim, 2, 2).swapaxes(2, 1).reshape(w.shape)  # _reverse_permute_weights
    assert np.array_equal(w[weight_formats._rope_unpermute(rows, heads).numpy()], transformers_order)


def test_int4_from_file_blocks_must_match_the_loaded_weights():
    """Blocks that are not the model's weights (another file, rows in another order) are not
    used: the loaded weights are quantized instead, and the note says so."""
    if not kernel_available("int4"):
        pytest.skip("this PyTorch has no int4 kernel")
    model = tiny_target("llama", dtype=torch.bfloat16)
    runner = FastTarget(model)
    blocks = {}
    for i, layer in enumerate(model.model.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            blocks[f"model.layers.{i}.{name}"] = quantize_q4(layer.get_submodule(name).weight.float())
    layers, note = quantized_layers(runner.layers, "int4", torch.bfloat16, blocks)
    assert layers is not None and "requantized" in note  # the bf16 weights are not these blocks' values
    # Weights that are exactly the blocks' values, to bf16 rounding (as a dequantized GGUF's are): the codes run.
    for i, layer in enumerate(model.model.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            layer.get_submodule(name).weight.data.copy_(blocks[f"model.layers.{i}.{name}"].dequantize())
    layers, note = quantized_layers(FastTarget(model).layers, "int4", torch.bfloat16, blocks)
    assert layers is not None and "GGUF's own Q4_1 blocks" in note


def test_calibration_key_names_a_weight_only_format():
    from dflash_core.calibration import machine_key

    bf16 = FastTarget(tiny_target("llama", dtype=torch.bfloat16))
    assert "weights=" not in machine_key(bf16, "p", 16)  # bf16 keys as before
    runner = FastTarget(tiny_target("llama", dtype=torch.bfloat16), "int4")
    assert ("weights=int4" in machine_key(runner, "p", 16)) == (runner.weight_format == "int4")


def test_int4_for_fp32_rows_computes_in_bf16_and_gives_fp32_back():
    """An fp32 model's int4 layers round their rows to bf16 for the kernel's fast path: the result
    is the bf16 kernel's, widened, and still the same for a row whatever rows share its call."""
    if not kernel_available("int4"):
        pytest.skip("this PyTorch has no int4 kernel")
    torch.manual_seed(1)
    blocks = quantize_q4(torch.randn(96, 128))
    fp32, bf16 = Int4Weight(blocks, torch.float32), Int4Weight(blocks)
    x = torch.randn(37, 128)
    got = fp32(x)
    assert got.dtype == torch.float32 and fp32.scales_zeros.dtype == torch.bfloat16
    assert torch.equal(got, bf16(x.bfloat16()).float())
    if row_invariant(bf16, 128, torch.bfloat16):
        assert row_invariant(fp32, 128, torch.float32)
