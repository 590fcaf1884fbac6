"""The drafter beside a w4a8 target on the same kernels: every matrix Q8_0 with int8 rows
(``int8_rows.Q8Q8DotWeight``), each layer's decode pass a handful of calls, on CPU.

A drafter pass is paid every cycle. Beside the int4 and int8 targets its layers run inductor's
int8 weight-only GEMM, which on an AVX512-BF16 CPU without AMX widens rows and codes to fp32 and
drafts markedly slower than this way, the whole pass in one C++ call (``FusedDrafterPass``) faster
still (``make benchmarks-bars``' draft times per cycle: docs/BENCHMARKS-AMD.md). Here its matrices
are quantized to Q8_0 (groups of 32, ``weight_formats.quantize_q8``) and each layer's decode pass
is: the block's rows through QKV with the input norm inside the call, the new context's rows
(not normed, as in z-lab's layer) through the same matrix, the per-head norms, rotary and the
split in one call (``q4_dot.rope_split``), attention over the drafter's cache, then O with the
residual, gate/up with the post-attention norm, SiLU x up inside down's call with the residual.

Drafts are proposals, which the target verifies: rounding here moves acceptance at most, never
the output. A layer runs this way only where a probe finds it the eager layer to rounding, and
only for what a decode asks of it (``aoti_drafter.CompiledDrafterLayer.handles``); every other call
runs the eager layer, as does any call after the drafter's weights have changed. Where every layer
runs this way, ``FusedDrafterPass`` makes the same calls for the whole pass from C++, where its own
probe passes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .aoti_drafter import W8A8_TOLERANCE, CompiledDrafterLayer, probe_layer
from .aoti_layers import close_to_rounding
from .int8_rows import Q8Q8DotWeight, instructions, refusal
from .kernels import PackedModuleForward
from .q4_dot import library, rope_split
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


# How far the one-call pass may stray from the layer-by-layer one: the same products on the same
# int8 rows, only attention's and the norms' sums rounded their own way (within 1e-5 in most of the
# tests' passes), except where that tips a row's rounding to int8 (tests/test_int8_rows.py bounds
# both); a misplaced constant is off by about the results' own size.
FUSED_TOLERANCE = 2e-2


class FusedDrafterPass:
    """A drafter's whole decode pass in one C++ call (``csrc/q4_dot.cpp``'s ``q8_drafter_pass``):
    the context's ``fc`` and ``hidden_norm``, every layer as ``Q8DrafterLayer`` computes it, the
    final norm, without the Python, ctypes and PyTorch ops between them (a few dozen a cycle). Its
    context keys and values live in buffers it keeps beside the cache's lists, (kv_heads, capacity,
    D) per layer, the block's written after the context each pass and overwritten by the next
    context; the cache's ``keys`` / ``values`` are views of them, so an eager call after a fused
    one finds them, and a fused call after an eager one copies what the eager call added."""

    def __init__(self, drafter) -> None:
        layers = [layer.compiled for layer in drafter.layers]
        self.fc = q8_matrix(drafter.fc.weight)
        first = layers[0]
        self.heads, self.kv_heads = first.heads
        self.head_dim = first.layer.self_attn.head_dim
        self.hidden, self.intermediate = drafter.fc.out_features, first.down.shape[1]
        table, eps = [], []
        for fast in layers:
            table += [fast.qkv.packed.data_ptr(), fast.o.packed.data_ptr(), fast.gate_up.packed.data_ptr(),
                      fast.down.packed.data_ptr(), fast.ln1.data_ptr(), fast.ln2.data_ptr(), fast.q_norm.data_ptr(),
                      fast.k_norm.data_ptr()]
            eps += [fast.eps1, fast.eps2, fast.qk_eps]
        self.hidden_norm = drafter.hidden_norm.weight.detach().float().contiguous()
        self.norm = drafter.norm.weight.detach().float().contiguous()
        eps += [float(drafter.hidden_norm.eps), float(drafter.norm.eps)]
        self.table = torch.tensor(table, dtype=torch.int64)
        self.eps = torch.tensor(eps, dtype=torch.float32)
        self.num_layers = len(layers)
        self._params = list(drafter.parameters())
        self._source = self._state()
        self._kernel = library().q8_drafter_pass

    def _state(self) -> list:
        return [(p.data_ptr(), p._version) for p in self._params]

    def handles(self, x: torch.Tensor, features: torch.Tensor | None, positions: torch.Tensor | None, mask,
                cache) -> bool:
        """Whether this call (``DFlashDrafter.forward``'s block input, context features and their
        positions) is a decode pass it serves (else the layers run one by one)."""
        return (x.shape[0] == 1 and features is not None and features.shape[0] == 1 and features.shape[1] > 0
                and positions is not None and mask is None and cache is not None and x.dtype == torch.float32
                and self._state() == self._source)

    def _buffers(self, cache, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's buffers, holding what its lists hold and room for ``needed`` positions."""
        held = cache.buffers
        seen = cache.seen[0]
        if held is not None and held[0].shape[2] >= needed and all(
                (seen == 0 and key is None) or (key is not None and key.data_ptr() == held[0][i].data_ptr()
                                                 and key.shape[2] == seen)
                for i, key in enumerate(cache.keys)):
            return held
        shape = (self.num_layers, self.kv_heads, max(2 * needed, 256), self.head_dim)
        keys, values = torch.empty(shape), torch.empty(shape)
        for i, (key, value) in enumerate(zip(cache.keys, cache.values)):
            if key is not None:
                keys[i, :, :key.shape[2]] = key[0]
                values[i, :, :value.shape[2]] = value[0]
        cache.buffers = (keys, values)
        return keys, values

    def __call__(self, x: torch.Tensor, features: torch.Tensor, rope_block, rope_context, cache) -> torch.Tensor:
        """``DFlashDrafter.forward``'s result for a decode pass: ``x`` (1, Q, H) the block's input,
        ``features`` (1, C, F) the target features not yet seen, the rotary tables of both."""
        rows = x[0].float().contiguous().clone()  # replaced by the pass's output
        context = features[0].float().contiguous()
        q, c = rows.shape[0], context.shape[0]
        seen = cache.seen[0]
        keys, values = self._buffers(cache, seen + c + q)
        (cos, sin), (context_cos, context_sin) = ((t[0].float().contiguous() for t in table)
                                                  for table in (rope_block, rope_context))
        self._kernel(self.table.data_ptr(), self.num_layers, self.eps.data_ptr(), rows.data_ptr(), q,
                     context.data_ptr(), c, context.shape[1], self.fc.packed.data_ptr(), self.hidden_norm.data_ptr(),
                     self.norm.data_ptr(), self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
                     cos.data_ptr(), sin.data_ptr(), context_cos.data_ptr(), context_sin.data_ptr(), keys.data_ptr(),
                     values.data_ptr(), keys.stride(0), keys.shape[2], seen, torch.get_num_threads())
        for i in range(self.num_layers):
            cache.keys[i], cache.values[i] = keys[i, :, :seen + c][None], values[i, :, :seen + c][None]
            cache.seen[i] += c
        return rows.to(x.dtype)[None]


