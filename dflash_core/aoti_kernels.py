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

With ``weights = "int8"`` the layers' matrices are int8 with one scale per output channel
(``weight_formats.Int8Weight``); inductor has a weight-only int8 C++ GEMM for them too, reading a
quarter of fp32's bytes. Its only input dtype on AVX2 / AVX-512 is bf16, so rows are rounded to
bf16 on the way in and the result (bf16) widened back, as ``weight_formats.Int4Weight`` does.
The drafter's matrices run these kernels too where the target's do (``drafter_kernels``).
Whole decoder layers compiled around attention, tried before the matrices, are ``aoti_layers``'.
"""

from __future__ import annotations

import contextlib
import functools
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

from . import int8_dot, isa_emulation
from .kernels import Linear, probe_rows, rows_independent

KERNELS = ("onednn", "aoti")
# Register blocking of the C++ GEMM along the output features (vector widths x register tiles);
# which one a kernel uses is found by a probe when it is built.
BLOCK_CANDIDATES = (24, 16, 32, 8, 48, 64)
# Rows of the inner dimension interleaved within a block: 1 on AVX2 / AVX-512; on AMX the GEMM
# reads its weight in VNNI layout (pairs of K for bf16 tiles, fours for int8 ones), also found by
# the probe.
VNNI_CANDIDATES = (1, 2, 4)
BUILD_LOCK = threading.Lock()


def available() -> bool:
    """Whether this PyTorch can run AOTInductor kernels on CPU and this machine can build them
    (a C++ compiler). Asks without importing inductor, which takes seconds."""
    import importlib.util
    import shutil

    return (hasattr(torch._C, "_aoti") and hasattr(torch._C._aoti, "AOTIModelContainerRunnerCpu")
            and importlib.util.find_spec("torch._inductor") is not None
            and shutil.which(os.environ.get("CXX", "g++")) is not None)


def _machine() -> str:
    """What a built kernel depends on: PyTorch, the CPU it was compiled for, the thread count, and
    the instruction sets a process was told to keep to (``isa_emulation``: inductor's code differs)."""
    cpu = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = " ".join(line for line in lines if line.startswith(("model name", "flags")))[:4096] or cpu
    except OSError:
        pass
    limits = "|".join(f"{name}={os.environ[name]}" for name in ("ATEN_CPU_CAPABILITY", isa_emulation.VARIABLE)
                      if os.environ.get(name))
    machine = f"{torch.__version__}|{cpu}|threads={torch.get_num_threads()}" + (f"|{limits}" if limits else "")
    digest = hashlib.sha256(machine.encode()).hexdigest()[:16]
    return f"torch-{torch.__version__.replace('+', '-')}-{digest}"


def spec_digest(spec) -> str:
    """A short name for what a kernel was built for (a dataclass of its shapes and math), for the
    kernel's file name in the cache."""
    from dataclasses import asdict, fields

    # A field marked ``omitted_at_default`` (one added after kernels were built) is left out at its
    # default, so that those kernels keep their names in the cache.
    described = asdict(spec)
    for f in fields(spec):
        if f.metadata.get("omitted_at_default") and described[f.name] == f.default:
            del described[f.name]
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:12]


def kernel_dir() -> Path:
    from .loading import cache_root

    return cache_root() / "aoti" / _machine()


@functools.cache
def _int8_micro_gemm(rows: torch.dtype) -> tuple[bool | None, str]:
    """Whether inductor's table of micro-kernels has a vector kernel for ``rows`` (int8 or uint8)
    times int8 weights on this CPU (None: inductor cannot say), and the vector instructions it
    picked. Asked of the table itself, which differs by instruction set and release, rather than
    assumed from the CPU's name."""
    try:
        import torch._inductor.compile_fx  # noqa: F401  (imports inductor's lowerings in their order)
        from torch._inductor.codegen.cpp_micro_gemm import create_micro_gemm
        from torch._inductor.cpu_vec_isa import pick_vec_isa
        from torch._inductor.graph import GraphLowering
        from torch._inductor.virtualized import V

        with V.set_graph_handler(GraphLowering(torch.fx.symbolic_trace(torch.nn.Identity()))):
            kernel = create_micro_gemm("probe", 16, 64, 64, rows, torch.int8, torch.int32, torch.int32, use_ref=False)
        return kernel is not None, str(pick_vec_isa()) or "no vector instructions"
    except Exception:  # an inductor without these internals: nothing known
        return None, "unknown"


