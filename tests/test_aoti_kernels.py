"""The target's matrices through inductor's C++ GEMM built ahead of time (``kernels = "aoti"``
in models.toml), one matrix at a time: built once per machine and shape, used only where a probe
finds it exact per row here, lossless when used (greedy DFlash == greedy AR), a clear fallback to
oneDNN otherwise. Whole compiled layers (tried first) are test_aoti_layers.py's; these tests turn
them off (``no_compiled_layers``) to test the matrices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_core import aoti_kernels, aoti_layers, int8_dot
from dflash_core.errors import RegistryError
from dflash_core.kernels import Linear
from dflash_core.registry import KERNELS, parse_registry
from dflash_core.target import FastTarget, make_runner
from dflash_core.testing import PROMPTS, assert_greedy_lossless, assert_same_logits, tiny_drafter, tiny_target, two_shape_llama
from dflash_core.weight_formats import Int8Weight, QuantizedLinear

PAIR = {"target": {"hub": "x/y"}, "drafter": {"random": True}}
OFF = "turned off for the matrices' tests"


@pytest.fixture(autouse=True)
def no_compiled_layers(monkeypatch):
    monkeypatch.setattr(aoti_layers, "compiled_layers", lambda target: (None, OFF))


def test_registry_reads_kernels_and_refuses_an_unknown_one():
    assert KERNELS == aoti_kernels.KERNELS
    registry = parse_registry({"pairs": {"a": {**PAIR, "kernels": "aoti"}, "b": PAIR}}, Path("models.toml"))
    assert registry.pairs["a"].kernels == "aoti"
    assert registry.pairs["b"].kernels == "onednn"  # the default
    with pytest.raises(RegistryError, match=r"kernels = 'triton'; allowed: onednn, aoti"):
        parse_registry({"pairs": {"a": {**PAIR, "kernels": "triton"}}}, Path("models.toml"))


def test_runner_refuses_unknown_kernels():
    model = tiny_target("llama")
    with pytest.raises(ValueError, match="kernels = 'triton'"):
        FastTarget(model, kernels="triton")
    with pytest.raises(ValueError, match="kernels = 'triton'"):
        make_runner(model, kernels="triton")


def test_blocked_layout_puts_output_features_innermost():
    weight = torch.arange(48 * 5, dtype=torch.float32).reshape(48, 5)
    packed = aoti_kernels.blocked(weight, 24)
    assert packed.shape == (2, 5, 24)
    assert all(packed[i, k, j] == weight[i * 24 + j, k] for i in range(2) for k in range(5) for j in range(24))


def test_vnni_layout_interleaves_runs_of_the_inner_dimension_within_a_block():
    """AMX reads its weight tiles in VNNI layout: within a block, K in runs of ``vnni`` rows, each
    output feature's run contiguous (what inductor's pack_vnni_weight produces)."""
    weight = torch.arange(32 * 8, dtype=torch.float32).reshape(32, 8)
    for vnni in (2, 4):
        packed = aoti_kernels.blocked(weight, 16, vnni)
        assert packed.shape == (2, 8, 16)
        flat = packed.reshape(2, 8 // vnni, 16, vnni)
        assert all(flat[i, r, j, t] == weight[i * 16 + j, r * vnni + t]
                   for i in range(2) for r in range(8 // vnni) for j in range(16) for t in range(vnni))
    assert torch.equal(aoti_kernels.blocked(weight, 16, 1), aoti_kernels.blocked(weight, 16))
    assert (16, 4) in aoti_kernels.layouts(32, 8) and (16, 4) not in aoti_kernels.layouts(32, 6)


def test_a_failed_build_falls_back_to_onednn_and_says_why(monkeypatch, kernel_cache):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(aoti_kernels, "kernel_library", broken)
    runner = FastTarget(tiny_target("llama"), kernels="aoti")
    if not aoti_kernels.available():
        assert runner.kernels == "onednn" and "needs a CPU target and a C++ compiler" in runner.kernel_note
        return
    assert runner.kernels == "onednn"
    assert runner.kernel_note.startswith("asked for aoti, running oneDNN: building or loading the kernel failed")
    assert "no compiler today" in runner.kernel_note
    assert all(isinstance(layer.qkv, Linear) for layer in runner.layers)


def test_bf16_and_quantized_targets_stay_on_their_kernels(kernel_cache):
    runner = FastTarget(tiny_target("llama", dtype=torch.bfloat16), kernels="aoti")
    assert runner.kernels == "onednn" and "asked for aoti, running oneDNN" in runner.kernel_note


@pytest.mark.slow
def test_the_probe_decides_and_greedy_dflash_equals_ar(kernel_cache):
    model = two_shape_llama()
    runner = FastTarget(model, kernels="aoti")
    if not aoti_kernels.available():
        pytest.skip("no C++ compiler or AOTInductor here")
    built = sorted(p.name for p in kernel_cache.rglob("*.so"))
    assert built == ["linear-128x64-float32.so", "linear-64x64-float32.so"], built
    if runner.kernels != "aoti":  # a CPU where the kernel's rows depend on their company: oneDNN, and why
        assert runner.kernel_note.startswith("asked for aoti, running oneDNN")
        return
    assert runner.kernel_note == f"inductor C++ GEMM (AOTInductor) for 13 of 13 matrices; layers not compiled whole: {OFF}"
    assert all(isinstance(m, aoti_kernels.AotiLinear) for layer in runner.layers
               for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert runner.batch_invariant
    # The same model on oneDNN: the same products, to rounding.
    assert_same_logits(runner, FastTarget(model), PROMPTS[0], 1e-4)
    assert_greedy_lossless(runner, model)
    # A second target loads the built kernels (nothing rebuilt) ...
    stamps = {p: p.stat().st_mtime_ns for p in kernel_cache.rglob("*.so")}
    again = FastTarget(model, kernels="aoti")
    assert again.kernels == "aoti" and {p: p.stat().st_mtime_ns for p in kernel_cache.rglob("*.so")} == stamps
    # ... and a kernel given the wrong layout is caught by the probe, not used.
    library, meta = aoti_kernels.kernel_library(128, 64, "float32")
    wrong = aoti_kernels.AotiLinear(model.lm_head.weight.detach(), library, {**meta, "block": 16 if meta["block"] != 16 else 32})
    assert aoti_kernels.exact_here(wrong) == "its results are not F.linear's"


@pytest.mark.slow
def test_int8_weights_run_the_int8_gemm_losslessly(kernel_cache):
    model = two_shape_llama()
    runner = FastTarget(model, weights="int8", kernels="aoti")
    if not aoti_kernels.available():
        pytest.skip("no C++ compiler or AOTInductor here")
    built = {p.name for p in kernel_cache.rglob("*.so")}
    assert {"linear-128x64-int8.so", "linear-64x64-int8.so"} <= built, built
    assert runner.weight_format == "int8"
    if runner.kernels != "aoti":  # a CPU where the kernel's rows depend on their company: eager int8, and why
        assert runner.kernel_note.startswith("asked for aoti, running oneDNN")
        return
    assert runner.kernel_note == ("inductor C++ GEMM (AOTInductor) for 13 of 13 matrices "
                                  f"(int8 weight-only, their rows in bf16); layers not compiled whole: {OFF}")
    kernels = [m.kernel for layer in runner.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(k, aoti_kernels.AotiInt8Weight) for k in kernels)
    # the LM head too: through bf16 dot products where int8_dot runs (AVX512-BF16 without AMX)
    head = aoti_kernels.AotiInt8Weight if int8_dot.unavailable() else int8_dot.Int8DotWeight
    assert isinstance(runner._lm_head.kernel, head)
    assert torch.equal(runner.lm_head_weight, model.lm_head.weight)  # the drafter's stays full precision
    assert runner.batch_invariant
    # The full-precision model, to int8's rounding of the weights.
    full = FastTarget(model)
    assert_same_logits(runner, full, PROMPTS[0], 3e-2)
    assert_greedy_lossless(runner, model)
    # A kernel given the wrong layout is caught by the probe, not used.
    library, meta = aoti_kernels.kernel_library(128, 64, "int8")
    reference = Int8Weight(full.layers[0].qkv.weight, torch.float32)  # the eager kernel of the same codes
    wrong = aoti_kernels.AotiInt8Weight(reference.q, reference.scales, library,
                                        {**meta, "block": 16 if meta["block"] != 16 else 32})
    assert aoti_kernels.exact_here(wrong, reference) == "its results are not the eager int8 kernel's"
    assert aoti_kernels.exact_here(runner.layers[0].qkv.kernel, reference) is None


def test_int4_weights_run_the_q4_layers_or_the_int8_ones_saying_why(kernel_cache):
    runner = FastTarget(two_shape_llama(), weights="int4", kernels="aoti")
    why = int8_dot.cannot_run()
    if why is None:  # q4_dot runs: no C++ GEMM over the int4 matrices, the fused q4 layers
        assert runner.weight_format == "int4" and runner.kernels == "aoti"
        assert runner.kernel_note.startswith("3 of 3 decoder layers on the GGUF's Q4_1 codes")
    else:  # as on an AVX2 CPU: the int8 layers (or bf16 where their rows depend on their company), both reasons kept
        assert runner.weight_note.startswith("asked for int4, running ")
        assert f"q4_dot cannot run: {why}" in runner.weight_note


@pytest.mark.slow
@pytest.mark.parametrize("int8", [False, True])
def test_the_drafter_runs_the_cpp_gemm_and_drafts_as_before(int8, kernel_cache):
    model = two_shape_llama()
    drafter = tiny_drafter(model, layers=1)
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(1, 16, 64, generator=generator)
    context = torch.randn(1, 10, drafter.fc.in_features, generator=generator)
    with torch.inference_mode():
        before = drafter(noise, torch.arange(10, 26), context, torch.arange(10))
    note = aoti_kernels.drafter_kernels(drafter, int8)
    matrices = sum(isinstance(m, torch.nn.Linear) for m in drafter.modules())
    if int8 and int8_dot.unavailable() is None:  # bf16 dot products for int8 where they run
        assert note == f"bf16 dot products (int8 weight-only) for {matrices} of {matrices} matrices and the draft head"
    else:
        kind = "int8 weight-only, rows in bf16" if int8 else "fp32"
        assert note == f"inductor C++ GEMM ({kind}) for {matrices} of {matrices} matrices and the draft head"
    tolerance = 5e-2 if int8 else 1e-4  # drafts only: int8's rounding may change acceptance, never the output
    with torch.inference_mode():
        after = drafter(noise, torch.arange(10, 26), context, torch.arange(10))
        assert (after - before).norm() <= tolerance * before.norm()
        drafter.set_draft_vocab(torch.arange(0, 128, 2))
        logits, vocab = drafter.draft_logits(after[0], model.lm_head.weight)
        want = after[0] @ model.lm_head.weight[vocab].T
    assert isinstance(drafter._head_cache[1], aoti_kernels.AotiLinear if not int8 else QuantizedLinear)
    assert (logits - want).norm() <= tolerance * want.norm()


def test_processes_starting_together_wait_for_one_build(tmp_path):
    # The suite's workers, or a studio and a CLI started together, build a missing kernel once:
    # the second waits for the first's build and loads it.
    import subprocess
    import sys

    script = """
import sys, time
from pathlib import Path
from dflash_core.aoti_kernels import cached
folder = Path(sys.argv[1])
def build(path):
    with open(folder / "builds", "a") as log:
        log.write("x")
    time.sleep(1.5)
    path.write_bytes(b"kernel")
    path.with_suffix(".json").write_text('{"built": true}')
    return {"built": True}
print(cached(folder / "kernel.bin", build)[1])
"""
    processes = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
                 for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in processes]
    assert all(p.returncode == 0 for p in processes)
    assert outputs == ["{'built': True}"] * 2
    assert (tmp_path / "builds").read_text() == "x"
