"""The drafter's layers compiled whole around attention (AOTInductor), on CPU, beside the target's.

A drafter pass is paid every cycle. Matrix by matrix (``aoti_kernels.drafter_kernels``), each of
its layers still runs some forty small eager ops around its seven matrices (norms, rotary, casts,
residuals, SiLU), each dispatched from Python: most of a drafter pass on a 135M target
(docs/BENCHMARKS.md). Here each layer's work before attention is one kernel: the block's rows
normalised, the block's and the new context's rows through one fused Q/K/V matrix, the per-head
norms and the rotation; after attention, ``aoti_layers``' second half (O, residual, norm, gate/up,
SiLU, down, residual) on the block's rows. Attention over the drafter's cache stays eager
(``F.scaled_dot_product_attention``).

Drafts are proposals, which the target verifies: rounding here moves acceptance at most, never the
output. A compiled layer replaces the eager one only where a probe finds its results the eager
layer's to rounding (the int8 kernels' bf16 rows), and only for what a decode asks of it: one
sequence, full attention, new context rows, no mask; every other call (training, sliding-window
layers) runs the eager layer, as does any call after the drafter's weights have changed.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from .aoti_kernels import INT8_ROWS, available, cached, kernel_dir, spec_digest
from .aoti_layers import (CompiledHalf, HalfThenDown, LayerSpec, Matrix, build_kernel, close_to_rounding, layer_library,
                          rms_norm, w8a8_params)
from .drafter import DrafterCache, rotate_half
from .int8_dot import int8_dot_weight
from .weight_formats import Int8Weight

# Set to 0 to run the drafter's layers matrix by matrix (to measure one against the other).
SWITCH = "DFLASH_AOTI_DRAFTER_LAYERS"


@dataclass(frozen=True)
class DrafterSpec:
    """What the compiled first half of a drafter layer depends on besides the machine."""

    kind: str  # "float32" or "int8" (the matrices; rows and the rest in float32)
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rows: str = field(default="int8", metadata={"omitted_at_default": True})  # w8a8's rows: see aoti_layers.LayerSpec

    def qkv(self) -> tuple[int, int]:
        return ((self.heads + 2 * self.kv_heads) * self.head_dim, self.hidden)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # drafter.apply_rope's math in this layout: (rows, heads, D) with (rows, D) tables.
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class _DrafterBefore(torch.nn.Module):
    """(block rows, new context rows, the block's cos/sin, the context's) -> the block's queries
    (Q, heads, D), then the keys and values of the block's rows followed by the context's
    (Q + C, kv_heads, D). The context rows skip the input norm, as in z-lab's layer."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.spec = spec
        self.ln1 = torch.nn.Parameter(torch.ones(spec.hidden), requires_grad=False)
        self.qkv = Matrix(spec.kind, *spec.qkv(), False, spec.rows)
        self.q_norm = torch.nn.Parameter(torch.ones(spec.head_dim), requires_grad=False)
        self.k_norm = torch.nn.Parameter(torch.ones(spec.head_dim), requires_grad=False)

    def forward(self, x, context, cos_block, sin_block, cos_context, sin_context):
        s = self.spec
        h, kv, d = s.heads, s.kv_heads, s.head_dim
        q_rows = x.shape[0]
        qkv = self.qkv(torch.cat((rms_norm(x, self.ln1, s.eps), context))).unflatten(-1, (h + 2 * kv, d))
        cos, sin = torch.cat((cos_block, cos_context)), torch.cat((sin_block, sin_context))
        q = _rotate(rms_norm(qkv[:q_rows, :h], self.q_norm, s.eps), cos_block, sin_block)
        k = _rotate(rms_norm(qkv[:, h : h + kv], self.k_norm, s.eps), cos, sin)
        return q, k, qkv[:, h + kv :]


def _example(spec: DrafterSpec, rows: int, generator: torch.Generator | None = None) -> tuple:
    def rand(*shape):
        return torch.randn(*shape, generator=generator) if generator is not None else torch.zeros(*shape)

    context = rows + 1  # another count than the block's: the two are separate dimensions
    return (rand(rows, spec.hidden), rand(context, spec.hidden), rand(rows, spec.head_dim), rand(rows, spec.head_dim),
            rand(context, spec.head_dim), rand(context, spec.head_dim))


def _build(spec: DrafterSpec, library: Path) -> dict:
    block = torch.export.Dim("block", min=1, max=1 << 16)
    context = torch.export.Dim("context", min=1, max=1 << 20)
    return build_kernel(_DrafterBefore(spec).eval(), lambda rows, generator=None: _example(spec, rows, generator),
                        {"qkv": spec.qkv()}, spec.kind, library, {"spec": asdict(spec)},
                        dynamic_shapes=({0: block}, {0: context}, {0: block}, {0: block}, {0: context}, {0: context}))


