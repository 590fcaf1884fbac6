"""Weight-only int8 products through bf16 dot products, for AVX512-BF16 CPUs without AMX.

A verify block is 16 rows; inductor's weight-only int8 GEMM (``aoti_kernels``) has no bf16 dot
product on AVX-512: it widens rows and codes to fp32 and multiplies with FMA, so on an EPYC Zen 4
a 16-row pass of the LM head or of the MLP's ``down`` (the w8a8 pair's weight-only matrices)
cost about ten times a 2-row one. ``csrc/int8_dot.cpp`` widens the codes to bf16 (exact) and
multiplies with ``vdpbf16ps``, two products per lane and instruction: the 16-row pass then costs
about a quarter of that, the 2-row pass a little more (widening the codes costs more than it saves
at so few rows; ``scripts/int8_dot_speed.py``, figures in docs/BENCHMARKS-AMD.md). Where the CPU has AMX, inductor's kernel multiplies in AMX tiles and this
one is not used; without AVX512-BF16 it cannot run.

The C++ is compiled with the system's compiler on first use, once per machine, into the kernel
cache beside the AOTInductor kernels (no PyTorch headers: seconds), and called through ctypes.
Every output is summed in one fixed order whatever the number of rows, and a probe checks, as for
every kernel, that a row's numbers never change with the rows beside it and that they are the
eager int8 kernel's to rounding.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import torch

from .weight_formats import GROUP  # inputs per block of a GGUF's Q4_1 and Q8_0 matrices

SOURCE = Path(__file__).parent / "csrc" / "int8_dot.cpp"
# The C++ kernels are built for one of two instruction sets: AVX-512 with its BF16 and VNNI
# extensions, or AVX2 (+ FMA, F16C): q4_dot.cpp's int8-rows kernels only, csrc/avx2_as_avx512.h
# giving the AVX-512 intrinsics they use as two 256-bit halves, lane for lane.
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
ISA_FLAGS = {"avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni"),
             "avx2": ("-mavx2", "-mfma", "-mf16c", "-DDFLASH_AVX2")}
BLOCK = 16  # outputs per block of the packed codes (one fp32 register)


def _has_avx512_bf16() -> bool:
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return probe is not None and probe()


def build_isa() -> str | None:
    """The instruction set the kernels are built for here: ``avx512`` where PyTorch runs the CPU
    as AVX512 and it has AVX512-BF16, ``avx2`` where PyTorch runs it as AVX2 or AVX512 without
    BF16, None below (or without a C++ compiler). A process told to keep to fewer instructions
    (``isa_emulation``) counts as that CPU."""
    if cannot_build() is not None:
        return None
    return "avx512" if torch.backends.cpu.get_cpu_capability() == "AVX512" and _has_avx512_bf16() else "avx2"


def flags(isa: str | None = None) -> tuple[str, ...]:
    """The compiler's flags for a build for ``isa`` (default: ``build_isa()``'s)."""
    return (*COMMON_FLAGS, *ISA_FLAGS[isa or build_isa() or "avx512"])


def cannot_build() -> str | None:
    """Why no build of the C++ kernels runs here (None where one does): they need PyTorch to run
    the CPU as AVX2 or AVX512, and a C++ compiler."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"PyTorch runs this CPU as {capability}, not AVX2 or AVX512"
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return "no C++ compiler (CXX or g++)"
    return None


def cannot_run() -> str | None:
    """Why the bf16 dot-product kernels (this one, ``q4_dot``'s) cannot run here (None where they
    can): they need AVX512-BF16 (the AVX2 build leaves them out) and a C++ compiler."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return f"PyTorch runs this CPU as {torch.backends.cpu.get_cpu_capability()}, not AVX512"
    if not _has_avx512_bf16():
        return "this CPU has no AVX512-BF16"
    return cannot_build()


def unavailable() -> str | None:
    """Why the engine does not use the kernel here (None where it does): where it cannot run, and
    where AMX gives inductor's int8 GEMM its tiles (AMX hidden by ``isa_emulation`` counts as none)."""
    from .isa_emulation import VARIABLE, has_amx

    why = cannot_run()
    if why is None and has_amx() and os.environ.get(VARIABLE) is None:
        return "this CPU has AMX, whose tiles inductor's int8 GEMM uses"
    return why


