"""A Q4_1 model's decoder layers on ``q4_dot`` with the norms and residual adds inside the products
(``q4_layers``, what ``weights = "int4"`` with ``kernels = "aoti"`` runs on an fp32 target): the
eager layers' numbers to rounding, lossless (greedy chains and trees), the probe refusing a wrong
fusion, and the int8 layers where q4_dot cannot run, with the reason in the load note."""

from __future__ import annotations


import pytest
import torch

from dflash_core import aoti_attention, aoti_kernels, dot_attention, int8_dot, q4_dot, q4_layers
from dflash_core.target import FastTarget
from dflash_core.weight_formats import quantize_q8
from dflash_core.testing import (PROMPTS, assert_greedy_lossless, assert_greedy_tree_lossless, assert_same_logits,
                                 assert_tree_nodes_are_their_paths, attention_note, eager_layers_twin,
                                 llama_with_q8_0_head, tiny_target, two_shape_llama)

needs_kernels = pytest.mark.skipif(int8_dot.cannot_run() is not None or not aoti_kernels.available(),
                                   reason=f"q4_dot or AOTInductor cannot run here: {int8_dot.cannot_run()}")
NOTE = "3 of 3 decoder layers on the GGUF's Q4_1 codes with their norms and residual adds inside the products"


def tiny_qwen2() -> torch.nn.Module:
    """A tiny Qwen2: biases on q, k and v (added after the fused QKV product)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.normal_()
    return model.eval()


@pytest.mark.skipif(int8_dot.cannot_run() is not None, reason=f"q4_dot cannot run here: {int8_dot.cannot_run()}")
def test_rotary_and_the_split_are_fastertargets_bit_for_bit_and_silu_times_up_to_bf16_rounding():
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, d, rows = 4, 2, 16, 5
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=generator)
    cos, sin = (torch.randn(rows, heads + kv_heads, d, generator=generator) for _ in range(2))
    q, k, v = q4_dot.rope_split(qkv, cos, sin, heads, kv_heads)
    split = qkv.view(rows, heads + 2 * kv_heads, d)
    qk = split[:, : heads + kv_heads]
    want = qk * cos + qk.roll(d // 2, dims=-1) * sin  # FastTarget.rope
    assert torch.equal(q, want[:, :heads]) and torch.equal(k, want[:, heads:]) and torch.equal(v, split[:, heads + kv_heads:])
    # SiLU(gate) x up in the down product's first pass: PyTorch's SiLU to a few fp32 ulps, so the
    # bf16 rows agree but for a rare rounding tie, and the product to rounding.
    from dflash_core.weight_formats import quantize_q4

    down = q4_dot.Q4DotWeight(quantize_q4(torch.randn(32, 64, generator=generator)))
    gate_up = 4 * torch.randn(rows, 128, generator=generator)
    add = torch.randn(rows, 32, generator=generator)
    gate, up = gate_up.chunk(2, dim=-1)
    eager = down.rows((torch.nn.functional.silu(gate) * up).to(torch.bfloat16), add=add)
    assert (down.glu(gate_up, add=add) - eager).norm() <= 1e-3 * eager.norm()
    lone = torch.cat([down.glu(gate_up[i : i + 1].contiguous(), add=add[i : i + 1].contiguous()) for i in range(rows)])
    assert torch.equal(lone, down.glu(gate_up, add=add))


@needs_kernels
@pytest.mark.slow
def test_fused_layers_are_the_eager_int4_layers_and_lossless(kernel_cache):
    model = two_shape_llama()
    runner = FastTarget(model, weights="int4", kernels="aoti")
    assert runner.weight_format == "int4" and runner.weight_note.startswith("int4, groups of 32")
    head = "int8 through bf16 dot products" if int8_dot.unavailable() is None else "int8 through the int8 GEMM"
    assert runner.kernel_note == f"{NOTE}; {attention_note(runner)}; the LM head {head}"
    assert all(isinstance(layer.before, q4_layers.Q4Before) and isinstance(layer.after, q4_layers.Q4After)
               for layer in runner.layers)
    assert isinstance(runner.attention, (aoti_attention.CompiledAttention, dot_attention.DotAttention))
    assert runner.batch_invariant
    # The eager layers of the same products: the same logits to rounding.
    assert_same_logits(runner, eager_layers_twin(runner), PROMPTS[0], 1e-3)
    assert_greedy_lossless(runner, model, max_new_tokens=90)
    assert_tree_nodes_are_their_paths(runner, PROMPTS[0][:-1], seeds=range(3))
    assert_tree_nodes_are_their_paths(runner, list(range(4, 64)), seeds=range(3))
    assert_greedy_tree_lossless(runner, model, max_new_tokens=60)


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qkv_biases_and_qk_norms_are_applied_too(family, kernel_cache):
    model = tiny_qwen2() if family == "qwen2" else tiny_target("qwen3", layers=3)
    runner = FastTarget(model, weights="int4", kernels="aoti")
    assert runner.kernel_note.startswith(NOTE), runner.kernel_note
    assert_same_logits(runner, eager_layers_twin(runner), PROMPTS[0], 1e-3)
    assert_greedy_lossless(runner, model, max_new_tokens=40)


@needs_kernels
def test_a_fusion_that_changes_the_numbers_is_refused_and_the_eager_layers_run(monkeypatch, kernel_cache):
    model = two_shape_llama()

    def without_residual(self, x, attention):  # a broken fusion: the residual after O forgotten
        x = self.o.floats(attention.contiguous())
        return self.down.glu(self.gate_up.floats(x, self.ln2, self.eps), add=x)

    monkeypatch.setattr(q4_layers.Q4After, "__call__", without_residual)
    runner = FastTarget(model, weights="int4", kernels="aoti")
    assert runner.weight_format == "int4" and not runner.compiled_layers
    assert runner.kernel_note.startswith("the int4 layers eager (layer 0's fused finish is not the eager one); "
                                         "the LM head int8 through")
    assert_greedy_lossless(runner, model, max_new_tokens=20)


def test_layers_that_do_not_run_q4_dot_are_refused_with_the_reason(monkeypatch):
    model = two_shape_llama()
    monkeypatch.setattr(q4_dot, "cannot_run", lambda: "no AVX512-BF16 today")  # PyTorch's int4 kernel runs
    eager = FastTarget(model, weights="int4")
    assert q4_layers.q4_layers(eager) == (None, "layer 0's qkv does not run q4_dot")
    bf16 = FastTarget(two_shape_llama().to(torch.bfloat16), weights="int4")
    assert q4_layers.layers_refusal(bf16) == "only fp32 targets on CPU run them, not torch.bfloat16 on cpu"


def test_where_q4_dot_cannot_run_the_int8_layers_run_and_the_note_says_why(monkeypatch):
    monkeypatch.setattr(int8_dot, "cannot_run", lambda: "this CPU has no AVX512-BF16")
    monkeypatch.setenv("DFLASH_AOTI_WHOLE_LAYERS", "0")  # no kernel builds: the fallback's choice is what is tested
    monkeypatch.setattr(aoti_kernels, "available", lambda: False)
    runner = FastTarget(two_shape_llama(), weights="int4", kernels="aoti")
    missing = "q4_dot cannot run: this CPU has no AVX512-BF16"
    if runner.weight_format == "int8":
        assert runner.weight_note.startswith(f"asked for int4, running int8 ({missing}): int8, one scale per output channel")
    else:  # eager int8 (no compiled kernels here) whose rows depend on their company on this CPU: both reasons
        assert runner.weight_note == (f"asked for int4, running bf16: {missing}; with int8 kernels no padding made a "
                                      "position's logits independent of the size of its pass on this CPU")


@needs_kernels
def test_the_lm_head_runs_the_files_q8_0_blocks_where_they_are_the_loaded_heads_weights(kernel_cache):
    model, blocks = llama_with_q8_0_head()
    runner = FastTarget(model, weights="int4", kernels="aoti", q4_blocks={"lm_head": blocks})
    assert runner.kernel_note.endswith("; the LM head the GGUF's Q8_0 blocks through bf16 dot products")
    assert isinstance(runner._lm_head.kernel, int8_dot.Q8DotWeight)
    assert_greedy_lossless(runner, model, max_new_tokens=40)
    # Blocks of another matrix: the int8 head, and the note says why.
    other = quantize_q8(torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(3)))
    runner = FastTarget(model, weights="int4", kernels="aoti", q4_blocks={"lm_head": other})
    head = "int8 through bf16 dot products" if int8_dot.unavailable() is None else "int8 through the int8 GEMM"
    assert runner.kernel_note.endswith(f"{head} (not the GGUF's Q8_0 blocks: the GGUF's Q8_0 output blocks are not "
                                       "the loaded head's weights)")
