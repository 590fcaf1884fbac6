"""A Q4_1 GGUF's decoder layers run on the file's own codes (``q4_dot``) with the work between the
matrices folded into their calls, on CPU.

Eager, an fp32 target with ``weights = "int4"`` runs some twenty small PyTorch ops per layer
around its four ``q4_dot`` products (norms, residual adds, dtype casts, the products' own
conversions), each dispatched from Python: on SmolLM2 they cost more of a step than the products
(docs/BENCHMARKS-AMD.md). Here each product takes its rows as the kernel wants them: the RMS
norms before QKV and gate/up and the rounding of the rows to bf16 run inside ``q4_dot`` (one pass
over the rows), the residual adds after O and down run in the products' own passes, SiLU(gate)
x up in the down product's first pass, and rotary in one call that lays the QKV product out as
attention takes it (eager where QKV has biases or per-head norms). Attention runs
``aoti_attention``'s compiled kernel where it runs.

The layers are the eager ones' math on the same kernels, only fused: a probe checks them against
the eager halves to rounding, and FastTarget's min-rows probe then decides, as for every kernel,
whether a row's numbers stay independent of the rows beside it (so greedy DFlash still equals
greedy AR).
"""

from __future__ import annotations

from dataclasses import fields

import torch

from .aoti_layers import CompiledLayer, close_to_rounding
from .families import FusedLayer
from .kernels import probe_rows
from .int8_rows import Q4Q8DotWeight
from .q4_dot import Q4DotWeight, rope_split
from .weight_formats import QuantizedLinear

MATRICES = ("qkv", "o", "gate_up", "down")


class Q4Before:
    """``FastTarget.attention_inputs`` for one layer: (x, cos, sin) -> queries, keys, values."""

    def __init__(self, layer: FusedLayer, target) -> None:
        self.qkv = layer.qkv.kernel
        self.bias = layer.qkv.bias
        self.ln1 = layer.ln1.float().contiguous()
        self.qk_norm = layer.qk_norm
        self.target = target
        self.split = (target.num_heads, target.num_kv_heads, target.head_dim)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        h, kv, d = self.split
        qkv = self.qkv.floats(x.contiguous(), self.ln1, self.target.eps)
        if self.bias is None and self.qk_norm is None:  # rotary and the split in one call
            return rope_split(qkv, cos.contiguous(), sin.contiguous(), h, kv)
        if self.bias is not None:
            qkv = qkv + self.bias
        qkv = qkv.unflatten(-1, (h + 2 * kv, d))
        qk = qkv[:, : h + kv]
        if self.qk_norm is not None:
            qk = self.target.norm(qk, self.qk_norm)
        qk = self.target.rope(qk, cos, sin)
        return qk[:, :h], qk[:, h:], qkv[:, h + kv :]


class Q4After:
    """``FastTarget.finish_layer`` for one layer: (x, attention) -> the residual stream after it."""

    def __init__(self, layer: FusedLayer, eps: float) -> None:
        self.o, self.gate_up, self.down = layer.o.kernel, layer.gate_up.kernel, layer.down.kernel
        self.ln2 = layer.ln2.float().contiguous()
        self.eps = eps

    def __call__(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        x = self.o.floats(attention.contiguous(), add=x.contiguous())
        return self.down.glu(self.gate_up.floats(x, self.ln2, self.eps), add=x)


def layers_refusal(target) -> str | None:
    """Why ``target``'s layers cannot run here (None where they can)."""
    if target.dtype != torch.float32 or target.device.type != "cpu":
        return f"only fp32 targets on CPU run them, not {target.dtype} on {target.device.type}"
    for i, layer in enumerate(target.layers):
        for name in MATRICES:
            matrix = getattr(layer, name)
            if not (isinstance(matrix, QuantizedLinear) and isinstance(matrix.kernel, (Q4DotWeight, Q4Q8DotWeight))):
                return f"layer {i}'s {name} does not run q4_dot"
            if name != "qkv" and matrix.bias is not None:
                return f"layer {i}'s {name} has a bias (only QKV's is added)"
    return None


def q4_layers(target) -> tuple[list[CompiledLayer] | None, str]:
    """``target.layers`` (a ``FastTarget``'s, every matrix on ``q4_dot``) with both halves fused,
    and a note; ``(None, why not)`` where they cannot run or the probe against the eager halves refuses."""
    why = layers_refusal(target)
    if why is not None:
        return None, why
    generator = torch.Generator().manual_seed(0)
    x = probe_rows(target.hidden_size, torch.float32)
    angles = (x.shape[0], target.num_heads + target.num_kv_heads, target.head_dim)
    cos, sin = torch.randn(*angles, generator=generator), torch.randn(*angles, generator=generator)
    attention = torch.randn(x.shape[0], target.num_heads * target.head_dim, generator=generator)
    out = []
    for i, layer in enumerate(target.layers):
        before, after = Q4Before(layer, target), Q4After(layer, target.eps)
        with torch.inference_mode():
            eager = target.attention_inputs(layer, x, cos, sin)
            if not all(close_to_rounding(g, w, "int4") for g, w in zip(before(x, cos, sin), eager)):
                return None, f"layer {i}'s fused attention inputs are not the eager ones"
            if not close_to_rounding(after(x, attention), target.finish_layer(layer, x, attention), "int4"):
                return None, f"layer {i}'s fused finish is not the eager one"
        out.append(CompiledLayer(**{f.name: getattr(layer, f.name) for f in fields(FusedLayer)}, before=before, after=after))
    return out, (f"{len(out)} of {len(target.layers)} decoder layers on the GGUF's Q4_1 codes with their norms "
                 "and residual adds inside the products")