def int8_rows_gemm_missing() -> str | None:
    """Why inductor's C++ GEMM would run ``w8a8``'s int8 x int8 products (rows and weights both
    signed int8) through its reference loops on this CPU, one multiply at a time, or None where it
    has a vector kernel for them (in PyTorch 2.13: AMX tiles only). None too where inductor cannot
    say: the build and the probes then decide as for every kernel."""
    found, isa = _int8_micro_gemm(torch.int8)
    return None if found is not False else f"inductor has no int8 x int8 kernel for this CPU ({isa}), only its reference loops"


def w8a8_rows() -> tuple[str | None, str | None]:
    """How ``w8a8``'s quantized rows enter inductor's int8 GEMM here: "int8" where it has a vector
    kernel for signed rows (AMX); "uint8" (the codes shifted by 128, a zero point the GEMM takes
    off exactly through its column sums) where it has one for unsigned rows only (AVX-512 VNNI, as
    on an EPYC Zen 4: its ``vpdpbusd`` multiplies unsigned by signed bytes, summing in int32
    without saturation); None where it has neither, with why."""
    missing = int8_rows_gemm_missing()
    if missing is None:
        return "int8", None
    if _int8_micro_gemm(torch.uint8)[0]:
        return "uint8", None
    return None, f"{missing}; none for unsigned rows either"


# What a kernel is built for: the weight's storage ("float32", or "int8" with per-channel scales).
MATRIX_KINDS = ("float32", "int8")
INT8_ROWS = torch.bfloat16  # the int8 C++ GEMM's input (and output) dtype


class _OneMatrix(torch.nn.Module):
    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class _OneInt8Matrix(torch.nn.Module):
    """The op inductor lowers to its weight-only int8 C++ GEMM."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, dtype=INT8_ROWS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)


def _kind_parts(kind: str, out_features: int, in_features: int) -> tuple[torch.nn.Module, torch.dtype]:
    """The module a kernel of ``kind`` is compiled from, and its rows' dtype."""
    if kind == "float32":
        return _OneMatrix(out_features, in_features, torch.float32).eval(), torch.float32
    if kind == "int8":
        return _OneInt8Matrix(out_features, in_features).eval(), INT8_ROWS
    raise ValueError(f"kernel kind {kind!r}; allowed: {', '.join(MATRIX_KINDS)}")