def before_library(spec: DrafterSpec) -> tuple[Path, dict]:
    """The compiled first half of drafter layers of ``spec``, built here first if the cache lacks it."""
    library = kernel_dir() / f"drafter-before-{spec.kind}-{spec_digest(spec)}.so"
    return cached(library, lambda path: _build(spec, path))


def _matrix(weight: torch.Tensor, kind: str, name: str) -> dict[str, torch.Tensor]:
    """A matrix's kernel parameters: fp32 as is, int8 codes with one scale per output row, or
    (w8a8's qkv, o and gate/up) ``DynamicInt8Weight``'s, in both layouts its rows' forms read."""
    if kind == "float32":
        return {f"{name}.weight": weight.contiguous()}
    from .weight_formats import DYNAMIC_MATRICES, DynamicInt8Weight, Int8Weight

    if kind == "w8a8" and name in DYNAMIC_MATRICES:
        # rows quantized per row, without smoothing factors: a drafter's rounding moves acceptance
        # only (docs/BENCHMARKS-AMD.md measured it), and it has no calibration pass of its own
        return w8a8_params(name, DynamicInt8Weight(weight))

    int8 = Int8Weight(weight, INT8_ROWS)
    return {f"{name}.weight": int8.q, f"{name}.scales": int8.scales.contiguous()}


class CompiledDrafterLayer:
    """One drafter layer's decode pass through its two compiled halves and eager attention."""

    def __init__(self, layer, before: CompiledHalf, after: CompiledHalf) -> None:
        self.layer, self.before, self.after = layer, before, after
        self._params = list(layer.parameters())  # what the kernels' constants were made from
        self._source = self._state()

    def _state(self) -> list:
        return [(p.data_ptr(), p._version) for p in self._params]

    def handles(self, x: torch.Tensor, context: torch.Tensor | None, mask, cache) -> bool:
        """Whether this call is a decode pass the compiled halves serve (else the eager layer runs)."""
        return (x.shape[0] == 1 and context is not None and context.shape[1] > 0 and mask is None
                and cache is not None and self.layer.self_attn.spec.plain and self._state() == self._source)

    def __call__(self, x, context, rope_block, rope_context, cache, layer_index: int, context_positions) -> torch.Tensor:
        attn = self.layer.self_attn
        q, k, v = self.before(x[0], context[0], rope_block[0][0], rope_block[1][0], rope_context[0][0], rope_context[1][0])
        rows = x.shape[1]
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, kv_heads, Q + C, D)
        k_ctx, v_ctx = cache.extend(layer_index, k[:, :, rows:], v[:, :, rows:],
                                    None if context_positions is None else context_positions[0])
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], torch.cat((k_ctx, k[:, :, :rows]), dim=2), torch.cat((v_ctx, v[:, :, :rows]), dim=2),
            enable_gqa=attn.num_kv_heads != attn.num_heads)  # (1, heads, Q, D)
        return self.after(x[0], out[0].transpose(0, 1).reshape(rows, -1))[None]


def _spec(layer, kind: str, rows: str = "int8") -> tuple[DrafterSpec, LayerSpec]:
    attn, mlp = layer.self_attn, layer.mlp
    hidden = attn.q_proj.in_features
    before = DrafterSpec(kind=kind, hidden=hidden, heads=attn.num_heads, kv_heads=attn.num_kv_heads,
                         head_dim=attn.head_dim, eps=float(layer.input_layernorm.eps), rows=rows)
    after = LayerSpec(kind=kind, hidden=hidden, heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                      intermediate=mlp.down_proj.in_features, eps=float(layer.post_attention_layernorm.eps), rows=rows)
    return before, after


def _params(layer, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    attn, mlp = layer.self_attn, layer.mlp
    qkv = torch.cat((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)).detach()
    before = {"ln1": layer.input_layernorm.weight.detach(), "q_norm": attn.q_norm.weight.detach(),
              "k_norm": attn.k_norm.weight.detach(), **_matrix(qkv, kind, "qkv")}
    gate_up = torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)).detach()
    after = {"ln2": layer.post_attention_layernorm.weight.detach(), **_matrix(attn.o_proj.weight.detach(), kind, "o"),
             **_matrix(gate_up, kind, "gate_up"), **_matrix(mlp.down_proj.weight.detach(), kind, "down")}
    return before, after