def build_digest(source: Path, isa: str | None = None) -> str:
    """What a build of ``source`` depends on: its text, the headers beside it and the flags."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    return hashlib.sha256(source.read_bytes() + headers + " ".join(flags(isa)).encode()).hexdigest()[:12]


@functools.cache
def compiled(source: Path, isa: str | None = None) -> ctypes.CDLL:
    """The C++ file ``source`` compiled for ``isa`` (default: ``build_isa()``'s) and loaded, built
    into the cache first where it is missing (named by its content, the headers beside it and the
    flags, so an edited source or header builds anew)."""
    from .aoti_kernels import build_lock, kernel_dir

    library = kernel_dir() / f"{source.stem}-{build_digest(source, isa)}.so"
    with build_lock(library):
        if not library.exists():
            _compile(source, library, isa)
    return ctypes.CDLL(str(library))


def _library() -> ctypes.CDLL:
    lib = compiled(SOURCE)
    lib.int8_dot.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.int8_dot.restype = None
    lib.int8_group_dot.argtypes = lib.int8_dot.argtypes
    lib.int8_group_dot.restype = None
    return lib


def _compile(source: Path, library: Path, isa: str | None = None) -> None:
    """``source`` compiled into ``library`` (staged beside it, then moved in whole)."""
    with tempfile.TemporaryDirectory(dir=library.parent) as folder:
        staged = Path(folder) / library.name
        compiler = os.environ.get("CXX", "g++")
        done = subprocess.run([compiler, *flags(isa), str(source), "-o", str(staged)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-400:]}")
        os.replace(staged, library)


def pack(q: torch.Tensor) -> torch.Tensor:
    """Codes (N, K) in the kernel's layout (N / 16, K / 2, 32): a pair of K for 16 outputs at a time."""
    n, k = q.shape
    return q.reshape(n // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 1, 3).reshape(n // BLOCK, k // 2, 2 * BLOCK)


class Int8DotWeight:
    """``weight_formats.Int8Weight``'s product (``x @ (q * scales[:, None]).T``), the rows rounded to
    bf16 as inductor's int8 GEMM rounds them, the sums in fp32 and the result in ``x``'s dtype;
    ``add`` (the output's shape) is added in the same pass (a residual), the result then in its dtype."""

    fmt = "int8"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        self.shape = tuple(q.shape)
        self.packed = pack(q)
        self.scales = scales.float().contiguous()
        self._kernel = _library().int8_dot

    def __call__(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        dtype = x.dtype if add is None else add.dtype
        rows = x.reshape(-1, k).to(torch.bfloat16).contiguous()  # no copies where x is so already
        if add is not None:
            add = add.reshape(rows.shape[0], n).float().contiguous()
        return self.rows(rows, add).to(dtype).view(*x.shape[:-1], n)

    def rows(self, rows: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """The product of contiguous bf16 ``rows`` (M, K), plus contiguous fp32 ``add`` (M, N), in
        fp32: the call without the checks and conversions (a few microseconds a call, 30 calls a
        pass on SmolLM2)."""
        out = torch.empty(rows.shape[0], self.shape[0])
        self._kernel(rows.data_ptr(), rows.shape[0], self.shape[1], self.packed.data_ptr(), self.scales.data_ptr(),
                     None if add is None else add.data_ptr(), out.data_ptr(), self.shape[0], torch.get_num_threads())
        return out


def int8_dot_weight(eager) -> tuple[Int8DotWeight | None, str | None]:
    """An ``Int8Weight``'s product through this kernel where it runs here and its probe passes
    (``aoti_kernels.exact_here``: rows independent of their company, numbers the eager kernel's to
    rounding); else None and why."""
    from .aoti_kernels import exact_here

    why = unavailable()
    if why is not None:
        return None, why
    n, k = eager.shape
    if n % BLOCK or k % 2 or eager.q.device.type != "cpu":
        return None, f"a {n}x{k} matrix on {eager.q.device.type} (it takes CPU matrices of 16 outputs and pairs of inputs)"
    try:
        kernel = Int8DotWeight(eager.q, eager.scales)
    except (OSError, RuntimeError) as exc:  # the compiler or the loader failed: the other kernels run
        return None, f"building the kernel failed: {type(exc).__name__}: {str(exc)[:200]}"
    why = exact_here(kernel, eager)
    return (None, why) if why else (kernel, None)


class Q8DotWeight(Int8DotWeight):
    """A GGUF's Q8_0 matrix (``weight_formats.Q8Blocks``: int8 codes, one fp16 scale per 32 inputs)
    as the file has it: ``Int8DotWeight``'s calls, each group's sum times its own scale
    (``int8_group_dot``)."""

    def __init__(self, blocks) -> None:
        n, k = blocks.q.shape
        self.shape = (n, k)
        self.packed = pack(blocks.q)
        self.scales = blocks.d.float().reshape(n // BLOCK, BLOCK, k // GROUP).permute(0, 2, 1).contiguous()
        self._kernel = _library().int8_group_dot


def file_kernel(make: Callable, blocks) -> tuple[object | None, str | None]:
    """``make(blocks)``, a kernel for a GGUF matrix's blocks of 32 inputs (``Q8DotWeight``,
    ``q4_dot.Q4DotWeight``), where the matrix fits it, it builds and its probe passes (the file's
    weights' product to rounding, rows independent of their company); else None and why. The
    caller has checked that the kernel can run on this CPU."""
    from .kernels import file_product_refusal

    n, k = blocks.q.shape
    if n % BLOCK or k % GROUP:
        return None, f"a {n}x{k} matrix (it takes matrices of 16 outputs and groups of 32 inputs)"
    try:
        kernel = make(blocks)
    except (OSError, RuntimeError, ValueError) as exc:  # the compiler or the loader failed, or the blocks do not fit
        return None, f"building the kernel failed: {type(exc).__name__}: {str(exc)[:200]}"
    why = file_product_refusal(kernel, blocks.dequantize())
    return (None, why) if why else (kernel, None)


def q8_dot_weight(blocks) -> tuple[Q8DotWeight | None, str | None]:
    """``blocks``' (``weight_formats.Q8Blocks``) product through ``int8_group_dot`` where it runs
    here and its probe passes; else None and why."""
    why = cannot_run()
    return (None, why) if why else file_kernel(Q8DotWeight, blocks)
