"""The drafter beside a w4a8 target on the same kernels: every matrix Q8_0 with int8 rows
(``int8_rows.Q8Q8DotWeight``), each layer's decode pass a handful of calls, on CPU.

A drafter pass is paid every cycle. Beside the int4 and int8 targets its layers run inductor's
int8 weight-only GEMM, which on an AVX512-BF16 CPU without AMX widens rows and codes to fp32: a
16-row pass of a three-layer drafter then cost 6.6-7.0 ms of a 33 ms cycle beside the int4 target
on the EPYC measured (``make benchmarks-bars``; 4.1-4.5 ms this way: docs/BENCHMARKS-AMD.md). Here its matrices
are quantized to Q8_0 (groups of 32, ``weight_formats.quantize_q8``) and each layer's decode pass
is: the block's rows through QKV with the input norm inside the call, the new context's rows
(not normed, as in z-lab's layer) through the same matrix, the per-head norms, rotary and the
split in one call (``q4_dot.rope_split``), attention over the drafter's cache, then O with the
residual, gate/up with the post-attention norm, SiLU x up inside down's call with the residual.

Drafts are proposals, which the target verifies: rounding here moves acceptance at most, never
the output. A layer runs this way only where a probe finds it the eager layer to rounding, and
only for what a decode asks of it (``aoti_drafter.CompiledDrafterLayer.handles``); every other call
runs the eager layer, as does any call after the drafter's weights have changed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .aoti_drafter import W8A8_TOLERANCE, CompiledDrafterLayer, probe_layer
from .int8_rows import Q8Q8DotWeight, refusal
from .kernels import PackedModuleForward
from .q4_dot import rope_split
from .weight_formats import QuantizedLinear, quantize_q8


def q8_matrix(weight: torch.Tensor) -> Q8Q8DotWeight:
    return Q8Q8DotWeight(quantize_q8(weight.detach().float()))


class Q8DrafterLayer(CompiledDrafterLayer):
    """One drafter layer's decode pass on ``int8_rows``' kernels (``CompiledDrafterLayer``'s calls)."""

    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = q8_matrix(torch.cat((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)))
        self.o = q8_matrix(attn.o_proj.weight)
        self.gate_up = q8_matrix(torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)))
        self.down = q8_matrix(mlp.down_proj.weight)

        def norm(module) -> tuple[torch.Tensor, float]:
            return module.weight.detach().float().contiguous(), float(module.eps)

        (self.ln1, self.eps1), (self.ln2, self.eps2) = norm(layer.input_layernorm), norm(layer.post_attention_layernorm)
        (self.q_norm, self.qk_eps), (self.k_norm, _) = norm(attn.q_norm), norm(attn.k_norm)
        self.heads = (attn.num_heads, attn.num_kv_heads)
        self.layer = layer
        self._params = list(layer.parameters())
        self._source = self._state()

    def __call__(self, x, context, rope_block, rope_context, cache, layer_index: int, context_positions) -> torch.Tensor:
        heads, kv_heads = self.heads
        rows = x[0].float().contiguous()
        split = (heads, kv_heads, self.q_norm, self.k_norm, self.qk_eps, True)  # the drafter's rotate_half
        (cos, sin), (context_cos, context_sin) = ((t[0].float().contiguous() for t in table)
                                                  for table in (rope_block, rope_context))
        q, k_block, v_block = rope_split(self.qkv.floats(rows, self.ln1, self.eps1), cos, sin, *split)
        _, k_new, v_new = rope_split(self.qkv.floats(context[0].float().contiguous()), context_cos, context_sin, *split)
        k_context, v_context = cache.extend(layer_index, k_new.transpose(0, 1)[None], v_new.transpose(0, 1)[None],
                                            None if context_positions is None else context_positions[0])
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], torch.cat((k_context, k_block.transpose(0, 1)[None]), dim=2),
            torch.cat((v_context, v_block.transpose(0, 1)[None]), dim=2), enable_gqa=kv_heads != heads)
        attended = out[0].transpose(0, 1).reshape(rows.shape[0], -1).contiguous()
        after_attention = self.o.floats(attended, add=rows)
        mlp = self.down.glu(self.gate_up.floats(after_attention, self.ln2, self.eps2), add=after_attention)
        return mlp.to(x.dtype)[None]


def int8_rows_drafter(drafter) -> str:
    """``drafter``'s matrices (its layers', its fc and the draft head's rows) Q8_0 with int8 rows,
    its layers' decode passes as ``Q8DrafterLayer`` where the probe passes; a note for the load log.
    Where the kernels cannot run or the drafter is not an fp32 one on CPU, nothing changes and the
    note says why."""
    why = refusal()
    params = list(drafter.parameters())
    if why is None and any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
        why = "it runs fp32 drafters on CPU"
    if why:
        return f"as loaded (int8 rows: {why})"
    linears = [m for m in drafter.modules() if isinstance(m, torch.nn.Linear) and m.bias is None
               and m.in_features % 32 == 0 and m.out_features % 16 == 0]
    for module in linears:
        module.forward = PackedModuleForward(module, QuantizedLinear(q8_matrix(module.weight)))
    drafter.set_head_kernel(lambda weight: QuantizedLinear(q8_matrix(weight)))
    done = 0
    for i, layer in enumerate(drafter.layers):
        if not layer.self_attn.spec.plain or layer.self_attn.q_proj.bias is not None:
            continue
        fast = Q8DrafterLayer(layer)
        if not probe_layer(layer, fast, "w8a8", W8A8_TOLERANCE):
            return (f"Q8_0 matrices with int8 rows for {len(linears)} matrices and the draft head; layers eager "
                    f"(layer {i}'s fused pass is not the eager one)")
        layer.compiled = fast
        done += 1
    return (f"Q8_0 matrices with int8 rows (VNNI) for {len(linears)} matrices and the draft head; {done} of "
            f"{len(drafter.layers)} layers' decode passes in a few fused calls")
