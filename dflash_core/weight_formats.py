"""Weight-only int8 / int4 linear layers for the target on CPU, used only where exact per row.

Decoding a small model on a CPU is bound by reading its weights; reading them in fewer bytes
(int4: ~0.56 byte per weight with its group scales, int8: 1 byte, against bf16's 2) is the lever
llama.cpp pulls. PyTorch ships weight-only kernels for both:

* ``int4``: ``aten._weight_int4pack_mm_for_cpu`` ("tinygemm" layout), groups of 32 along the
  input dimension, ``w = (q - 8) * scale + zero`` with ``q`` in 0..15 and ``scale`` / ``zero`` in
  the activations' dtype. A GGUF ``Q4_1`` block is ``w = d * q + m`` (groups of 32, ``d`` and
  ``m`` in fp16), so ``scale = d`` and ``zero = m + 8 d`` run the file's own 4-bit codes
  (``q4_1_blocks``); the only rounding left is that of ``d`` and ``zero`` to bf16 (on SmolLM2
  that leaves a relative rms weight error of 2.0e-3 against the file, bf16 rounding of the
  dequantized weights 1.3e-3: another model, not a closer one). PyTorch's CPU kernel is fast for
  a few rows and slow for many (~1.3 ms more per row for SmolLM2's layers): see docs/BENCHMARKS.md.
* ``int8``: ``aten._weight_int8pack_mm``, one scale per output channel: a requantization of the
  (dequantized) weight, not the file's numbers.
* ``w8a8``: the rows quantized too, to int8 with one scale per row (symmetric, dynamic), and
  multiplied int8 by int8 (``torch._int_mm``, 32-bit integer sums: exact, so a row's result
  cannot depend on its company), as llama.cpp quantizes the activations of a Q4 / Q8 matrix
  product. Compiled (``kernels = "aoti"``) this runs inductor's int8 GEMM (AMX's int8 tiles
  where the CPU has them), faster than the bf16-rows int8 kernel (docs/BENCHMARKS.md); where
  inductor has a vector kernel for unsigned rows only (AVX-512 VNNI without AMX, as on an EPYC
  Zen 4), the rows go in shifted by 128 (``aoti_layers.unsigned_rows_product``: the same integer
  sums); where it has neither (AVX2; ``aoti_kernels.w8a8_rows``), FastTarget runs ``int8`` instead
  (docs/BENCHMARKS-AMD.md).
  Rows quantized per row lose more than llama.cpp's blocks of 32 where a few input channels
  carry most of the magnitude, so each matrix's input is first divided by SmoothQuant factors
  (``smoothing_factors``: per input channel, from activation maxima on a calibration text, the
  inverse folded into the weight), and the MLP's down projection, whose inputs spread widest,
  stays weight-only int8. Measured on SmolLM2 against the fp32 model (docs/BENCHMARKS.md): close
  to llama.cpp's own activation rounding, a little further than ``int8``.

Losslessness rests on batch invariance (see ``target.py``): a format is only used after
``row_invariant`` shows that, on this machine, a row's result does not depend on how many rows
share the call; otherwise the caller keeps its bf16 linear (``QuantizedLinear.build`` says why).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .kernels import probe_rows, rows_match

WEIGHT_FORMATS = ("bf16", "int8", "int4", "w8a8", "w4a8")
GROUP = 32  # inputs per block of Q4_1 and Q8_0, and the int4 kernel's group size we use


def _has(op: str) -> bool:
    return hasattr(torch.ops.aten, op)


def kernel_available(fmt: str) -> bool:
    if fmt == "int4":
        return _has("_weight_int4pack_mm_for_cpu") and _has("_convert_weight_to_int4pack_for_cpu")
    if fmt == "int8":
        return _has("_weight_int8pack_mm")
    if fmt == "w8a8":
        return _has("_weight_int8pack_mm") and _has("_int_mm")
    return fmt in ("bf16", "w4a8")  # w4a8: our own kernel (q4_dot.q4q8_dot_weight says where it runs)


# ------------------------------------------------------------------------------------ GGUF Q4_1
@dataclass
class Q4Blocks:
    """One matrix's 4-bit codes and group parameters: ``w[n, k] = d[n, k // 32] * q[n, k] + m[n, k // 32]``."""

    q: torch.Tensor  # (N, K) int32, 0..15
    d: torch.Tensor  # (N, K / 32) float32 (fp16 values)
    m: torch.Tensor  # (N, K / 32) float32 (fp16 values)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.float().view(n, k // GROUP, GROUP) * self.d[..., None] + self.m[..., None]
        return w.view(n, k)

    def permute_rows(self, order: torch.Tensor) -> "Q4Blocks":
        return Q4Blocks(self.q[order], self.d[order], self.m[order])

    @staticmethod
    def cat(parts: list["Q4Blocks"]) -> "Q4Blocks":
        return Q4Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "d", "m")))


