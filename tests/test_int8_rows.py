"""A GGUF's matrices with int8 rows, as llama.cpp multiplies them (``int8_rows``): the layouts, the
products (llama.cpp's arithmetic on the file's weights to fp32 rounding), every row's numbers
independent of the rows beside it, the w4a8 target lossless with its fused layers and Q8_0 head,
the drafter beside it on the same kernels, the builds for AVX-512 and AVX2 (the same numbers), and
the fallbacks where the CPU has no VNNI."""

from __future__ import annotations

import copy

import pytest
import torch

from dflash_core import aoti_kernels, int8_dot, int8_rows, q4_dot, q4_layers, q8_drafter
from dflash_core.drafter import RMSNorm, apply_rope
from dflash_core.speculative import GenerationConfig, collect, stream
from dflash_core.target import FastTarget
from dflash_core.testing import (PROMPTS, assert_greedy_lossless, assert_greedy_tree_lossless, assert_same_logits,
                                 assert_tree_nodes_are_their_paths, attention_note, chi_square_passes,
                                 eager_layers_twin, llama_with_q8_0_head, three_token_distribution, tiny_drafter,
                                 tiny_target, two_shape_llama)
from dflash_core.weight_formats import Q4Blocks, Q8Blocks, quantize_q4, quantize_q8

needs_kernels = pytest.mark.skipif(int8_rows.refusal() is not None, reason=f"int8_rows cannot run here: {int8_rows.refusal()}")
needs_aoti = pytest.mark.skipif(int8_rows.refusal() is not None or not aoti_kernels.available(),
                                reason=f"int8_rows or AOTInductor cannot run here: {int8_rows.refusal()}")