def fused_drafter_pass(drafter) -> FusedDrafterPass | None:
    """``FusedDrafterPass`` for ``drafter`` where every layer runs as ``Q8DrafterLayer`` and a
    probe finds its passes the layer-by-layer ones to rounding: two decode passes on random rows
    and features (the prompt's context, then a cycle's), each way on its own cache."""
    if not drafter.layers or not all(isinstance(layer.compiled, Q8DrafterLayer) for layer in drafter.layers):
        return None
    fused = FusedDrafterPass(drafter)
    generator = torch.Generator().manual_seed(0)
    hidden, width = drafter.fc.out_features, drafter.fc.in_features
    caches = drafter.new_cache(), drafter.new_cache()
    with torch.inference_mode():
        for context_rows, first in ((20, 0), (3, 20)):
            x = torch.randn(1, 16, hidden, generator=generator)
            features = torch.randn(1, context_rows, width, generator=generator)
            block_pos, ctx_pos = torch.arange(first + context_rows - 1, first + context_rows + 15), \
                torch.arange(first, first + context_rows)
            drafter.fused_pass = None
            want = drafter(x, block_pos, features, ctx_pos, cache=caches[0])
            drafter.fused_pass = fused
            got = drafter(x, block_pos, features, ctx_pos, cache=caches[1])
            drafter.fused_pass = None
            if not close_to_rounding(got, want, "w8a8", FUSED_TOLERANCE):
                return None
    return fused


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
    drafter.fused_pass = fused_drafter_pass(drafter)
    how = "the whole decode pass in one C++ call" if drafter.fused_pass else (
        f"{done} of {len(drafter.layers)} layers' decode passes in a few fused calls")
    return f"Q8_0 matrices with int8 rows ({instructions()}) for {len(linears)} matrices and the draft head; {how}"
