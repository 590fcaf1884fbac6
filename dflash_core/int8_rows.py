"""A GGUF's matrices as llama.cpp multiplies them: the rows rounded to int8 per group of 32, the
products summed exactly in int32: on AVX512-VNNI, or on AVX2 (``csrc/avx2_as_avx512.h``).

``q4_dot`` multiplies a Q4_1 matrix's codes with bf16 rows through ``vdpbf16ps`` (two products per
lane and instruction): at a verify block's 16 rows the products are then bound by that
instruction. llama.cpp rounds each row's group of 32 inputs to int8 with its own scale (its Q8_1
rows for Q4_1 weights, Q8_0 for Q8_0) and sums byte products with ``vpdpbusd``, four per lane and
instruction. ``csrc/q4_dot.cpp``'s ``int8_rows_*`` entries do the same for:

* ``Q4Q8DotWeight``: a Q4_1 matrix (``weight_formats.Q4Blocks``, the file's fp16 scales and
  minimums) with int8 rows: ``weights = "w4a8"``, where ``q4_layers`` calls it with the layer's RMS
  norm, SiLU(gate) x up and the residual adds inside its calls, as it calls ``q4_dot``;
* ``Q8Q8DotWeight``: a Q8_0 matrix (``weight_formats.Q8Blocks``: int8 codes, a scale per group of
  32) with int8 rows: the w4a8 target's LM head (the GGUF's Q8_0 output matrix) and, quantized
  from its weights (``quantize_q8``), the drafter's matrices beside it (``q8_drafter``).

The rows' rounding is coarser than bf16's (a product's relative error 5-6e-3 against the same
product with bf16 rows, ``scripts/int8_dot_speed.py``), the numbers llama.cpp computes on the same file; each row's numbers are summed in one
fixed order whatever the rows beside it, so greedy DFlash still equals greedy AR, and a probe checks
it with the product of the file's weights, as for every kernel.
"""

from __future__ import annotations

import torch

from .int8_dot import BLOCK, GROUP, build_isa, cannot_build, file_kernel
from .q4_dot import library, packed
from .weight_formats import Q8Blocks

Q4, Q8 = 0, 1  # csrc/q4_dot.cpp's Format


def refusal() -> str | None:
    """Why these kernels cannot run here (None where they can): a build of the C++ kernels, and
    AVX512-VNNI where it is the AVX-512 build (the AVX2 build sums the byte products with
    ``vpmaddubsw`` and ``vpmaddwd``, exact as ``vpdpbusd``, as llama.cpp does on AVX2)."""
    why = cannot_build()
    if why:
        return why
    if build_isa() == "avx2":
        return None
    probe = getattr(torch.cpu, "_is_vnni_supported", None)
    return None if probe is not None and probe() else "this CPU has no AVX512-VNNI"


def instructions() -> str:
    """The instructions that sum the byte products here, for the load log."""
    return "AVX2" if build_isa() == "avx2" else "AVX512-VNNI"