def _probe_weights(kind: str, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A fixed weight (and scales) of ``kind`` to find the blocked layout with."""
    generator = torch.Generator().manual_seed(0)
    if kind == "int8":
        weight = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
        return weight, (torch.rand(out_features, generator=generator) / 64 + 1 / 128).to(INT8_ROWS)
    return torch.randn(out_features, in_features, generator=generator), None


def _close(got: torch.Tensor, want: torch.Tensor, kind: str) -> bool:
    """Whether a kernel's products are the reference's to its rounding: fp32's, or bf16 outputs'
    for int8 (a wrong layout is off by the size of the products themselves)."""
    if kind == "float32":
        return torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    got, want = got.float(), want.float()
    return bool((got - want).norm() <= 1e-2 * want.norm())


def blocked(weight: torch.Tensor, block: int, vnni: int = 1) -> torch.Tensor:
    """``weight`` (N, K) in the C++ GEMM's layout: (N / block, K, block), output features inner,
    and with ``vnni`` > 1 each run of ``vnni`` rows of K interleaved (AMX's VNNI layout)."""
    n, k = weight.shape
    out = weight.reshape(n // block, block, k).transpose(1, 2)  # (N / block, K, block)
    if vnni > 1:
        out = out.reshape(n // block, k // vnni, vnni, block).transpose(2, 3)  # (N / block, K / vnni, block, vnni)
    return out.contiguous().reshape(n // block, k, block)


def layouts(out_features: int, in_features: int) -> list[tuple[int, int]]:
    """The (block, vnni) layouts a kernel of this shape may read its weight in, likeliest first."""
    return [(block, vnni) for vnni in VNNI_CANDIDATES for block in BLOCK_CANDIDATES
            if out_features % block == 0 and in_features % vnni == 0]


def load_runner(library: Path):
    from torch._C._aoti import AOTIModelContainerRunnerCpu

    return AOTIModelContainerRunnerCpu(str(library), 1)


def swap_in(runner, constants: dict[str, torch.Tensor]) -> None:
    # user_managed: the runner reads our tensors in place (the caller keeps them alive).
    runner.update_constant_buffer(constants, False, True, True)


def compile_shared_object(module: torch.nn.Module, example: tuple, folder: Path, name: str,
                          dynamic_shapes: tuple | None = None, configs: dict | None = None,
                          drop_metadata_asserts: bool = False) -> tuple[Path, str]:
    """``module`` compiled by AOTInductor (inductor's C++ GEMMs, max-autotune, frozen weights left
    out of the object; ``configs`` overrides), dimension 0 of every input (the rows) dynamic unless
    ``dynamic_shapes`` says otherwise: the shared object, staged in ``folder`` as ``name``, and the
    generated C++ source (it declares the constants' shapes). ``drop_metadata_asserts``: remove
    the ``_assert_tensor_metadata`` checks export adds after dtype casts first (no-ops at run
    time, but a second user of the value they check, which stops inductor's fusion patterns)."""
    import torch._inductor  # seconds to import: only when a kernel is built

    rows = torch.export.Dim("rows", min=1, max=1 << 16)
    configs = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP",
               "aot_inductor.package_constants_in_so": False, **(configs or {})}
    package = folder / "package.pt2"
    with torch.no_grad():
        shapes = dynamic_shapes if dynamic_shapes is not None else tuple({0: rows} for _ in example)
        program = torch.export.export(module, example, dynamic_shapes=shapes)
        if drop_metadata_asserts:
            graph = program.graph_module.graph
            for node in [n for n in graph.nodes if n.target == torch.ops.aten._assert_tensor_metadata.default]:
                graph.erase_node(node)
            program.graph_module.recompile()
        torch._inductor.aoti_compile_and_package(program, package_path=str(package), inductor_configs=configs)
    with zipfile.ZipFile(package) as archive:
        members = [m for m in archive.namelist() if m.endswith(".so")]
        if len(members) != 1:
            raise RuntimeError(f"expected one shared object in the package, found {members}")
        source = "".join(archive.read(m).decode(errors="replace") for m in archive.namelist() if m.endswith(".cpp"))
        staged = folder / name
        staged.write_bytes(archive.read(members[0]))
    return staged, source


def install(staged: Path, library: Path, meta: dict) -> dict:
    """A built and probed kernel into the cache, its metadata beside it."""
    os.replace(staged, library)
    library.with_suffix(".json").write_text(json.dumps(meta))
    return meta


@contextlib.contextmanager
def build_lock(library: Path):
    """Held while ``library`` is looked up and built: by one thread of this process (``BUILD_LOCK``)
    and one process of this machine (a lock file beside it), so that processes starting together
    (the suite's workers, a studio and a CLI) wait for one build instead of each running their own."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with BUILD_LOCK, open(library.with_suffix(".lock"), "a") as handle:
        try:
            import fcntl
        except ImportError:  # not a POSIX system: the thread lock only
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached(library: Path, build) -> tuple[Path, dict]:
    """``library`` and its metadata from the cache, ``build(library)`` first where it is missing."""
    meta_file = library.with_suffix(".json")
    with build_lock(library):
        if not (library.exists() and meta_file.exists()):
            return library, build(library)
    return library, json.loads(meta_file.read_text())


def _build(out_features: int, in_features: int, kind: str, library: Path) -> dict:
    """Compile the kernel for one shape into ``library`` (a shared object holding no weights) and
    find the names of its constants (the weight, and for int8 its scales) and the weight's blocked
    layout."""
    module, rows_dtype = _kind_parts(kind, out_features, in_features)
    with tempfile.TemporaryDirectory(dir=library.parent) as folder:
        staged, _ = compile_shared_object(module, (torch.zeros(2, in_features, dtype=rows_dtype),), Path(folder), library.name)
        runner = load_runner(staged)
        names = list(runner.get_constant_names_to_original_fqns())
        scales_name = "scales" if kind == "int8" else None
        weight_names = [name for name in names if name != scales_name]
        if len(weight_names) != 1 or (scales_name and scales_name not in names):
            raise RuntimeError(f"expected the weight{' and its scales' if scales_name else ''} as the kernel's constants, found {names}")
        weight, scales = _probe_weights(kind, out_features, in_features)
        probe = probe_rows(in_features, rows_dtype)
        truth = (F.linear(probe.float(), weight.float() * scales.float()[:, None]) if scales is not None
                 else F.linear(probe, weight))
        for block, vnni in layouts(out_features, in_features):
            packed = blocked(weight, block, vnni)
            try:
                swap_in(runner, {weight_names[0]: packed, **({scales_name: scales} if scales_name else {})})
                with torch.inference_mode():
                    close = _close(runner.run([probe])[0], truth, kind)
            except RuntimeError:
                continue
            if close:
                return install(staged, library, {"constant": weight_names[0], "block": block, "vnni": vnni,
                                                 **({"scales": scales_name} if scales_name else {})})
    raise RuntimeError(f"none of the blocked layouts {layouts(out_features, in_features)} gives the kernel's products")


def kernel_library(out_features: int, in_features: int, kind: str = "float32") -> tuple[Path, dict]:
    """The compiled kernel for an (out, in) matrix of ``kind`` (``MATRIX_KINDS``), built here first
    if the cache lacks it."""
    if kind not in MATRIX_KINDS:
        raise ValueError(f"kernel kind {kind!r}; allowed: {', '.join(MATRIX_KINDS)}")
    library = kernel_dir() / f"linear-{out_features}x{in_features}-{kind}.so"
    return cached(library, lambda path: _build(out_features, in_features, kind, path))


class AotiLinear:
    """``x @ weight.T`` through a compiled kernel with ``weight`` swapped in (see the module's
    docstring); ``weight`` stays available unchanged (the drafter shares the target's LM head)."""

    def __init__(self, weight: torch.Tensor, library: Path, meta: dict) -> None:
        self.weight = weight
        self.bias = None
        self.packed_weight = blocked(weight, meta["block"], meta.get("vnni", 1))  # the runner reads it in place
        self.runner = load_runner(library)
        swap_in(self.runner, {meta["constant"]: self.packed_weight})

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.runner.run([x.contiguous()])[0]
        return self.runner.run([x.reshape(-1, x.shape[-1]).contiguous()])[0].unflatten(0, x.shape[:-1])


class AotiInt8Weight:
    """``weight_formats.Int8Weight``'s product (``x @ (q * scales[:, None]).T``) through inductor's
    weight-only int8 C++ GEMM: a drop-in kernel for ``weight_formats.QuantizedLinear``, on 2-D rows."""

    fmt = "int8"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, library: Path, meta: dict) -> None:
        self.shape = tuple(q.shape)
        self.packed_weight = blocked(q, meta["block"], meta.get("vnni", 1))  # the runner reads both in place
        self.scales = scales.to(INT8_ROWS).contiguous()
        self.runner = load_runner(library)
        swap_in(self.runner, {meta["constant"]: self.packed_weight, meta["scales"]: self.scales})

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.runner.run([x.to(INT8_ROWS).contiguous()])[0].to(x.dtype)


def exact_here(kernel, reference=None) -> str | None:
    """Why ``kernel`` may not replace ``reference`` here (None when it may): its rows must not
    change with the rows beside them, a lone row included, and its numbers must be the reference's
    to rounding (``F.linear`` of an ``AotiLinear``'s weight by default; for an ``AotiInt8Weight``
    the eager int8 kernel of the same codes, to its bf16 rows' rounding)."""
    if reference is None:
        weight = kernel.weight
        in_features, dtype, kind = weight.shape[1], weight.dtype, "float32"

        def reference(rows: torch.Tensor) -> torch.Tensor:
            return F.linear(rows, weight)
    else:
        in_features, dtype, kind = kernel.shape[1], reference.scales.dtype, "int8"
    probe = probe_rows(in_features, dtype)
    with torch.inference_mode():
        own = kernel(probe)
        if not _close(own, reference(probe), kind):
            return "its results are not F.linear's" if kind == "float32" else "its results are not the eager int8 kernel's"
        if not rows_independent(kernel, own, probe):
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
        library, meta = kernel_library(weight.shape[0], weight.shape[1], "float32")
        kernel = AotiLinear(weight, library, meta)
    except Exception as exc:  # a compiler or AOTInductor failure here: oneDNN keeps running
        return linear, f"building or loading the kernel failed: {type(exc).__name__}: {str(exc)[:200]}"
    why = exact_here(kernel)
    return (linear, why) if why else (kernel, None)


def aoti_int8_linear(linear):
    """A ``weight_formats.QuantizedLinear`` of an ``Int8Weight`` with its kernel swapped for the
    int8 C++ GEMM where that is exact here, else ``linear`` itself and why."""
    from .weight_formats import Int8Weight, QuantizedLinear

    eager = linear.kernel
    if not isinstance(eager, Int8Weight):
        return linear, f"only int8 weight-only matrices are built, not {getattr(eager, 'fmt', type(eager).__name__)}"
    if eager.q.device.type != "cpu":
        return linear, f"only matrices on CPU are built, not on {eager.q.device.type}"
    try:
        library, meta = kernel_library(eager.shape[0], eager.shape[1], "int8")
        kernel = AotiInt8Weight(eager.q, eager.scales, library, meta)
    except Exception as exc:  # a compiler or AOTInductor failure here: the eager int8 kernel keeps running
        return linear, f"building or loading the kernel failed: {type(exc).__name__}: {str(exc)[:200]}"
    why = exact_here(kernel, eager)
    return (linear, why) if why else (QuantizedLinear(kernel, linear.bias), None)


def _drafter_kernel(weight: torch.Tensor, int8: bool):
    """``x @ weight.T`` through the C++ GEMM (int8: the weight requantized per output channel),
    or None where it cannot be built or its probe refuses."""
    from .weight_formats import Int8Weight, QuantizedLinear

    if int8:
        eager = Int8Weight(weight, weight.dtype)
        dot, _ = int8_dot.int8_dot_weight(eager)  # bf16 dot products where they run, else inductor's int8 GEMM
        if dot is not None:
            return QuantizedLinear(dot)
        kernel, why = aoti_int8_linear(QuantizedLinear(eager))
    else:
        kernel, why = aoti_linear(Linear(weight, pack=False))
    return None if why else kernel


def drafter_kernels(drafter, int8: bool) -> str:
    """The drafter's fp32 matrices (its layers', its fc, and the draft head's rows of the target's
    LM head) through the C++ GEMM, int8 where the target's layers run int8. Drafts are only
    proposals (the target verifies every one), so rounding here changes acceptance at most, never
    the output; a 16-row drafter pass is mostly its matrices on a CPU. Returns a note for the
    load log."""
    from .kernels import PackedModuleForward

    linears = [m for m in drafter.modules() if isinstance(m, torch.nn.Linear)]
    if not available() or any(m.weight.device.type != "cpu" or m.weight.dtype != torch.float32 for m in linears):
        return "oneDNN (the C++ GEMM is built for fp32 drafters on CPU with a compiler)"
    done = 0
    for module in linears:
        if module.bias is not None:
            continue
        kernel = _drafter_kernel(module.weight.detach(), int8)
        if kernel is not None:
            module.forward = PackedModuleForward(module, kernel)
            done += 1
    drafter.set_head_kernel(lambda weight: _drafter_kernel(weight, int8) or Linear(weight))
    if int8 and int8_dot.unavailable() is None:
        return f"bf16 dot products (int8 weight-only) for {done} of {len(linears)} matrices and the draft head"
    kind = "int8 weight-only, rows in bf16" if int8 else "fp32"
    return f"inductor C++ GEMM ({kind}) for {done} of {len(linears)} matrices and the draft head"