def int8_rows_reference(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """llama.cpp's arithmetic in float64: each row's group of 32 rounded to int8 with its own scale
    (max |x| / 127, to nearest), times the dequantized weights."""
    m, k = x.shape
    groups = x.double().view(m, k // 32, 32)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    codes = torch.round(groups / torch.where(scale > 0, scale, 1.0))
    return (codes * scale).view(m, k) @ weights.double().T


def test_the_q4_layout_is_nibble_pairs_four_inputs_apart_then_the_files_fp16_scales_and_minimums():
    q = Q4Blocks(torch.arange(16 * 64).reshape(16, 64) % 16, torch.full((16, 2), 0.5), torch.full((16, 2), -2.0))
    q.d[3, 1], q.m[5, 1] = 0.25, -1.5
    group = int8_rows.pack_q4(q)[0, 1]  # inputs 32..63
    assert group.shape == (320,)
    for t in range(4):
        run = group[64 * t : 64 * (t + 1)]
        for j in range(16):
            for i in range(4):
                byte = int(run[4 * j + i])
                assert (byte & 15, byte >> 4) == (int(q.q[j, 32 + 8 * t + i]), int(q.q[j, 32 + 8 * t + 4 + i]))
    assert torch.equal(group[256:288].view(torch.float16).float(), q.d[:, 1])
    assert torch.equal(group[288:].view(torch.float16).float(), q.m[:, 1])


def test_the_q8_layout_is_runs_of_four_inputs_then_fp32_scales_and_128_times_the_codes_sums():
    generator = torch.Generator().manual_seed(0)
    q = Q8Blocks(torch.randint(-127, 128, (32, 64), generator=generator, dtype=torch.int8), torch.rand(32, 2) + 0.5)
    group = int8_rows.pack_q8(q)[1, 1]  # outputs 16..31, inputs 32..63
    assert group.shape == (640,)
    codes = group[:512].view(torch.int8).view(8, 16, 4)  # run p, output j, input 4 p + i
    assert torch.equal(codes.permute(1, 0, 2).reshape(16, 32), q.q[16:, 32:])
    assert torch.equal(group[512:576].view(torch.float32), q.d[16:, 1])
    assert torch.equal(group[576:].view(torch.int32), 128 * q.q[16:, 32:].to(torch.int32).sum(1))


def test_quantize_q8_rounds_as_llama_cpp_with_fp16_scales():
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    blocks = quantize_q8(weight)
    assert blocks.q.dtype == torch.int8 and int(blocks.q.abs().max()) == 127
    assert torch.equal(blocks.d.half().float(), blocks.d)
    assert (blocks.dequantize() - weight).abs().max() <= blocks.d.max() / 2 + 1e-6


@needs_kernels
@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("shape", [(64, 64), (576, 1536), (960, 576)])
def test_products_are_llama_cpps_arithmetic_to_fp32_rounding_and_rows_never_depend_on_their_company(fmt, shape):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(*shape, generator=generator) / shape[1] ** 0.5
    blocks = quantize_q4(weight) if fmt == "q4" else quantize_q8(weight)
    kernel = int8_rows.Q4Q8DotWeight(blocks) if fmt == "q4" else int8_rows.Q8Q8DotWeight(blocks)
    rows = torch.randn(40, shape[1], generator=generator)
    rows[3, :32] = 0.0  # a group of zeros (scale 0)
    got = kernel(rows)
    want = int8_rows_reference(rows, blocks.dequantize())
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
    # int8 rows round more than bf16 ones, less than the tolerance the probe allows them
    exact = rows.double() @ blocks.dequantize().double().T
    assert 1e-3 < ((got.double() - exact).norm() / exact.norm()).item() < int8_rows.Int8RowsWeight.tolerance
    for count in range(1, 41):  # across the kernel's passes of 16 rows and the tile widths of few rows
        assert torch.equal(kernel(rows[:count]), got[:count]), count
    # the fused calls: the RMS norm inside, SiLU x up inside, a residual added
    norm, add = torch.rand(shape[1], generator=generator) + 0.5, torch.randn(40, shape[0], generator=generator)
    normed = norm * (rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.allclose(kernel.floats(rows, norm, 1e-5, add=add), kernel(normed) + add, rtol=1e-4, atol=1e-4)
    gate_up = torch.randn(40, 2 * shape[1], generator=generator)
    gate, up = gate_up.chunk(2, dim=-1)
    silu = kernel(torch.nn.functional.silu(gate) * up)
    assert (kernel.glu(gate_up, add=add) - add - silu).norm() <= 1e-2 * silu.norm()


def test_where_the_cpu_has_no_vnni_the_kernels_refuse_and_say_why(monkeypatch):
    monkeypatch.setattr(int8_rows, "cannot_build", lambda: None)
    monkeypatch.setattr(int8_rows, "build_isa", lambda: "avx512")
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    assert int8_rows.refusal() == "this CPU has no AVX512-VNNI"
    assert int8_rows.q4q8_dot_weight(quantize_q4(torch.randn(16, 32))) == (None, "this CPU has no AVX512-VNNI")


def test_the_kernels_build_for_avx512_or_avx2_by_what_pytorch_runs_the_cpu_as(monkeypatch):
    monkeypatch.setattr(int8_dot.shutil, "which", lambda name: f"/usr/bin/{name}")
    for capability, bf16, isa in (("AVX512", True, "avx512"), ("AVX512", False, "avx2"), ("AVX2", False, "avx2"),
                                  ("DEFAULT", False, None)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.setattr(int8_dot, "_has_avx512_bf16", lambda b=bf16: b)
        monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: True)
        assert int8_dot.build_isa() == isa, capability
        if isa is None:
            assert int8_rows.refusal() == "PyTorch runs this CPU as DEFAULT, not AVX2 or AVX512"
            continue
        assert int8_rows.refusal() is None, capability  # w4a8 runs on either build
        assert ("-DDFLASH_AVX2" in int8_dot.flags()) == (isa == "avx2")
        assert (int8_dot.cannot_run() is None) == (isa == "avx512")  # the bf16 dot products need AVX512-BF16
        assert int8_rows.instructions() == ("AVX2" if isa == "avx2" else "AVX512-VNNI")
    assert int8_dot.build_digest(q4_dot.SOURCE, "avx2") != int8_dot.build_digest(q4_dot.SOURCE, "avx512")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(int8_dot.shutil, "which", lambda name: None)
    assert int8_dot.build_isa() is None and int8_rows.refusal() == "no C++ compiler (CXX or g++)"


@needs_kernels
@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_the_avx2_build_computes_the_avx512_builds_numbers(fmt, kernel_cache):
    # The AVX2 tiles sum the same exact integers and take the same float steps after them; an
    # AVX-512 CPU runs both builds (elsewhere the products test above checks the AVX2 build alone).
    if int8_dot.build_isa() != "avx512":
        pytest.skip(f"only a CPU that runs the AVX-512 build runs both (this one: {int8_dot.build_isa()})")
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(960, 576, generator=generator) / 24
    blocks = quantize_q4(weight) if fmt == "q4" else quantize_q8(weight)
    kernel = int8_rows.Q4Q8DotWeight(blocks) if fmt == "q4" else int8_rows.Q8Q8DotWeight(blocks)
    rows, gate_up = torch.randn(17, 576, generator=generator), torch.randn(17, 1152, generator=generator)
    norm, add = torch.rand(576, generator=generator) + 0.5, torch.randn(17, 960, generator=generator)
    avx2 = copy.copy(kernel)
    avx2._floats, avx2._glu = q4_dot.library("avx2").int8_rows_floats, q4_dot.library("avx2").int8_rows_glu
    for count in (1, 2, 5, 16, 17):
        assert torch.equal(avx2.floats(rows[:count], norm, 1e-5, add=add[:count]),
                           kernel.floats(rows[:count], norm, 1e-5, add=add[:count])), count
        assert torch.equal(avx2.glu(gate_up[:count]), kernel.glu(gate_up[:count])), count


@needs_kernels
def test_rope_split_norms_each_head_and_takes_one_table_for_all_heads_as_the_drafter_does():
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, d, rows = 4, 2, 16, 5
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=generator)
    cos, sin = (torch.randn(rows, d, generator=generator) for _ in range(2))
    q_norm, k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5, generator=generator)
        k_norm.weight.uniform_(0.5, 1.5, generator=generator)
    q, k, v = q4_dot.rope_split(qkv, cos, sin, heads, kv_heads, q_norm.weight.detach(), k_norm.weight.detach(), 1e-6,
                                rotate_half=True)
    split = qkv.view(rows, heads + 2 * kv_heads, d).transpose(0, 1)[None]  # (1, heads, T, D) as the drafter has it
    with torch.no_grad():
        want_q = apply_rope(q_norm(split[:, :heads]), cos[None], sin[None])
        want_k = apply_rope(k_norm(split[:, heads : heads + kv_heads]), cos[None], sin[None])
    assert torch.allclose(q, want_q[0].transpose(0, 1), atol=1e-5) and torch.allclose(k, want_k[0].transpose(0, 1), atol=1e-5)
    assert torch.equal(v, split[0, heads + kv_heads :].transpose(0, 1))


@needs_aoti
@pytest.mark.slow
def test_w4a8_layers_and_q8_0_head_are_the_eager_ones_and_lossless(kernel_cache):
    model, head_blocks = llama_with_q8_0_head()
    runner = FastTarget(model, weights="w4a8", kernels="aoti", q4_blocks={"lm_head": head_blocks})
    assert runner.weight_format == "w4a8", runner.weight_note
    assert runner.weight_note.startswith("w4a8: Q4_1 groups of 32 (requantized from the loaded weights), the rows int8")
    assert runner.kernel_note == ("3 of 3 decoder layers on the GGUF's Q4_1 codes with their norms and residual adds "
                                  f"inside the products; {attention_note(runner)}; the LM head the GGUF's Q8_0 blocks "
                                  f"with int8 rows ({int8_rows.instructions()}); every layer of a pass in one C++ call")
    assert isinstance(runner._fused_pass, q4_layers.FusedPass)
    assert all(isinstance(layer.after.down, int8_rows.Q4Q8DotWeight) for layer in runner.layers)
    assert isinstance(runner._lm_head.kernel, int8_rows.Q8Q8DotWeight) and runner.batch_invariant
    assert runner.min_rows == 1  # the tiles compute a lone row as inside a block: an AR step pads no row
    assert_same_logits(runner, eager_layers_twin(runner), PROMPTS[0], 1e-3)
    assert_greedy_lossless(runner, model, max_new_tokens=90)
    fused_tree, trees = runner._fused_pass.tree, []
    runner._fused_pass.tree = lambda *args: trees.append(1) or fused_tree(*args)
    assert_greedy_tree_lossless(runner, model, max_new_tokens=60)  # trees in one call too, path by path
    assert_tree_nodes_are_their_paths(runner, PROMPTS[0][:-1], seeds=range(3))
    assert len(trees) > 10
    # A one-call pass whose numbers are not the layers' is refused, and the layers run one by one.
    real_call = q4_layers.FusedPass.__call__

    def off_by_rounding(self, *args):
        return real_call(self, *args) * (1 + 1e-6)

    q4_layers.FusedPass.__call__ = off_by_rounding
    try:
        assert q4_layers.fused_pass(runner) == (None, "layer by layer (the one-call pass's numbers were not the layers')")
    finally:
        q4_layers.FusedPass.__call__ = real_call


@needs_aoti
@pytest.mark.slow
def test_w4a8_applies_qk_norms_eagerly_and_stays_lossless(kernel_cache):
    model = tiny_target("qwen3", layers=3)
    runner = FastTarget(model, weights="w4a8", kernels="aoti")
    assert runner.weight_format == "w4a8" and runner.compiled_layers, runner.kernel_note
    assert_same_logits(runner, eager_layers_twin(runner), PROMPTS[0], 1e-3)
    assert_greedy_lossless(runner, model, max_new_tokens=40)


@needs_kernels
def test_sampling_with_a_w4a8_target_follows_that_targets_own_distribution():
    """The int8 rows round the target: what sampling must follow is the rounded target's own
    distribution (its passes token by token), which DFlash's acceptance keeps exactly."""
    vocab, temperature, prompt = 5, 1.3, [1, 3, 0, 2]
    model = tiny_target("llama", vocab=vocab, layers=2, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)  # soften: every outcome has some mass
    runner = FastTarget(model, weights="w4a8")
    assert runner.weight_format == "w4a8" and runner.batch_invariant, runner.weight_note

    def next_logits(ids: list[int]) -> torch.Tensor:
        runner.reset(64)
        return runner.forward(torch.tensor(ids), None, last_only=True).logits[-1]

    expected = three_token_distribution(next_logits, prompt, temperature, vocab)
    drafter = tiny_drafter(model, layers=1, block_size=4, mask_token_id=4, seed=2)
    n, observed, accepted = 2000, {}, 0
    for seed in range(n):
        config = GenerationConfig(max_new_tokens=3, block_size=4, temperature=temperature, seed=seed)
        out = collect(stream(runner, drafter, prompt, config.validated(4)))
        observed[tuple(out.token_ids)] = observed.get(tuple(out.token_ids), 0) + 1
        accepted += sum(c.num_accepted for c in out.cycles)
    ok, stat, critical = chi_square_passes(observed, expected, n)
    assert ok, (stat, critical)
    assert accepted > 0.1 * n  # drafts were really accepted, not only bonus tokens


def test_where_int8_rows_cannot_run_the_int4_layers_run_and_the_note_says_why(monkeypatch):
    monkeypatch.setattr(int8_rows, "refusal", lambda: "this CPU has no AVX512-VNNI")
    monkeypatch.setenv("DFLASH_AOTI_WHOLE_LAYERS", "0")
    monkeypatch.setattr(aoti_kernels, "available", lambda: False)
    runner = FastTarget(two_shape_llama(), weights="w4a8")  # eager kernels: no builds
    assert runner.weight_note.startswith("asked for w4a8, running "), runner.weight_note
    assert "w4a8's kernel cannot run: this CPU has no AVX512-VNNI" in runner.weight_note  # int4's kernels, or bf16 where their rows move
    assert runner.weight_format in ("int4", "bf16")


@needs_kernels
def test_the_drafter_beside_a_w4a8_target_runs_q8_0_with_int8_rows_and_keeps_the_output():
    model = two_shape_llama()
    runner = FastTarget(model, weights="w4a8")
    drafter = tiny_drafter(model, layers=2)
    eager = copy.deepcopy(drafter)
    note = q8_drafter.int8_rows_drafter(drafter)
    assert note == (f"Q8_0 matrices with int8 rows ({int8_rows.instructions()}) for 15 matrices and the draft head; the whole decode pass "
                    "in one C++ call")
    assert all(isinstance(layer.compiled, q8_drafter.Q8DrafterLayer) for layer in drafter.layers)
    assert isinstance(drafter.fused_pass, q8_drafter.FusedDrafterPass)
    agree = total = 0
    for prompt in PROMPTS:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=40, block_size=1).validated(16)))
        cfg = GenerationConfig(max_new_tokens=40, block_size=8).validated(16)
        got, want = (collect(stream(runner, d, prompt, cfg)) for d in (drafter, eager))
        assert got.token_ids == ar.token_ids  # drafts may move with the rounding, the output may not
        agree += sum(a == b for a, b in zip(got.acceptance_lengths, want.acceptance_lengths))
        total += len(want.acceptance_lengths)
    assert agree >= 0.8 * total  # mostly the same drafts as the fp32 drafter's
    # A layer whose weights were put together wrongly is refused by the probe.
    layer = tiny_drafter(model).layers[0]
    wrong = q8_drafter.Q8DrafterLayer(layer)
    wrong.gate_up = q8_drafter.q8_matrix(torch.cat((layer.mlp.up_proj.weight, layer.mlp.gate_proj.weight)))
    assert not q8_drafter.probe_layer(layer, wrong, "w8a8", q8_drafter.W8A8_TOLERANCE)
    assert q8_drafter.probe_layer(layer, q8_drafter.Q8DrafterLayer(layer), "w8a8", q8_drafter.W8A8_TOLERANCE)


