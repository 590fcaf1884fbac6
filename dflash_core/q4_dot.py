"""A GGUF's Q4_1 matrices as the file has them, through bf16 dot products, on AVX512-BF16 CPUs.

``weights = "int4"`` runs a Q4_1 GGUF's own 4-bit codes. PyTorch's int4 kernel
(``weight_formats.Int4Weight``) takes the groups' scales and zero points in bf16, which rounds the
file's fp16 ones, and a 16-row pass costs several 2-row ones. ``csrc/q4_dot.cpp`` reads the
file's codes, fp16 scales and minimums as the file stores them (20 bytes per 32 weights) and
computes each group as ``d * sum(x * q) + m * sum(x)``, each code made the bf16 number
``1 + q / 16`` in two instructions and multiplied with ``vdpbf16ps`` (``int8_dot``'s approach,
about half its bytes): on the EPYC measured, faster than both int8 kernels at one and two rows and
about ``int8_dot``'s speed at sixteen (``scripts/int8_dot_speed.py``; docs/BENCHMARKS-AMD.md).
``q4_layers`` calls it with fp32 rows, the layer's RMS norm and residual add done in the same
call. Built like ``int8_dot``'s kernel
(once per machine, the system's compiler) wherever ``int8_dot.cannot_run`` allows, after the
probe every kernel passes: rows independent of their company, a lone row included, and the
product of the file's weights to rounding.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .int8_dot import BLOCK, GROUP, build_isa, cannot_run, compiled, file_kernel

SOURCE = Path(__file__).parent / "csrc" / "q4_dot.cpp"


@functools.cache
def library(isa: str | None = None):
    """The kernels' library built for ``isa`` (default: ``int8_dot.build_isa()``'s), its entries typed."""
    lib = compiled(SOURCE, isa)
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    bf16 = (isa or build_isa()) == "avx512"  # the bf16 dot products are built for AVX512-BF16 only
    if bf16:
        lib.q4_dot.argtypes = [pointer, size, size, pointer, pointer, pointer, pointer, size, ctypes.c_int]
        lib.q4_dot_floats.argtypes = [pointer, size, size, pointer, ctypes.c_float, pointer, pointer, pointer, pointer,
                                      pointer, size, ctypes.c_int]
        lib.q4_dot_glu.argtypes = [pointer, size, size, pointer, pointer, pointer, pointer, pointer, size, ctypes.c_int]
    lib.rope_split.argtypes = [pointer, size, size, size, size, pointer, pointer, size, pointer, pointer,
                               ctypes.c_float, ctypes.c_int, pointer, pointer, pointer]
    lib.int8_rows_floats.argtypes = [ctypes.c_int, pointer, size, size, pointer, ctypes.c_float, pointer, pointer,
                                     pointer, size, ctypes.c_int]
    lib.int8_rows_glu.argtypes = [ctypes.c_int, pointer, size, size, pointer, pointer, pointer, size, ctypes.c_int]
    lib.write_and_attend.argtypes = [pointer] * 6 + [size] * 5 + [pointer, ctypes.c_int]  # dot_attention
    lib.w4a8_pass.argtypes = ([pointer, size, pointer] + [size] * 6 + [pointer] * 5 + [size] * 2 +  # q4_layers.FusedPass
                              [ctypes.c_float, pointer, pointer, pointer, size, size, pointer, pointer, ctypes.c_int])
    lib.q8_drafter_pass.argtypes = ([pointer, size, pointer, pointer, size, pointer, size, size, pointer, pointer,
                                     pointer] + [size] * 5 + [pointer] * 6 + [size] * 3 + [ctypes.c_int])  # q8_drafter
    bf16_entries = (lib.q4_dot, lib.q4_dot_floats, lib.q4_dot_glu) if bf16 else ()
    for function in (*bf16_entries, lib.rope_split, lib.int8_rows_floats, lib.int8_rows_glu, lib.write_and_attend,
                     lib.w4a8_pass, lib.q8_drafter_pass):
        function.restype = None
    return lib


GROUP_BYTES = 320  # one group of 32 inputs for 16 outputs: codes 256 bytes, then 16 fp16 scales and minimums


def _scales(blocks) -> list[torch.Tensor]:
    """The blocks' fp16 scales and minimums per block of 16 outputs, (N / 16, K / 32, 16) each."""
    n, k = blocks.q.shape

    def per_block(values: torch.Tensor) -> torch.Tensor:
        half = values.half()
        if not torch.equal(half.float(), values.float()):
            raise ValueError("q4_dot takes Q4_1 scales and minimums that are fp16 numbers, as a GGUF stores them")
        return half.reshape(n // BLOCK, BLOCK, k // GROUP).permute(0, 2, 1)

    return [per_block(blocks.d), per_block(blocks.m)]


def packed(codes: torch.Tensor, blocks) -> torch.Tensor:
    """``codes`` (N / 16, K / 32, bytes) followed, per group, by the blocks' fp16 scales and minimums."""
    parts = (codes, *_scales(blocks))
    return torch.cat([part.contiguous().view(torch.uint8) for part in parts], dim=-1).contiguous()


def pack(blocks) -> torch.Tensor:
    """A ``weight_formats.Q4Blocks`` in the bf16 kernel's layout, (N / 16, K / 32, 320) bytes: per
    group of 32 inputs and 16 outputs, four runs of 32 16-bit words (word 2 j + s of run t: output
    j's input 8 t + 2 v + s in nibble v), then the outputs' scales and minimums in fp16 (the file's)."""
    n, k = blocks.q.shape
    q = blocks.q.to(torch.int32).reshape(n // BLOCK, BLOCK, k // GROUP, 4, 4, 2)  # block, output, group, t, v, s
    words = (q << torch.tensor([0, 4, 8, 12]).view(4, 1)).sum(-2)  # nibble v of each (output, t, s) word
    codes = words.permute(0, 2, 3, 1, 4).reshape(n // BLOCK, k // GROUP, 4 * 2 * BLOCK).to(torch.uint16)
    return packed(codes, blocks)


class Q4DotWeight:
    """``x @ w.T`` for ``blocks`` (``weight_formats.Q4Blocks``), the rows rounded to bf16, the
    sums in fp32, the result in ``x``'s dtype: a drop-in kernel for ``weight_formats.QuantizedLinear``.
    ``rows`` and ``floats`` are the calls without conversions that ``q4_layers`` makes, a residual
    added in the same pass."""

    fmt = "int4"

    def __init__(self, blocks) -> None:
        self.shape = tuple(blocks.q.shape)
        self.packed = pack(blocks)
        lib = library()
        self._kernel, self._floats, self._glu = lib.q4_dot, lib.q4_dot_floats, lib.q4_dot_glu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.shape[1]).to(torch.bfloat16).contiguous()
        return self.rows(rows).to(x.dtype).view(*x.shape[:-1], self.shape[0])

    def rows(self, rows: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """The product of contiguous bf16 ``rows`` (M, K), plus contiguous fp32 ``add`` (M, N), in fp32."""
        n, k = self.shape
        sums = torch.empty(rows.shape[0], k // GROUP)
        out = torch.empty(rows.shape[0], n)
        self._kernel(rows.data_ptr(), rows.shape[0], k, self.packed.data_ptr(), sums.data_ptr(),
                     None if add is None else add.data_ptr(), out.data_ptr(), n, torch.get_num_threads())
        return out

    def floats(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0,
               add: torch.Tensor | None = None) -> torch.Tensor:
        """The product of contiguous fp32 rows ``x`` (M, K), rounded to bf16 in the kernel, after
        ``FastTarget.norm``'s RMS norm where ``norm`` (fp32 (K,)) is given; plus contiguous fp32
        ``add`` (M, N); in fp32."""
        n, k = self.shape
        m = x.shape[0]
        scratch = torch.empty(m, k, dtype=torch.bfloat16)
        sums = torch.empty(m, k // GROUP)
        out = torch.empty(m, n)
        self._floats(x.data_ptr(), m, k, None if norm is None else norm.data_ptr(), eps, scratch.data_ptr(),
                     self.packed.data_ptr(), sums.data_ptr(), None if add is None else add.data_ptr(), out.data_ptr(),
                     n, torch.get_num_threads())
        return out


    def glu(self, gate_up: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """The product of the rows SiLU(gate) x up, ``gate_up`` (M, 2 K) contiguous fp32 being a
        layer's gate and up products side by side, rounded to bf16 in the kernel; plus contiguous
        fp32 ``add`` (M, N); in fp32."""
        n, k = self.shape
        m = gate_up.shape[0]
        scratch = torch.empty(m, k, dtype=torch.bfloat16)
        sums = torch.empty(m, k // GROUP)
        out = torch.empty(m, n)
        self._glu(gate_up.data_ptr(), m, k, scratch.data_ptr(), self.packed.data_ptr(), sums.data_ptr(),
                  None if add is None else add.data_ptr(), out.data_ptr(), n, torch.get_num_threads())
        return out


def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
               q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0,
               rotate_half: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's QKV product ``qkv`` (T, (heads + 2 kv_heads) D), contiguous fp32, as attention
    takes it: queries and keys with ``FastTarget.rope`` applied (``cos``, ``sin``, contiguous:
    (T, heads + kv_heads, D), a row per head, or (T, D) for all heads), each head first RMS-normed
    where ``q_norm`` / ``k_norm`` (fp32 (D,), the drafter's) are given, and with ``rotate_half``
    the drafter's rotation (``drafter.apply_rope``: the rolled first half negated) instead; and
    values; each contiguous, in one call."""
    t, d = qkv.shape[0], cos.shape[-1]
    table_heads = 1 if cos.dim() == 2 else cos.shape[1]
    q, k, v = torch.empty(t, heads, d), torch.empty(t, kv_heads, d), torch.empty(t, kv_heads, d)
    library().rope_split(qkv.data_ptr(), t, heads, kv_heads, d, cos.data_ptr(), sin.data_ptr(), table_heads,
                         None if q_norm is None else q_norm.data_ptr(), None if k_norm is None else k_norm.data_ptr(),
                         eps, int(rotate_half), q.data_ptr(), k.data_ptr(), v.data_ptr())
    return q, k, v


def q4_dot_weight(blocks) -> tuple[Q4DotWeight | None, str | None]:
    """``blocks``' product through this kernel where it runs here and its probe passes; else None
    and why (scales that are not fp16 numbers among the reasons: PyTorch's int4 kernel runs them)."""
    why = cannot_run()
    return (None, why) if why else file_kernel(Q4DotWeight, blocks)