def pack_q4(blocks) -> torch.Tensor:
    """A ``weight_formats.Q4Blocks`` in the Q4 layout, (N / 16, K / 32, 320) bytes: per group of 32
    inputs and 16 outputs, four runs of 64 bytes (byte 4 j + i of run t: output j's input 8 t + i
    in the low nibble, 8 t + 4 + i in the high one), then the fp16 scales and minimums."""
    n, k = blocks.q.shape
    q = blocks.q.to(torch.uint8).reshape(n // BLOCK, BLOCK, k // GROUP, 4, 2, 4)  # block, output, group, t, half, i
    codes = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(n // BLOCK, k // GROUP, 256)
    return packed(codes, blocks)


def pack_q8(blocks: Q8Blocks) -> torch.Tensor:
    """A ``weight_formats.Q8Blocks`` in the Q8 layout, (N / 16, K / 32, 640) bytes: per group of 32
    inputs and 16 outputs, eight runs of 64 signed codes (byte 4 j + i of run p: output j's input
    4 p + i), then the outputs' fp32 scales and their int32 128 x the sum of the group's codes."""
    n, k = blocks.q.shape
    q = blocks.q.to(torch.int8).reshape(n // BLOCK, BLOCK, k // GROUP, 8, 4)  # block, output, group, p, i
    codes = q.permute(0, 2, 3, 1, 4).reshape(n // BLOCK, k // GROUP, 512)
    scales = blocks.d.float().reshape(n // BLOCK, BLOCK, k // GROUP).permute(0, 2, 1)
    offsets = (128 * q.to(torch.int32).sum((-2, -1))).to(torch.int32).permute(0, 2, 1)
    parts = (codes, scales, offsets)
    return torch.cat([part.contiguous().view(torch.uint8) for part in parts], dim=-1).contiguous()


class Int8RowsWeight:
    """``x @ w.T`` with int8 rows for a packed matrix of ``format``; ``floats`` and ``glu`` are
    ``q4_dot.Q4DotWeight``'s calls (what ``q4_layers`` makes)."""

    fmt = "w4a8"
    format = Q4
    tolerance = 2e-2  # int8 rows per group of 32: a product's relative error against fp32 rows

    def __init__(self, shape: tuple[int, int], packed_weights: torch.Tensor) -> None:
        self.shape = shape
        self.packed = packed_weights
        lib = library()
        self._floats, self._glu = lib.int8_rows_floats, lib.int8_rows_glu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.shape[1]).float().contiguous()
        return self.floats(rows).to(x.dtype).view(*x.shape[:-1], self.shape[0])

    def floats(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0,
               add: torch.Tensor | None = None) -> torch.Tensor:
        """The product of contiguous fp32 rows ``x`` (M, K), after ``FastTarget.norm``'s RMS norm
        where ``norm`` (fp32 (K,)) is given; plus contiguous fp32 ``add`` (M, N); in fp32."""
        n, k = self.shape
        out = torch.empty(x.shape[0], n)
        self._floats(self.format, x.data_ptr(), x.shape[0], k, None if norm is None else norm.data_ptr(), eps,
                     self.packed.data_ptr(), None if add is None else add.data_ptr(), out.data_ptr(), n,
                     torch.get_num_threads())
        return out

    def glu(self, gate_up: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """The product of the rows SiLU(gate) x up (``gate_up`` (M, 2 K) contiguous fp32: a layer's
        gate and up products side by side); plus contiguous fp32 ``add`` (M, N); in fp32."""
        n, k = self.shape
        out = torch.empty(gate_up.shape[0], n)
        self._glu(self.format, gate_up.data_ptr(), gate_up.shape[0], k, self.packed.data_ptr(),
                  None if add is None else add.data_ptr(), out.data_ptr(), n, torch.get_num_threads())
        return out


class Q4Q8DotWeight(Int8RowsWeight):
    """A Q4_1 matrix (``weight_formats.Q4Blocks``) with int8 rows, as llama.cpp computes it."""

    def __init__(self, blocks) -> None:
        super().__init__(tuple(blocks.q.shape), pack_q4(blocks))


class Q8Q8DotWeight(Int8RowsWeight):
    """A Q8_0 matrix (``weight_formats.Q8Blocks``) with int8 rows, as llama.cpp computes it."""

    format = Q8

    def __init__(self, blocks: Q8Blocks) -> None:
        super().__init__(tuple(blocks.q.shape), pack_q8(blocks))


def q4q8_dot_weight(blocks) -> tuple[Q4Q8DotWeight | None, str | None]:
    """``blocks``' (``Q4Blocks``) product with int8 rows where it runs here and its probe passes
    (the file's weights' product to its rows' rounding, rows independent of their company); else
    None and why."""
    why = refusal()
    return (None, why) if why else file_kernel(Q4Q8DotWeight, blocks)


def q8q8_dot_weight(blocks: Q8Blocks) -> tuple[Q8Q8DotWeight | None, str | None]:
    """``blocks``' (``Q8Blocks``) product with int8 rows where it runs here and its probe passes; else None and why."""
    why = refusal()
    return (None, why) if why else file_kernel(Q8Q8DotWeight, blocks)
