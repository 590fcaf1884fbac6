"""A GGUF's Q4_1 matrices as the file has them, through bf16 dot products, on AVX512-BF16 CPUs.

``weights = "int4"`` runs a Q4_1 GGUF's own 4-bit codes. PyTorch's int4 kernel
(``weight_formats.Int4Weight``) takes the groups' scales and zero points in bf16, which rounds the
file's fp16 ones, and a 16-row pass costs several 2-row ones. ``csrc/q4_dot.cpp`` keeps the file's
scales and minimums (fp32: exact) and computes each group as ``d * sum(x * q) + m * sum(x)``, the
codes turned into bf16 by a table lookup and multiplied with ``vdpbf16ps`` (``int8_dot``'s
approach, half its bytes): on the EPYC measured, faster than both int8 kernels at one and two rows
and about ``int8_dot``'s speed at sixteen (``scripts/int8_dot_speed.py``; docs/BENCHMARKS-AMD.md). Built like ``int8_dot``'s kernel
(once per machine, the system's compiler) wherever ``int8_dot.cannot_run`` allows, after the
probe every kernel passes: rows independent of their company, a lone row included, and the
product of the file's weights to rounding.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .int8_dot import BLOCK, cannot_run, compiled

SOURCE = Path(__file__).parent / "csrc" / "q4_dot.cpp"
GROUP = 32  # inputs per group of a Q4_1 block


@functools.cache
def _kernel():
    lib = compiled(SOURCE)
    lib.q4_dot.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.q4_dot.restype = None
    return lib.q4_dot


def pack(blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``weight_formats.Q4Blocks`` in the kernel's layout: codes (N / 16, K / 4, 32) bytes, two
    input pairs for 16 outputs in each run of 32 (see the C++), scales and minimums (N / 16, K / 32, 16)."""
    n, k = blocks.q.shape
    q = blocks.q.to(torch.uint8).reshape(n // BLOCK, BLOCK, k // 4, 2, 2)  # block, output, quad, half, s
    codes = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(n // BLOCK, k // 4, 2 * BLOCK)

    def per_block(values: torch.Tensor) -> torch.Tensor:
        return values.float().reshape(n // BLOCK, BLOCK, k // GROUP).permute(0, 2, 1).contiguous()

    return codes.contiguous(), per_block(blocks.d), per_block(blocks.m)


class Q4DotWeight:
    """``x @ w.T`` for ``blocks`` (``weight_formats.Q4Blocks``), the rows rounded to bf16, the
    sums in fp32, the result in ``x``'s dtype: a drop-in kernel for ``weight_formats.QuantizedLinear``."""

    fmt = "int4"

    def __init__(self, blocks) -> None:
        self.shape = tuple(blocks.q.shape)
        self.codes, self.scales, self.minimums = pack(blocks)
        self._kernel = _kernel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        rows = x.reshape(-1, k).to(torch.bfloat16).contiguous()
        sums = torch.empty(rows.shape[0], k // GROUP)
        out = torch.empty(rows.shape[0], n)
        self._kernel(rows.data_ptr(), rows.shape[0], k, self.codes.data_ptr(), self.scales.data_ptr(),
                     self.minimums.data_ptr(), sums.data_ptr(), out.data_ptr(), n, torch.get_num_threads())
        return out.to(x.dtype).view(*x.shape[:-1], n)


def q4_dot_weight(blocks) -> tuple[Q4DotWeight | None, str | None]:
    """``blocks``' product through this kernel where it runs here and its probe passes; else None
    and why."""
    from .kernels import probe_rows, rows_independent

    why = cannot_run()
    if why is not None:
        return None, why
    n, k = blocks.q.shape
    if n % BLOCK or k % GROUP:
        return None, f"a {n}x{k} matrix (it takes matrices of 16 outputs and groups of 32 inputs)"
    try:
        kernel = Q4DotWeight(blocks)
    except (OSError, RuntimeError) as exc:  # the compiler or the loader failed: PyTorch's int4 kernel runs
        return None, f"building the kernel failed: {type(exc).__name__}: {str(exc)[:200]}"
    probe = probe_rows(k, torch.float32)
    with torch.inference_mode():
        own = kernel(probe)
        want = probe.bfloat16().float() @ blocks.dequantize().T
        if not (own - want).norm() <= 1e-4 * want.norm():
            return None, "its results are not the file's weights' product"
        if not rows_independent(kernel, own, probe):
            return None, "its rows change with the number of rows in a call"
    return kernel, None