def drafter_calls(drafter, cycles: list[tuple[int, int]], seed: int = 0, fused_at=lambda i: True) -> list:
    """A decode run's drafter calls on random rows and features, one cache: per cycle (new context
    rows, block size), the block after the context; ``fused_at(i)``: whether call i may be fused."""
    generator = torch.Generator().manual_seed(seed)
    hidden, width = drafter.fc.out_features, drafter.fc.in_features
    fused, cache, seen, out = drafter.fused_pass, drafter.new_cache(), 0, []
    with torch.inference_mode():
        for i, (context_rows, size) in enumerate(cycles):
            x = torch.randn(1, size, hidden, generator=generator)
            features = torch.randn(1, context_rows, width, generator=generator)
            drafter.fused_pass = fused if fused_at(i) else None
            out.append(drafter(x, torch.arange(seen + context_rows - 1, seen + context_rows - 1 + size), features,
                               torch.arange(seen, seen + context_rows), cache=cache))
            seen += context_rows
    drafter.fused_pass = fused
    return out


@needs_kernels
def test_the_drafters_one_call_pass_is_its_layers_passes_whatever_came_before_it():
    """The fused pass gives the layer-by-layer pass's hidden states to rounding on every cycle of a
    run, its buffers growing past their first size (300 positions), and when the cycles before it
    ran layer by layer, or it ran before them: each way sees the same cache."""
    drafter = tiny_drafter(two_shape_llama(), layers=2)
    assert "one C++ call" in q8_drafter.int8_rows_drafter(drafter)
    cycles = [(40, 8)] + [(n % 5 + 1, 8) for n in range(70)] + [(3, 4)]
    layer_by_layer = drafter_calls(drafter, cycles, fused_at=lambda i: False)
    for fused_at in (lambda i: True, lambda i: i % 3 != 1, lambda i: i > 60):
        errors = [float((got - want).norm() / want.norm())
                  for got, want in zip(drafter_calls(drafter, cycles, fused_at=fused_at), layer_by_layer)]
        assert max(errors) <= q8_drafter.FUSED_TOLERANCE
        assert sum(e < 1e-5 for e in errors) >= 0.9 * len(errors)  # mostly only the sums' own rounding
    # Changed weights: the pass steps aside (the layers then step aside too, for the eager ones).
    fused = drafter.fused_pass
    x = torch.randn(1, 8, drafter.fc.out_features)
    features, positions = torch.randn(1, 3, drafter.fc.in_features), torch.arange(3)[None]
    assert fused.handles(x, features, positions, None, drafter.new_cache())
    assert not fused.handles(x, features, None, None, drafter.new_cache())  # no positions: the layers run
    with torch.no_grad():
        drafter.norm.weight.add_(1.0)
    assert not fused.handles(x, features, positions, None, drafter.new_cache())


