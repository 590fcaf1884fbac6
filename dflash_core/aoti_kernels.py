"""The target's matrices through inductor's C++ GEMM, built ahead of time (AOTInductor), on CPU.

Where the target runs in fp32 (a CPU without a bf16 matrix path), oneDNN's packed fp32 kernel reads
the weights at well under the memory's bandwidth at a few rows; inductor's C++ GEMM (max-autotune)
does better there (docs/BENCHMARKS.md, ``scripts/weight_formats.py --aoti``). Compiling it costs
minutes in every process, so the kernel is built ahead of time (AOTInductor) per matrix shape,
once per machine and PyTorch, as a shared object holding no weights, kept in the cache
(``cache_root()/aoti``). Every matrix of that shape gets its own runner of that object with its
own weight swapped in, packed in the kernel's blocked layout.

Lossless decoding needs every row's numbers independent of the rows beside it, so a matrix runs
here only after a probe on this machine finds its rows identical for every row count of
``PROBE_ROWS`` and for a lone row, and its result close to ``F.linear``'s (which also proves that
the blocked layout was guessed right); otherwise it stays on ``kernels.Linear``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import threading
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F

from .kernels import Linear, probe_rows, rows_match

KERNELS = ("onednn", "aoti")
# Register blocking of the C++ GEMM along the output features (vector widths x register tiles);
# which one a kernel uses is found by a probe when it is built.
BLOCK_CANDIDATES = (24, 16, 32, 8, 48, 64)
_BUILD_LOCK = threading.Lock()


def available() -> bool:
    """Whether this PyTorch can run AOTInductor kernels on CPU and this machine can build them
    (a C++ compiler). Asks without importing inductor, which takes seconds."""
    import importlib.util
    import shutil

    return (hasattr(torch._C, "_aoti") and hasattr(torch._C._aoti, "AOTIModelContainerRunnerCpu")
            and importlib.util.find_spec("torch._inductor") is not None
            and shutil.which(os.environ.get("CXX", "g++")) is not None)


def _machine() -> str:
    """What a built kernel depends on: PyTorch, the CPU it was compiled for, the thread count."""
    cpu = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = " ".join(line for line in lines if line.startswith(("model name", "flags")))[:4096] or cpu
    except OSError:
        pass
    digest = hashlib.sha256(f"{torch.__version__}|{cpu}|threads={torch.get_num_threads()}".encode()).hexdigest()[:16]
    return f"torch-{torch.__version__.replace('+', '-')}-{digest}"


def kernel_dir() -> Path:
    from .loading import cache_root

    return cache_root() / "aoti" / _machine()


class _OneMatrix(torch.nn.Module):
    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def blocked(weight: torch.Tensor, block: int) -> torch.Tensor:
    """``weight`` (N, K) in the C++ GEMM's layout: (N / block, K, block), output features inner."""
    n, k = weight.shape
    return weight.reshape(n // block, block, k).transpose(1, 2).contiguous()


def _runner(library: Path):
    from torch._C._aoti import AOTIModelContainerRunnerCpu

    return AOTIModelContainerRunnerCpu(str(library), 1)


def _swap_in(runner, name: str, weight: torch.Tensor) -> None:
    # user_managed: the runner reads our tensor in place (the caller keeps it alive).
    runner.update_constant_buffer({name: weight}, False, True, True)


def _build(out_features: int, in_features: int, dtype: torch.dtype, library: Path) -> dict:
    """Compile the kernel for one shape into ``library`` (a shared object holding no weights) and
    find the name of its one constant, the weight, and the weight's blocked layout."""
    import torch._inductor  # seconds to import: only when a kernel is built

    module = _OneMatrix(out_features, in_features, dtype).eval()
    rows = torch.export.Dim("rows", min=1, max=1 << 16)
    configs = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP",
               "aot_inductor.package_constants_in_so": False}
    with tempfile.TemporaryDirectory(dir=library.parent) as folder:
        package = Path(folder) / "package.pt2"
        with torch.no_grad():
            program = torch.export.export(module, (torch.zeros(2, in_features, dtype=dtype),), dynamic_shapes=({0: rows},))
            torch._inductor.aoti_compile_and_package(program, package_path=str(package), inductor_configs=configs)
        with zipfile.ZipFile(package) as archive:
            members = [m for m in archive.namelist() if m.endswith(".so")]
            if len(members) != 1:
                raise RuntimeError(f"expected one shared object in the package, found {members}")
            staged = Path(folder) / library.name
            staged.write_bytes(archive.read(members[0]))
        runner = _runner(staged)
        names = list(runner.get_constant_names_to_original_fqns())
        if len(names) != 1:
            raise RuntimeError(f"expected one constant in the kernel, found {names}")
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
        probe = probe_rows(in_features, dtype)
        truth = F.linear(probe, weight)
        for block in BLOCK_CANDIDATES:
            if out_features % block:
                continue
            packed = blocked(weight, block)
            try:
                _swap_in(runner, names[0], packed)
                with torch.inference_mode():
                    close = torch.allclose(runner.run([probe])[0], truth, rtol=1e-4, atol=1e-4)
            except RuntimeError:
                continue
            if close:
                meta = {"constant": names[0], "block": block}
                os.replace(staged, library)
                library.with_suffix(".json").write_text(json.dumps(meta))
                return meta
    raise RuntimeError(f"none of the blocked layouts {BLOCK_CANDIDATES} gives the kernel's products")


