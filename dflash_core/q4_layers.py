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
from .q4_dot import Q4DotWeight, library, rope_split
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


class FusedPass:
    """Every decoder layer of a w4a8 target in one C++ call (``csrc/q4_dot.cpp``'s ``w4a8_pass``):
    the calls ``Q4Before``, the attention and ``Q4After`` make, in their order and on buffers of
    their precision, without the Python and ctypes between them (about six calls a layer: a 2-row
    SmolLM2 pass 8.10 -> 5.69 ms, ``scripts/pass_parts.py``). For chain passes
    (``FastTarget.positions_pass``), whose numbers ``fused_pass`` checks bit for bit against the
    layer-by-layer pass before the target uses it, and draft trees (``tree``): there each path's
    new nodes are attended in their own call, the layer-by-layer tree path's calls
    (``tree_attention``), whose rows the attention's own probe checks against a chain's."""

    def __init__(self, target) -> None:
        self.target = target
        self.intermediate = target.layers[0].after.down.shape[1]
        table = []
        for layer in target.layers:
            before, after = layer.before, layer.after
            table += [before.qkv.packed.data_ptr(), after.o.packed.data_ptr(), after.gate_up.packed.data_ptr(),
                      after.down.packed.data_ptr(), before.ln1.data_ptr(), after.ln2.data_ptr()]
        self.table = torch.tensor(table, dtype=torch.int64)
        self._kernel = library().w4a8_pass
        self._slots: dict[tuple, torch.Tensor] = {}  # per set of feature layers: each layer's slot or -1

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                 wanted: dict[int, int], feats: list, real: int) -> torch.Tensor:
        """``FastTarget._compiled_layers``' result for the same arguments (``feats`` filled alike)."""
        return self._run(x, cos, sin, rows, wanted, feats, real, None)[0]

    def tree(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
             turns: list[tuple[int, int]], wanted: dict[int, int], feats: list, real: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``tree_attention``'s layer loop with ``dot_attention``: each run of rows ``turns``
        ([a, b), a path's new nodes) attended in its own call, the padding rows after ``real``
        given the last real row's attention; returns x and every layer's keys and values of the
        real rows, (layers, kv_heads, real, D) each."""
        x, keys, values = self._run(x, cos, sin, positions, wanted, feats, real, turns)
        return x, keys[:, :real].transpose(1, 2).contiguous(), values[:, :real].transpose(1, 2).contiguous()

    def _run(self, x, cos, sin, rows, wanted, feats, real, turns):
        target = self.target
        t, e = x.shape
        x = x.float().contiguous()  # updated in place by the kernel
        slot = self._slots.get(key := tuple(wanted.items()))
        if slot is None:
            slot = self._slots[key] = torch.full((target.num_layers,), -1, dtype=torch.int64)
            for layer, n in wanted.items():
                slot[layer] = n
        features = torch.empty(len(wanted), t, e) if wanted else None
        keys, values = target.cache.k, target.cache.v
        cos, sin, rows = cos.contiguous(), sin.contiguous(), rows.to(torch.int64).contiguous()
        tree_keys = tree_values = spans = None
        if turns is not None:
            spans = torch.tensor(turns, dtype=torch.int64).reshape(-1)
            shape = (target.num_layers, t, target.num_kv_heads, target.head_dim)
            tree_keys, tree_values = torch.empty(shape), torch.empty(shape)
        pointer = lambda tensor: None if tensor is None else tensor.data_ptr()  # noqa: E731
        self._kernel(self.table.data_ptr(), target.num_layers, x.data_ptr(), t, e, target.num_heads,
                     target.num_kv_heads, target.head_dim, self.intermediate, cos.data_ptr(), sin.data_ptr(),
                     rows.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.shape[2], target.eps,
                     slot.data_ptr(), pointer(features), pointer(spans), 0 if turns is None else len(turns), real,
                     pointer(tree_keys), pointer(tree_values), torch.get_num_threads())
        for n in range(len(wanted)):
            feats[n] = features[n, :real]
        return x, tree_keys, tree_values


def fused_pass(target) -> tuple[FusedPass | None, str]:
    """``FusedPass`` for ``target`` where its layers are ``q4_layers``' on ``int8_rows``' Q4_1
    kernels (w4a8) with no QKV biases or per-head norms, attention is ``dot_attention``'s, and a
    pass through it gives, bit for bit, the layer-by-layer pass's logits, keys and values (a
    block's, then the fewest rows a pass runs: ``min_rows``); else None; and a note."""
    from .dot_attention import DotAttention

    layers = target.layers
    if not (isinstance(target.attention, DotAttention) and all(
            isinstance(layer.before, Q4Before) and isinstance(layer.after, Q4After)
            and layer.before.bias is None and layer.before.qk_norm is None
            and all(isinstance(k, Q4Q8DotWeight) for k in (layer.before.qkv, layer.after.o, layer.after.gate_up,
                                                           layer.after.down))
            for layer in layers)):
        return None, "layer by layer"
    fused = FusedPass(target)
    cache = target.cache
    capacity = cache.capacity
    with torch.inference_mode():
        prompt = torch.arange(3, 40) % target.vocab_size
        block = torch.arange(40, 56) % target.vocab_size
        results = []
        for use in (None, fused):
            target._fused_pass = use
            target.reset(256)
            target.forward(prompt, None, last_only=True)
            out = target.forward(block, [0, len(layers) - 1])
            lone = target.forward(block[:1], None).logits  # as few rows as a pass runs (min_rows)
            results.append((out.logits.clone(), out.features.clone(), lone.clone(), cache.k.clone(), cache.v.clone()))
        target._fused_pass = None
        target.reset(max(capacity, 1))
    if not all(torch.equal(a, b) for a, b in zip(*results)):
        return None, "layer by layer (the one-call pass's numbers were not the layers')"
    return fused, "every layer of a pass in one C++ call"