@needs_kernels
def test_the_probe_refuses_a_one_call_pass_whose_numbers_are_not_the_layers(monkeypatch):
    drafter = tiny_drafter(two_shape_llama(), layers=2)
    q8_drafter.int8_rows_drafter(drafter)
    assert q8_drafter.fused_drafter_pass(drafter) is not None
    original = q8_drafter.FusedDrafterPass.__init__

    def swapped_norms(self, drafter):  # the final norm's weights where the context's belong
        original(self, drafter)
        self.hidden_norm, self.norm = self.norm, self.hidden_norm
    monkeypatch.setattr(q8_drafter.FusedDrafterPass, "__init__", swapped_norms)
    with torch.no_grad():
        drafter.norm.weight.mul_(torch.linspace(0.2, 3.0, drafter.norm.weight.numel()))
    assert q8_drafter.fused_drafter_pass(drafter) is None


def test_the_drafter_stays_as_loaded_where_int8_rows_cannot_run(monkeypatch):
    bf16 = tiny_drafter(two_shape_llama()).to(torch.bfloat16)
    if int8_rows.refusal() is None:
        assert q8_drafter.int8_rows_drafter(bf16) == "as loaded (int8 rows: it runs fp32 drafters on CPU)"
    monkeypatch.setattr(q8_drafter, "refusal", lambda: "this CPU has no AVX512-VNNI")
    drafter = tiny_drafter(two_shape_llama())
    assert q8_drafter.int8_rows_drafter(drafter) == "as loaded (int8 rows: this CPU has no AVX512-VNNI)"
    assert all(layer.compiled is None for layer in drafter.layers)