def kernel_library(out_features: int, in_features: int, dtype: torch.dtype) -> tuple[Path, dict]:
    """The compiled kernel for an (out, in) matrix in ``dtype``, built here first if the cache lacks it."""
    folder = kernel_dir()
    library = folder / f"linear-{out_features}x{in_features}-{str(dtype).removeprefix('torch.')}.so"
    meta_file = library.with_suffix(".json")
    with _BUILD_LOCK:
        if not (library.exists() and meta_file.exists()):
            folder.mkdir(parents=True, exist_ok=True)
            return library, _build(out_features, in_features, dtype, library)
    return library, json.loads(meta_file.read_text())


class AotiLinear:
    """``x @ weight.T`` through a compiled kernel with ``weight`` swapped in (see the module's
    docstring); ``weight`` stays available unchanged (the drafter shares the target's LM head)."""

    def __init__(self, weight: torch.Tensor, library: Path, meta: dict) -> None:
        self.weight = weight
        self.bias = None
        self.packed_weight = blocked(weight, meta["block"])  # the runner reads it in place
        self.runner = _runner(library)
        _swap_in(self.runner, meta["constant"], self.packed_weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.runner.run([x.contiguous()])[0]
        return self.runner.run([x.reshape(-1, x.shape[-1]).contiguous()])[0].unflatten(0, x.shape[:-1])


def exact_here(kernel: AotiLinear) -> str | None:
    """Why ``kernel`` may not replace ``F.linear`` here (None when it may): its rows must not change
    with the rows beside them, a lone row included, and its numbers must be ``F.linear``'s to
    rounding."""
    probe = probe_rows(kernel.weight.shape[1], kernel.weight.dtype)
    with torch.inference_mode():
        own = kernel(probe)
        if not torch.allclose(own, F.linear(probe, kernel.weight), rtol=1e-4, atol=1e-4):
            return "its results are not F.linear's"
        if not (rows_match(kernel, own, probe) and torch.equal(kernel(probe[:1]), own[:1])):
            return "its rows change with the number of rows in a call"
    return None


def aoti_linear(linear: Linear) -> tuple[AotiLinear | Linear, str | None]:
    """``linear`` through the C++ GEMM where that is exact here, else ``linear`` itself and why."""
    weight = linear.weight
    if linear.bias is not None:
        return linear, "a matrix with a bias (not built)"
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        # Measured for fp32 only, where it wins (docs/BENCHMARKS.md); bf16 CPUs have oneDNN's bf16 path.
        return linear, f"only fp32 matrices on CPU are built, not {weight.dtype} on {weight.device.type}"
    try:
        library, meta = kernel_library(weight.shape[0], weight.shape[1], weight.dtype)
        kernel = AotiLinear(weight, library, meta)
    except Exception as exc:  # a compiler or AOTInductor failure here: oneDNN keeps running
        return linear, f"building or loading the kernel failed: {type(exc).__name__}: {str(exc)[:200]}"
    why = exact_here(kernel)
    return (linear, why) if why else (kernel, None)