@dataclass
class Q8Blocks:
    """One matrix's GGUF Q8_0 blocks: ``w[n, k] = d[n, k // 32] * q[n, k]``."""

    q: torch.Tensor  # (N, K) int8
    d: torch.Tensor  # (N, K / 32) float32 (fp16 values)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        return (self.q.float().view(n, k // GROUP, GROUP) * self.d[..., None]).view(n, k)


def _unpack_q8_0(raw: np.ndarray, rows: int, cols: int) -> Q8Blocks:
    blocks = raw.reshape(rows * cols // GROUP, 34)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // GROUP)
    q = blocks[:, 2:].copy().view(np.int8).reshape(rows, cols)
    return Q8Blocks(torch.from_numpy(q), torch.from_numpy(d))


def _unpack_q4_1(raw: np.ndarray, rows: int, cols: int) -> Q4Blocks:
    blocks = raw.reshape(rows * cols // GROUP, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // GROUP)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, cols // GROUP)
    qs = blocks[:, 4:]  # byte j holds element j (low nibble) and element j + 16 (high nibble)
    q = np.concatenate((qs & 0x0F, qs >> 4), axis=1).astype(np.int32).reshape(rows, cols)
    return Q4Blocks(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))


def _rope_unpermute(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's rotary permutation of q/k (as transformers does)."""
    dim = rows // heads // 2
    return torch.arange(rows).view(heads, dim, 2).transpose(1, 2).reshape(rows)


def q4_1_blocks(gguf_path: str | Path, num_heads: int, num_kv_heads: int) -> dict[str, Q4Blocks]:
    """The Q4_1 matrices of a llama-family GGUF, keyed by transformers' module names
    (``model.layers.3.self_attn.q_proj``), rows in transformers' order; and under ``lm_head``
    the output matrix's Q8_0 blocks where it has them (``output.weight``, else the tied
    ``token_embd.weight``). Other tensors (norms) are left out."""
    import gguf

    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    out: dict[str, Q4Blocks | Q8Blocks] = {}
    heads = {}
    for tensor in gguf.GGUFReader(str(gguf_path)).tensors:
        if tensor.name in ("output.weight", "token_embd.weight"):
            heads[tensor.name] = tensor
        parts = tensor.name.split(".")
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1 or len(parts) != 4 or parts[0] != "blk":
            continue
        if parts[2] not in names:
            continue
        cols, rows = (int(s) for s in tensor.shape)  # GGUF lists the fastest dimension first
        blocks = _unpack_q4_1(np.asarray(tensor.data), rows, cols)
        if parts[2] == "attn_q":
            blocks = blocks.permute_rows(_rope_unpermute(rows, num_heads))
        elif parts[2] == "attn_k":
            blocks = blocks.permute_rows(_rope_unpermute(rows, num_kv_heads))
        out[f"model.layers.{parts[1]}.{names[parts[2]]}"] = blocks
    head = heads.get("output.weight", heads.get("token_embd.weight"))
    if head is not None and head.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        cols, rows = (int(s) for s in head.shape)
        out["lm_head"] = _unpack_q8_0(np.asarray(head.data), rows, cols)
    return out


# ----------------------------------------------------------------------------------- the kernels
class Int4Weight:
    """``x @ w.T`` through ``_weight_int4pack_mm_for_cpu`` (groups of 32), computed in bf16.

    ``dtype`` is the activations': PyTorch's CPU kernel has a fast path for bf16 activations only
    (fp32 ones take a generic loop that was over ten times slower here), so an fp32 model's rows
    are rounded to bf16 on the way in and the result widened back."""

    fmt = "int4"
    COMPUTE = torch.bfloat16

    def __init__(self, blocks: Q4Blocks, dtype: torch.dtype = torch.bfloat16) -> None:
        n, k = blocks.q.shape
        self.shape = (n, k)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.contiguous(), 1)
        zero = blocks.m + 8 * blocks.d
        compute = self.COMPUTE if dtype == torch.float32 else dtype
        self.scales_zeros = torch.stack((blocks.d, zero), dim=-1).transpose(0, 1).contiguous().to(compute)

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> "Int4Weight":
        """Asymmetric 4-bit groups of 32 (min/max), for a weight that has no file blocks."""
        return cls(quantize_q4(weight.float()), weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        compute = self.scales_zeros.dtype
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(compute), self.packed, GROUP, self.scales_zeros)
        return out.to(x.dtype)


def int4_kernel(blocks: Q4Blocks, dtype: torch.dtype):
    """``blocks``' kernel: ``q4_dot``'s (the file's scales as they are, bf16 dot products) where it
    runs here, else PyTorch's int4 kernel (``Int4Weight``)."""
    from .q4_dot import q4_dot_weight

    kernel, _ = q4_dot_weight(blocks)
    return kernel if kernel is not None else Int4Weight(blocks, dtype)


class Int8Weight:
    """``x @ w.T`` through ``_weight_int8pack_mm``: symmetric int8, one scale per output channel."""

    fmt = "int8"

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> None:
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
        self.shape = tuple(weight.shape)
        self.q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scale.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` (fp32) as symmetric int8 codes and its scale (max |x| / 127)."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


def int8_rows_product(x: torch.Tensor, codes_t: torch.Tensor, scales: torch.Tensor, smoothing: torch.Tensor) -> torch.Tensor:
    """``w8a8``'s product: the rows of ``x / smoothing`` quantized (``quantize_rows``) times the
    int8 weight ``codes_t`` (in, out), the int32 sums rescaled by both sides' scales in fp32. The
    eager kernel and the compiled layers (``aoti_layers.Matrix``) both run this."""
    codes, row_scales = quantize_rows(x.float() / smoothing)
    return (torch._int_mm(codes, codes_t).float() * row_scales * scales).to(x.dtype)


@functools.cache
def int8_sums_exact() -> bool:
    """Whether ``torch._int_mm`` sums int8 products exactly in int32 on this CPU. oneDNN's int8
    kernels for CPUs without VNNI (AVX2) add two byte products in a 16-bit lane first
    (``vpmaddubsw``), which saturates: rows of 127 against weights of 127 overflow it at once."""
    generator = torch.Generator().manual_seed(0)
    a = torch.cat([torch.full((2, 64), 127, dtype=torch.int8), torch.full((2, 64), -127, dtype=torch.int8),
                   torch.randint(-127, 128, (4, 64), generator=generator, dtype=torch.int8)])
    b = torch.cat([torch.full((64, 8), 127, dtype=torch.int8),
                   torch.randint(-127, 128, (64, 8), generator=generator, dtype=torch.int8)], 1)
    return torch.equal(torch._int_mm(a, b), (a.double() @ b.double()).to(torch.int32))


class DynamicInt8Weight:
    """``x @ w.T`` with both sides int8 (``w8a8``): the weight times ``smoothing`` (one factor
    per input channel) in symmetric int8 with one scale per output channel (``Int8Weight``'s
    quantization, scales kept in fp32), each row of ``x / smoothing`` quantized on the fly."""

    fmt = "w8a8"

    def __init__(self, weight: torch.Tensor, smoothing: torch.Tensor | None = None) -> None:
        self.smoothing = (torch.ones(weight.shape[1]) if smoothing is None else smoothing).float().contiguous()
        per_channel = Int8Weight(weight.float() * self.smoothing, torch.float32)
        self.shape, self.q, self.scales = tuple(weight.shape), per_channel.q, per_channel.scales
        self.q_t = self.q.t().contiguous()  # (K, N): _int_mm's right-hand layout

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return int8_rows_product(x, self.q_t, self.scales, self.smoothing)


# SmoothQuant's alpha (smoothing_factors); a module constant so that scripts/weight_quality.py
# can measure others through the engine's own kernels.
SMOOTHING_ALPHA = 0.7


def smoothing_factors(activation_max: torch.Tensor, weight: torch.Tensor, alpha: float | None = None) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors ``s = max|x|^a / max|w|^(1-a)``: the input divided
    by ``s`` and the weight multiplied by it leave the product unchanged and move the spread of
    the input's channels into the weight, which has a scale per output channel to absorb it.
    ``weight`` is a fused matrix (q, k and v; gate and up), whose parts share one set of factors:
    ``SMOOTHING_ALPHA`` by default, measured best on SmolLM2 that way (docs/BENCHMARKS.md)."""
    alpha = SMOOTHING_ALPHA if alpha is None else alpha
    w_max = weight.float().abs().amax(0).clamp(min=1e-5)
    return (activation_max.float().clamp(min=1e-5) ** alpha / w_max ** (1 - alpha)).contiguous()


CALIBRATION_TEXT = Path(__file__).parent / "data" / "calibration.txt"


def calibration_text() -> str:
    """The text whose activation maxima set ``w8a8``'s smoothing factors: a short chat of
    questions, answers and code in several languages, written for this purpose (no evaluation
    or training set: HumanEval and the held-out prompts stay unseen)."""
    return CALIBRATION_TEXT.read_text(encoding="utf-8")


def calibration_ids(tokenizer) -> torch.Tensor:
    """``calibration_text`` as the model sees a chat: its "User:" / "Assistant:" turns through the
    tokenizer's chat template where it has one (the template's special tokens drive some of the
    largest activations), else the text as it is."""
    import re

    text = calibration_text()
    turns = re.split(r"^(User|Assistant):[ \n]", text, flags=re.MULTILINE)[1:]
    messages = [{"role": "user" if who == "User" else "assistant", "content": said.strip()}
                for who, said in zip(turns[::2], turns[1::2])]
    if getattr(tokenizer, "chat_template", None) and messages:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        return torch.tensor(ids["input_ids"] if isinstance(ids, dict) else ids, dtype=torch.long).reshape(-1)
    return torch.tensor(tokenizer(text).input_ids, dtype=torch.long)


# The fused matrices whose rows go int8 under ``w8a8``; ``down`` stays weight-only int8: its
# inputs, SiLU(gate) * up, spread widest, and rounding them too took the model further from fp32.
DYNAMIC_MATRICES = ("qkv", "o", "gate_up")


def quantize_q4(weight: torch.Tensor) -> Q4Blocks:
    """Q4_1 quantization (groups of 32 along the input dimension, asymmetric), its scales and
    minimums fp16 numbers as a GGUF stores them."""
    n, k = weight.shape
    w = weight.view(n, k // GROUP, GROUP)
    lo, hi = w.amin(-1).half().float(), w.amax(-1)
    d = ((hi - lo) / 15).clamp_min(1e-7).half().float()
    q = ((w - lo[..., None]) / d[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    return Q4Blocks(q, d, lo)


def quantize_q8(weight: torch.Tensor) -> Q8Blocks:
    """Q8_0 quantization (groups of 32 along the input dimension, symmetric: d = max |w| / 127, an
    fp16 number as a GGUF stores it), as llama.cpp quantizes."""
    n, k = weight.shape
    w = weight.float().view(n, k // GROUP, GROUP)
    d = (w.abs().amax(-1) / 127).clamp_min(1e-7).half().float()
    q = (w / d[..., None]).round().clamp(-127, 127).to(torch.int8).view(n, k)
    return Q8Blocks(q, d)


def row_invariant(kernel, in_features: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``kernel``'s rows are bit-identical whatever the number of rows in the call."""
    probe = probe_rows(in_features, dtype)
    return rows_match(kernel, kernel(probe), probe)


def supported_shape(fmt: str, weight_shape: tuple[int, ...]) -> str | None:
    n, k = weight_shape
    if fmt == "int4" and (k % GROUP or n % 8):
        return f"int4 needs in_features % {GROUP} == 0 and out_features % 8 == 0, not {n}x{k}"
    if fmt == "w4a8" and (k % GROUP or n % 16):
        return f"w4a8 needs in_features % {GROUP} == 0 and out_features % 16 == 0, not {n}x{k}"
    return None


class QuantizedLinear:
    """A weight-only kernel (``Int4Weight`` / ``Int8Weight``) with an optional bias, called like
    ``kernels.Linear`` on ``(..., in_features)``."""

    def __init__(self, kernel, bias: torch.Tensor | None = None) -> None:
        self.kernel = kernel
        self.bias = bias
        self.out_features, self.in_features = kernel.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


# The fused matrices FastTarget runs per layer (families.FusedLayer's fields), and the modules
# (transformers' names under ``model.layers.N``) each one concatenates.
FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def quantized_layers(layers: list, fmt: str, dtype: torch.dtype, q4_blocks: dict[str, Q4Blocks] | None = None,
                     activation_max: list[dict[str, torch.Tensor]] | None = None) -> tuple[list | None, str]:
    """``layers`` (``families.FusedLayer``) with their four projections run by ``fmt``'s kernel,
    and a note on where the weights came from; ``(None, why not)`` when the kernel is missing,
    does not fit a shape, or gives a row numbers that depend on how many rows share its call.

    int4 takes a GGUF's own Q4_1 codes (``q4_blocks``, from ``q4_1_blocks``) where every fused
    matrix has them, and otherwise quantizes the loaded weights (groups of 32, min/max). w8a8
    needs each layer's input maxima of ``DYNAMIC_MATRICES`` (``activation_max``, from
    ``FastTarget.activation_maxima``) for its smoothing factors."""
    import dataclasses

    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weights = {fmt!r}; allowed: {', '.join(WEIGHT_FORMATS)}")
    if fmt == "bf16":
        return layers, "bf16"
    if not kernel_available(fmt):
        return None, f"this PyTorch ({torch.__version__}) has no {fmt} weight-only CPU kernel"
    devices = {lin.weight.device.type for layer in layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)}
    if devices != {"cpu"}:
        return None, f"the {fmt} weight-only kernels run on CPU only (weights on {', '.join(sorted(devices))})"
    if fmt == "w8a8" and not int8_sums_exact():
        return None, ("torch._int_mm's int32 sums are not exact on this CPU (oneDNN without VNNI adds pairs of "
                      "byte products in 16 bits, which saturate)")
    from_file = fmt in ("int4", "w4a8") and q4_blocks is not None and all(
        f"model.layers.{i}.{name}" in q4_blocks for i in range(len(layers)) for names in FUSED.values() for name in names)
    if from_file:
        # The blocks must be the loaded model's weights (same rows, same order), to its dtype's rounding.
        for field in ("qkv", "gate_up"):
            blocks = Q4Blocks.cat([q4_blocks[f"model.layers.0.{name}"] for name in FUSED[field]])
            weight = getattr(layers[0], field).weight
            if blocks.q.shape != weight.shape or not torch.equal(blocks.dequantize().to(weight.dtype), weight):
                from_file = False
    out, checked = [], {}
    for i, layer in enumerate(layers):
        replaced = {}
        for field, names in FUSED.items():
            linear = getattr(layer, field)
            problem = supported_shape(fmt, tuple(linear.weight.shape))
            if problem:
                return None, problem
            if fmt == "int8" or (fmt == "w8a8" and field not in DYNAMIC_MATRICES):
                kernel = Int8Weight(linear.weight, dtype)
            elif fmt == "w8a8":
                if activation_max is None:
                    raise ValueError("w8a8 needs the layers' activation maxima (a calibration pass) for its smoothing factors")
                kernel = DynamicInt8Weight(linear.weight, smoothing_factors(activation_max[i][field], linear.weight))
            else:
                if from_file:
                    blocks = Q4Blocks.cat([q4_blocks[f"model.layers.{i}.{name}"] for name in names])
                    if tuple(blocks.q.shape) != tuple(linear.weight.shape):
                        return None, f"the GGUF's Q4_1 blocks for layer {i} {field} are {tuple(blocks.q.shape)}, the model's weight {tuple(linear.weight.shape)}"
                else:
                    blocks = quantize_q4(linear.weight.float())
                if fmt == "w4a8":
                    from .int8_rows import q4q8_dot_weight

                    kernel, why = q4q8_dot_weight(blocks)
                    if kernel is None:
                        return None, f"the w4a8 kernel does not run layer {i}'s {field}: {why}"
                else:
                    kernel = int4_kernel(blocks, dtype)
            # Kernels pick their code path by shape and row count, not by values: one probe per shape.
            shape = tuple(linear.weight.shape)
            if (shape, kernel.fmt) not in checked:
                checked[shape, kernel.fmt] = row_invariant(kernel, shape[1], dtype)
            if not checked[shape, kernel.fmt]:
                return None, (f"the {kernel.fmt} kernel gives a row different numbers depending on how many rows share "
                              f"the call on this CPU ({shape[0]}x{shape[1]})")
            replaced[field] = QuantizedLinear(kernel, linear.bias)
        out.append(dataclasses.replace(layer, **replaced))
    if fmt == "int8":
        note = "int8, one scale per output channel (requantized from the loaded weights)"
    elif fmt == "w8a8":
        note = ("w8a8: qkv, o and gate_up int8 x int8 (rows quantized per row after SmoothQuant factors from a "
                "calibration text), down int8 weight-only; weights requantized from the loaded ones")
    elif fmt == "w4a8":
        from .int8_rows import instructions

        note = ("w4a8: " + ("the GGUF's own Q4_1 blocks" if from_file else "Q4_1 groups of 32 (requantized from the "
                "loaded weights)") + f", the rows int8 per group of 32 as llama.cpp rounds them ({instructions()})")
    elif from_file:
        from .q4_dot import Q4DotWeight

        note = "int4 from the GGUF's own Q4_1 blocks " + (
            "(bf16 dot products, the file's scales and minimums)" if isinstance(kernel, Q4DotWeight) else
            "(scales and zeros in bf16)")
    else:
        note = "int4, groups of 32 (requantized from the loaded weights)"
    return out, note