def _rotary(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) tables of some rotation for ``positions``, (1, T, dim), as the drafter's rotary gives."""
    angles = positions[:, None] * 0.1 + torch.arange(dim // 2)[None] * 0.01
    angles = torch.cat((angles, angles), dim=-1)[None]
    return angles.cos(), angles.sin()


# How far a w8a8 layer may stray from the eager one (int8 weight-only, rows in bf16), relative to
# what the layer adds to its residual: rows rounded to int8 per row without smoothing factors move
# it a few percent (above 2e-2 for the bundled SmolLM2 drafter); a constant in the wrong place
# moves it by about its own size (tested). The target verifies every draft.
W8A8_TOLERANCE = 0.1


def probe_layer(layer, compiled: CompiledDrafterLayer, kind: str, tolerance: float | None = None) -> bool:
    """The compiled layer against the eager one (as it runs: its matrices through the kernels
    ``drafter_kernels`` gave them) on random rows: a decode pass's call twice, the prompt's context
    then a cycle's, each on its own fresh cache. Compared: what the layer adds to its residual, to
    ``kind``'s rounding (``close_to_rounding``) or ``tolerance``."""
    generator = torch.Generator().manual_seed(0)
    hidden, dim = layer.self_attn.q_proj.in_features, layer.self_attn.head_dim
    caches = DrafterCache(1), DrafterCache(1)
    rope_block = _rotary(torch.arange(20, 36), dim)
    with torch.inference_mode():
        for context_rows, first in ((20, 0), (3, 17)):
            x = torch.randn(1, 16, hidden, generator=generator)
            context = torch.randn(1, context_rows, hidden, generator=generator)
            rope_context = _rotary(torch.arange(first, first + context_rows), dim)
            want = layer(x, context, rope_block, rope_context, None, caches[0], 0)
            got = compiled(x, context, rope_block, rope_context, caches[1], 0, None)
            if not close_to_rounding(got - x, want - x, kind, tolerance):
                return False
    return True


def compile_drafter_layers(drafter, kind: str) -> str:
    """Each of ``drafter``'s layers with its decode passes compiled (``DrafterLayer.compiled``),
    its matrices ``kind`` ("float32", "int8" weight-only, or "w8a8": rows in int8 too, as the
    target's w8a8 layers run them here, ``aoti_kernels.w8a8_rows``; int8 where inductor has no
    kernel for them), and a note for the load log; where the switch, the drafter, a build or the
    probe refuses, the layers stay eager and the note says why. Call it after
    ``aoti_kernels.drafter_kernels``: the probe compares with the layers as they then run (int8
    matrices round as the kernels do)."""
    if os.environ.get(SWITCH, "1") == "0":
        return f"layers eager (turned off, {SWITCH}=0)"
    params = list(drafter.parameters())
    if not available() or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
        return "layers eager (compiled for fp32 drafters on CPU with a compiler)"
    rows = "int8"
    if kind == "w8a8":
        from .aoti_kernels import w8a8_rows

        found = w8a8_rows()[0]  # None: the int8 weight-only layers, as the target's
        kind, rows = ("w8a8", found) if found else ("int8", "int8")
    done = 0
    for i, layer in enumerate(drafter.layers):
        if not layer.self_attn.spec.plain or layer.self_attn.q_proj.bias is not None:
            continue
        before_spec, after_spec = _spec(layer, kind, rows)
        # down through int8_dot's bf16 dot products where they run, as the target's
        down = int8_dot_weight(Int8Weight(layer.mlp.down_proj.weight.detach(), torch.float32))[0] if kind != "float32" else None
        try:
            before_params, after_params = _params(layer, kind)
            after = CompiledHalf(*layer_library(replace(after_spec, down_apart=down is not None), "after"), after_params)
            compiled = CompiledDrafterLayer(layer, CompiledHalf(*before_library(before_spec), before_params),
                                            after if down is None else HalfThenDown(after, down))
        except Exception as exc:  # a compiler or AOTInductor failure: the eager layers keep running
            return f"layers eager (building the kernels failed: {type(exc).__name__}: {str(exc)[:200]})"
        if not probe_layer(layer, compiled, kind, W8A8_TOLERANCE if kind == "w8a8" else None):
            return f"layers eager (layer {i}'s compiled pass is not the eager one)"
        layer.compiled = compiled
        done += 1
    unsigned = ", rows unsigned" if kind == "w8a8" and rows == "uint8" else ""
    unsigned += ", down through bf16 dot products" if done and kind != "float32" and down is not None else ""
    return f"{done} of {len(drafter.layers)} layers compiled whole around attention ({kind} matrices{unsigned})"
