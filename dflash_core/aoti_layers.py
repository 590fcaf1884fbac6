"""The target's decoder layers compiled whole around attention (AOTInductor), on CPU.

With ``kernels = "aoti"`` matrix by matrix, an eager decoder layer still runs some twenty small
PyTorch ops around its four matrices (norms, rotary, residuals, SiLU, dtype casts), each dispatched
from Python; on a 135M model with int8 matrices they take more of a step than the matrices do
(what whole layers gained: docs/BENCHMARKS.md). Here each layer's
two halves around attention, ``FastTarget.attention_inputs`` (norm, QKV, rotary) and
``FastTarget.finish_layer`` (O, residual, norm, gate/up, SiLU, down, residual), are each one
AOTInductor kernel: inductor's C++ GEMM (``aoti_kernels``) with the element-wise work fused
around it. Attention itself stays in ``FastTarget`` (the chain and the tree lay it out their own
ways, with the same sums).

Every layer of a model has the same shapes, so one kernel per half serves them all, built once per
machine into the cache beside ``aoti_kernels``' and holding no weights; each layer gets its own
runner of it with its own weights swapped in. A compiled half replaces the eager one only where a
probe finds its results the eager half's to rounding; FastTarget's min-rows probe then decides,
as for every kernel, whether rows stay independent of their company.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .aoti_kernels import (INT8_ROWS, VNNI_CANDIDATES, blocked, cached, compile_shared_object, install, kernel_dir,
                           load_runner, spec_digest, swap_in)
from .families import FusedLayer
from . import int8_dot
from .kernels import probe_rows
from .weight_formats import DYNAMIC_MATRICES, int8_rows_product, quantize_rows

MATRICES = {"before": ("qkv",), "after": ("o", "gate_up", "down")}


@dataclass(frozen=True)
class LayerSpec:
    """What a compiled layer half depends on besides the machine: the model's shapes and math."""

    kind: str  # "float32", "int8" or "w8a8" (the layers' matrices, see matrix_kind; the rest in float32)
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    biases: tuple[str, ...] = ()  # the matrices with a bias
    qk_norm: bool = False
    # w8a8's quantized rows as inductor's int8 GEMM takes them (aoti_kernels.w8a8_rows): "int8", or
    # "uint8" (the codes plus ROW_ZERO_POINT)
    rows: str = field(default="int8", metadata={"omitted_at_default": True})
    # The weight-only int8 ``down`` left out of the compiled half and run by ``int8_dot`` on the
    # half's outputs (x after attention, SiLU(gate) x up), the residual added in its pass: on
    # AVX512-BF16 CPUs without AMX its bf16 dot products make a verify block's ``down`` several
    # times cheaper than inductor's int8 GEMM (int8_dot's docstring)
    down_apart: bool = field(default=False, metadata={"omitted_at_default": True})

    def matrix_kind(self, name: str) -> str:
        """How matrix ``name`` runs: w8a8 layers keep ``down`` weight-only int8 (weight_formats.DYNAMIC_MATRICES)."""
        return "int8" if self.kind == "w8a8" and name not in DYNAMIC_MATRICES else self.kind

    def shapes(self) -> dict[str, tuple[int, int]]:
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return {"qkv": (qkv, self.hidden), "o": (self.hidden, self.heads * self.head_dim),
                "gate_up": (2 * self.intermediate, self.hidden), "down": (self.hidden, self.intermediate)}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # FastTarget.norm's math, op for op.
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


# w8a8's row codes (-127..127) plus this are unsigned bytes: what AVX-512 VNNI multiplies by signed ones.
ROW_ZERO_POINT = 128


def unsigned_rows_product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor,
                          smoothing: torch.Tensor) -> torch.Tensor:
    """``int8_rows_product`` with the row codes shifted into uint8 (weight (out, in), as stored by
    ``DynamicInt8Weight.q``): the same int32 sums, the shift taken off through the weight's column
    sums, written as PyTorch's quantization pattern (dequantize, linear), which inductor lowers to
    its int8 GEMM with unsigned rows. The weight must be a buffer of its own, not a view of the
    (in, out) codes: inductor packs a transposed view as if it were not (wrong sums, torch 2.13);
    and ``zero_points`` a buffer, so that the GEMM sees the weight's zero points as constants."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers torch.ops.quantized_decomposed; ~1 s, so here)

    codes, row_scales = quantize_rows(x.float() / smoothing)
    q = torch.ops.quantized_decomposed
    shifted = (codes.to(torch.int16) + ROW_ZERO_POINT).to(torch.uint8)
    rows = q.dequantize_per_tensor.default(shifted, 1.0, ROW_ZERO_POINT, 0, 255, torch.uint8)
    weight = q.dequantize_per_channel.default(weight, scales, zero_points, 0, -128, 127, torch.int8)
    return (F.linear(rows, weight) * row_scales).to(x.dtype)


class Matrix(torch.nn.Module):
    """One matrix as the eager layer runs it: ``kernels.Linear`` (fp32), ``QuantizedLinear`` of
    an ``Int8Weight`` (int8 codes, per-channel scales, rows in bf16) or of a ``DynamicInt8Weight``
    (``w8a8``: rows smoothed and quantized per row, int8 x int8; the codes stored (in, out), as
    ``torch._int_mm`` takes them and inductor's int8 GEMM pattern wants them; with ``rows`` "uint8",
    ``unsigned_rows_product``'s buffers instead)."""

    def __init__(self, kind: str, out_features: int, in_features: int, bias: bool, rows: str = "int8") -> None:
        super().__init__()
        self.kind, self.rows = kind, rows
        if kind == "w8a8" and rows == "uint8":
            self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
            self.register_buffer("scales", torch.ones(out_features))
            self.register_buffer("smoothing", torch.ones(in_features))
            self.register_buffer("zero_points", torch.zeros(out_features, dtype=torch.int64))
        elif kind == "w8a8":
            self.register_buffer("codes_t", torch.zeros(in_features, out_features, dtype=torch.int8))
            self.register_buffer("scales", torch.ones(out_features))
            self.register_buffer("smoothing", torch.ones(in_features))
        elif kind == "int8":
            self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
            self.register_buffer("scales", torch.ones(out_features, dtype=INT8_ROWS))
        else:
            self.weight = torch.nn.Parameter(torch.zeros(out_features, in_features), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "w8a8" and self.rows == "uint8":
            y = unsigned_rows_product(x, self.weight, self.scales, self.zero_points, self.smoothing)
            return y if self.bias is None else y + self.bias
        if self.kind == "w8a8":
            y = int8_rows_product(x, self.codes_t, self.scales, self.smoothing)
            return y if self.bias is None else y + self.bias
        if self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x.to(INT8_ROWS), self.weight, self.scales).to(x.dtype)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


class _Before(torch.nn.Module):
    """``FastTarget.attention_inputs``: (x, cos, sin) -> queries, keys, values."""

    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec
        n, k = spec.shapes()["qkv"]
        self.ln1 = torch.nn.Parameter(torch.ones(spec.hidden), requires_grad=False)
        self.qkv = Matrix(spec.matrix_kind("qkv"), n, k, "qkv" in spec.biases, spec.rows)
        if spec.qk_norm:
            self.qk_norm = torch.nn.Parameter(torch.ones(spec.heads + spec.kv_heads, spec.head_dim), requires_grad=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        s = self.spec
        h, kv, d = s.heads, s.kv_heads, s.head_dim
        qkv = self.qkv(rms_norm(x, self.ln1, s.eps)).unflatten(-1, (h + 2 * kv, d))
        qk = qkv[:, : h + kv]
        if s.qk_norm:
            qk = rms_norm(qk, self.qk_norm, s.eps)
        qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
        return qk[:, :h], qk[:, h:], qkv[:, h + kv :]


class _After(torch.nn.Module):
    """``FastTarget.finish_layer``: (x, attention) -> the residual stream after the layer."""

    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec
        shapes = spec.shapes()
        self.o = Matrix(spec.matrix_kind("o"), *shapes["o"], "o" in spec.biases, spec.rows)
        self.ln2 = torch.nn.Parameter(torch.ones(spec.hidden), requires_grad=False)
        self.gate_up = Matrix(spec.matrix_kind("gate_up"), *shapes["gate_up"], "gate_up" in spec.biases, spec.rows)
        if not spec.down_apart:
            self.down = Matrix(spec.matrix_kind("down"), *shapes["down"], "down" in spec.biases)

    def forward(self, x: torch.Tensor, attention: torch.Tensor):
        x = x + self.o(attention)
        gate, up = self.gate_up(rms_norm(x, self.ln2, self.spec.eps)).chunk(2, dim=-1)
        if self.spec.down_apart:  # int8_dot takes its rows in bf16, as inductor's int8 GEMM rounds them
            return x, (F.silu(gate) * up).to(torch.bfloat16)
        return x + self.down(F.silu(gate) * up)


def _half(spec: LayerSpec, half: str) -> torch.nn.Module:
    return (_Before if half == "before" else _After)(spec).eval()


def _example(spec: LayerSpec, half: str, rows: int, generator: torch.Generator | None = None) -> tuple:
    def rand(*shape):
        return torch.randn(*shape, generator=generator) if generator is not None else torch.zeros(*shape)

    if half == "before":
        angles = (rows, spec.heads + spec.kv_heads, spec.head_dim)
        return rand(rows, spec.hidden), rand(*angles), rand(*angles)
    return rand(rows, spec.hidden), rand(rows, spec.heads * spec.head_dim)


def _constants_of(source: str) -> dict[str, tuple[int, ...]]:
    """Each constant's name and shape, as the generated wrapper declares them (the runner gives
    names and dtypes but not shapes; the GEMM's weights are stored blocked, in a shape it chose)."""
    names = dict(re.findall(r'constants_info_\[(\d+)\]\.name = "([^"]+)";', source))
    shapes = dict(re.findall(r"constants_info_\[(\d+)\]\.shape = \{([^}]*)\};", source))
    return {names[i]: tuple(int(v) for v in shapes[i].split(",") if v.strip()) for i in names}


def _matrices(spec: LayerSpec, half: str) -> dict[str, tuple[int, int]]:
    """The matrices of a layer half of ``spec``, name -> (out, in) features."""
    shapes = spec.shapes()
    return {m: shapes[m] for m in MATRICES[half] if not (m == "down" and spec.down_apart)}


def _assign(spec: LayerSpec, half: str, declared: dict[str, tuple[int, ...]], fqns: dict[str, str]) -> list[dict]:
    """``assign_constants`` for a layer half of ``spec``."""
    return assign_constants(_half(spec, half), _matrices(spec, half), declared, fqns)


def assign_constants(module: torch.nn.Module, matrices: dict[str, tuple[int, int]], declared: dict[str, tuple[int, ...]],
                     fqns: dict[str, str], values: dict[str, torch.Tensor] | None = None) -> list[dict]:
    """Where each of a kernel's constants comes from: a parameter of ``module`` (by its name), the
    weight of one of its ``matrices`` (name -> (out, in) features) in the blocked layout (by
    shape; matrices of one shape in the graph's order), or, where the kernel was built with
    distinct random parameters packaged (``values``, its constants as built), what the graph
    made of them: a parameter or its copy in another dtype (the int8 GEMM's fp32 scales), zeros
    (its zero-point compensation) or a scalar (its unit input scale, zero points)."""
    params = dict(module.named_parameters()) | dict(module.named_buffers())
    open_matrices = list(matrices)
    plan = []
    for name in sorted(declared, key=lambda n: (not n.startswith("constant"), int(n[8:]) if n[8:].isdigit() else 0, n)):
        fqn = fqns.get(name, name)
        if fqn in params:
            plan.append({"name": name, "source": fqn, "block": None})
            continue
        shape = declared[name]
        match = [m for m in open_matrices if len(shape) == 3 and matrices[m] == (shape[0] * shape[2], shape[1])]
        if match:
            open_matrices.remove(match[0])
            plan.append({"name": name, "source": f"{match[0]}.weight", "block": shape[2]})
            continue
        # extract_constants_map names a constant by its original name where it has one
        value = None if values is None else values.get(name, values.get(fqn))
        derived = None if value is None else _derived(name, value, params)
        if derived is None:
            raise RuntimeError(f"the kernel's constant {name} {shape} is neither a parameter nor a blocked matrix")
        plan.append(derived)
    if open_matrices:
        raise RuntimeError(f"no blocked weight found in the kernel for {', '.join(open_matrices)}")
    return plan


def _derived(name: str, value: torch.Tensor, params: dict[str, torch.Tensor]) -> dict | None:
    """How constant ``name`` (``value``, as built from ``params``) follows from the parameters."""
    dtype = str(value.dtype).removeprefix("torch.")
    for source, param in params.items():
        if param.shape == value.shape and torch.equal(param.to(value.dtype), value):
            return {"name": name, "source": source, "block": None, "dtype": dtype}
    if not value.any():
        return {"name": name, "zeros": list(value.shape), "block": None, "dtype": dtype}
    for source, param in params.items():  # unsigned rows' zero point taken off: see _compensation
        if source.endswith(".weight") and param.dtype == torch.int8 and param.shape[:1] == value.shape:
            scales = params.get(source.removesuffix("weight") + "scales")
            if scales is not None and torch.equal(_compensation(param, scales), value):
                return {"name": name, "compensation": source, "block": None, "dtype": dtype}
    if value.dim() == 0:
        return {"name": name, "value": value.item(), "block": None, "dtype": dtype}
    return None


def _compensation(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What inductor's int8 GEMM subtracts for unsigned rows' zero point: each output's weight sum
    (exact in fp32: at most in_features x 127) times its scale times ROW_ZERO_POINT, in the order
    inductor computes it at build (cpp_gemm_template's create_int8_compensation), so bit for bit."""
    return weight.float().sum(1) * scales.float() * torch.tensor(ROW_ZERO_POINT, dtype=torch.int32)


def _constants(plan: list[dict], params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    def constant(c: dict) -> torch.Tensor:
        if "compensation" in c:
            source = c["compensation"]
            return _compensation(params[source], params[source.removesuffix("weight") + "scales"])
        if "zeros" in c:
            return torch.zeros(c["zeros"], dtype=getattr(torch, c["dtype"]))
        if "value" in c:
            return torch.tensor(c["value"], dtype=getattr(torch, c["dtype"]))
        if c["block"] is not None:
            return blocked(params[c["source"]], c["block"], c.get("vnni", 1))
        value = params[c["source"]]
        return value.to(getattr(torch, c["dtype"])).contiguous() if "dtype" in c else value

    return {c["name"]: constant(c) for c in plan}


def _match_blocked_by_value(plan: list[dict], params: dict[str, torch.Tensor], values: dict[str, torch.Tensor],
                            fqns: dict[str, str]) -> list[dict]:
    """``plan``'s blocked matrices placed by their built values where the kernel was built with
    distinct random parameters: which matrix, and in which VNNI interleave (a kernel may read its
    int8 x int8 matrices in AMX's 4 rows of K and its bf16-row ones in 2), each constant holds.
    Matrices of one shape are otherwise told apart by the graph's order only, and a kernel mixing
    GEMM kinds does not keep it. A constant whose value the runner does not give (two constants
    of one original name: it gives one) keeps the shape rule among the matrices left."""
    blocked_constants = [c for c in plan if c["block"] is not None]
    matrices = {c["source"] for c in blocked_constants}
    placed: dict[str, dict] = {}
    for c in blocked_constants:
        # the runner names a value by the constant's original name: a constant renamed apart
        # from another of that name (constant19_0 beside constant19) has none of its own
        built = values.get(c["name"]) if fqns.get(c["name"], c["name"]) == c["name"] else None
        for source in sorted(matrices):
            found = next((vnni for vnni in VNNI_CANDIDATES if built is not None and params[source].shape[1] % vnni == 0
                          and torch.equal(blocked(params[source], c["block"], vnni), built)), None)
            if found is not None:
                placed[c["name"]] = {**c, "source": source, "built_vnni": found}
                matrices.discard(source)
                break
    out = []
    for c in plan:
        if c["block"] is not None and c["name"] not in placed:
            same_shape = [m for m in sorted(matrices) if params[m].shape == params[c["source"]].shape]
            source = c["source"] if c["source"] in matrices else same_shape[0]
            matrices.discard(source)
            c = {**c, "source": source}
        out.append(placed.get(c["name"], c))
    return out


def with_row_major_codes(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` plus each w8a8 matrix's codes as (out, in) ``X.weight``: the blocked layout's source."""
    return params | {name.removesuffix("codes_t") + "weight": value.t().contiguous()
                     for name, value in params.items() if name.endswith("codes_t")}


def close_to_rounding(got: torch.Tensor, want: torch.Tensor, kind: str, tolerance: float | None = None) -> bool:
    """To rounding (relative, ``tolerance`` unless given): fp32's for fp32 matrices; bf16 rows'
    for int8 ones. A constant in the wrong place is off by the size of the results themselves."""
    tolerance = tolerance if tolerance is not None else 1e-4 if kind == "float32" else 2e-2
    return bool((got.float() - want.float()).norm() <= tolerance * want.float().norm())


def _random_params(module: torch.nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor]:
    params = {}
    for name, value in list(module.named_parameters()) + list(module.named_buffers()):
        if value.dtype == torch.int8:
            new = torch.randint(-127, 128, value.shape, generator=generator, dtype=torch.int8)
        elif name.endswith("zero_points"):  # the weight's: symmetric
            new = torch.zeros_like(value)
        elif name.endswith("scales"):
            new = (torch.rand(value.shape, generator=generator) / 64 + 1 / 128).to(value.dtype)
        elif name.endswith("smoothing"):
            new = torch.rand(value.shape, generator=generator) + 0.5
        elif name.endswith("weight"):
            new = torch.randn(value.shape, generator=generator) / value.shape[-1] ** 0.5
        else:
            new = torch.rand(value.shape, generator=generator) + 0.5
        value.data = new.to(value.dtype)
        params[name] = value.data
    return params


def _build(spec: LayerSpec, half: str, library: Path) -> dict:
    return build_kernel(_half(spec, half), lambda rows, generator=None: _example(spec, half, rows, generator),
                        _matrices(spec, half), spec.kind, library, {"spec": asdict(spec)})


def build_kernel(module: torch.nn.Module, example: Callable[..., tuple], matrices: dict[str, tuple[int, int]], kind: str,
                 library: Path, meta: dict, dynamic_shapes: tuple | None = None) -> dict:
    """``module`` (holding ``matrices``, name -> (out, in) features, as ``Matrix`` of ``kind``)
    compiled into ``library`` with its constants' plan; ``example(rows, generator=None)`` gives
    inputs. The plan is proven on random weights against the eager module before it is installed."""
    with tempfile.TemporaryDirectory(dir=library.parent) as folder:
        # Built with distinct random parameters, so that a kernel packaging them (w8a8's: its
        # int8 x int8 GEMM makes new constants from the weights, fp32 scales, a zero-point
        # compensation, unit scalars) has each constant told apart by its value. export's
        # metadata asserts go first there: they give the int8 product a second user, and
        # inductor's pattern then skips it.
        generator = torch.Generator().manual_seed(0)
        params = _random_params(module, generator)
        by_value = kind == "w8a8"
        staged, source = compile_shared_object(module, example(2), Path(folder), library.name, dynamic_shapes=dynamic_shapes,
                                               configs={"aot_inductor.package_constants_in_so": True} if by_value else None,
                                               drop_metadata_asserts=by_value)
        runner = load_runner(staged)
        values = runner.extract_constants_map(False) if by_value else None
        fqns = dict(runner.get_constant_names_to_original_fqns())
        plan = assign_constants(module, matrices, _constants_of(source), fqns, values)
        # The plan proven on random weights against the eager half, with the matrices' rows of K
        # interleaved as the GEMM reads them (``aoti_kernels.VNNI_CANDIDATES``: AMX's VNNI layout).
        params = with_row_major_codes(params)
        if values is not None:
            plan = _match_blocked_by_value(plan, params, values, fqns)
        inputs = example(5, generator)
        with torch.inference_mode():
            want = module(*inputs)
        want = want if isinstance(want, tuple) else (want,)
        for vnni in VNNI_CANDIDATES:
            plan = [{**c, "vnni": c.get("built_vnni", vnni)} if c["block"] is not None else c for c in plan]
            if any(c["block"] is not None and params[c["source"]].shape[1] % vnni for c in plan):
                continue
            swap_in(runner, _constants(plan, params))
            with torch.inference_mode():
                got = runner.run(list(inputs))
            if len(got) == len(want) and all(close_to_rounding(g, w, kind) for g, w in zip(got, want)):
                return install(staged, library, {**meta, "constants": plan})
        raise RuntimeError("the compiled layer's results are not the eager layer's")


def layer_library(spec: LayerSpec, half: str) -> tuple[Path, dict]:
    """The compiled ``half`` ("before" or "after" attention) for layers of ``spec``, built here
    first if the cache lacks it."""
    if half == "before":  # the first half is the same with down apart or not
        spec = replace(spec, down_apart=False)
    library = kernel_dir() / f"layer-{half}-{spec.kind}-{spec_digest(spec)}.so"
    return cached(library, lambda path: _build(spec, half, path))


class CompiledHalf:
    """One layer's half through its runner; ``constants`` keeps the tensors it reads in place."""

    def __init__(self, library: Path, meta: dict, params: dict[str, torch.Tensor]) -> None:
        self.constants = _constants(meta["constants"], params)
        self.runner = load_runner(library)
        swap_in(self.runner, self.constants)

    def __call__(self, *inputs: torch.Tensor):
        out = self.runner.run([t.contiguous() for t in inputs])
        return out[0] if len(out) == 1 else tuple(out)


class HalfThenDown:
    """A compiled second half without ``down`` (``LayerSpec.down_apart``), then ``down`` through
    ``int8_dot`` with the residual added in its pass: called as the whole half is."""

    def __init__(self, half: CompiledHalf, down) -> None:
        self.half, self.down = half, down

    def __call__(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        residual, act = self.half.runner.run([x.contiguous(), attention.contiguous()])  # fp32 and bf16, contiguous
        return self.down.rows(act, residual)


@dataclass
class CompiledLayer(FusedLayer):
    """A ``FusedLayer`` whose two halves run compiled (``FastTarget.attention_inputs`` and
    ``finish_layer`` call them); its eager fields stay, unchanged, for what reads the weights."""

    before: Callable = field(default=None, repr=False)
    after: Callable = field(default=None, repr=False)


def layer_spec(layer: FusedLayer, target) -> tuple[LayerSpec | None, str | None]:
    """The spec of ``layer`` in ``target`` (a ``FastTarget``), or why it cannot be compiled."""
    from .kernels import Linear
    from .weight_formats import DynamicInt8Weight, Int8Weight, QuantizedLinear

    if target.dtype != torch.float32 or target.device.type != "cpu":
        return None, f"only fp32 targets on CPU are compiled, not {target.dtype} on {target.device.type}"
    matrices = {name: getattr(layer, name) for name in ("qkv", "o", "gate_up", "down")}
    if all(isinstance(m, QuantizedLinear) and isinstance(m.kernel, Int8Weight) for m in matrices.values()):
        kind = "int8"
    elif all(isinstance(m, QuantizedLinear) and isinstance(m.kernel, DynamicInt8Weight if name in DYNAMIC_MATRICES else Int8Weight)
             for name, m in matrices.items()):
        kind = "w8a8"
    elif all(isinstance(m, Linear) and m.weight.dtype == torch.float32 for m in matrices.values()):
        kind = "float32"
    else:
        return None, "only fp32, int8 weight-only and w8a8 layers are compiled"
    spec = LayerSpec(kind=kind, hidden=target.hidden_size, heads=target.num_heads, kv_heads=target.num_kv_heads,
                     head_dim=target.head_dim, intermediate=matrices["down"].in_features if kind != "float32"
                     else matrices["down"].weight.shape[1], eps=target.eps,
                     biases=tuple(name for name, m in matrices.items() if m.bias is not None),
                     qk_norm=layer.qk_norm is not None, rows=_w8a8_rows() if kind == "w8a8" else "int8",
                     down_apart=kind in ("int8", "w8a8") and matrices["down"].bias is None and int8_dot.unavailable() is None)
    shapes = spec.shapes()
    for name, m in matrices.items():
        shape = tuple(m.kernel.shape) if kind != "float32" else tuple(m.weight.shape)
        if shape != shapes[name]:
            return None, f"the layer's {name} is {shape}, not the {shapes[name]} its shapes imply"
    return spec, None


def _w8a8_rows() -> str:
    from .aoti_kernels import w8a8_rows

    return w8a8_rows()[0] or "int8"  # None: FastTarget runs such layers int8 weight-only instead


def w8a8_params(name: str, kernel) -> dict[str, torch.Tensor]:
    """A ``DynamicInt8Weight``'s tensors as the ``Matrix`` called ``name`` holds them, for signed
    rows (the (in, out) codes) or unsigned ones (the (out, in) codes and their zero points)."""
    return {f"{name}.codes_t": kernel.q_t, f"{name}.weight": kernel.q, f"{name}.scales": kernel.scales,
            f"{name}.smoothing": kernel.smoothing, f"{name}.zero_points": torch.zeros(kernel.q.shape[0], dtype=torch.int64)}


def _layer_params(layer: FusedLayer, kind: str) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = {"ln1": layer.ln1, "ln2": layer.ln2}
    if layer.qk_norm is not None:
        params["qk_norm"] = layer.qk_norm
    for name in ("qkv", "o", "gate_up", "down"):
        m = getattr(layer, name)
        if kind == "w8a8" and name in DYNAMIC_MATRICES:
            params |= w8a8_params(name, m.kernel)
        elif kind in ("int8", "w8a8"):
            params[f"{name}.weight"] = m.kernel.q
            params[f"{name}.scales"] = m.kernel.scales.to(INT8_ROWS).contiguous()
        else:
            params[f"{name}.weight"] = m.weight
        if m.bias is not None:
            params[f"{name}.bias"] = m.bias
    return params


# Set to 0 to run the matrices one by one instead (to measure one against the other).
SWITCH = "DFLASH_AOTI_WHOLE_LAYERS"


def compiled_layers(target) -> tuple[list[CompiledLayer] | None, str]:
    """``target.layers`` (a ``FastTarget``'s) with both halves compiled, and a note; ``(None, why
    not)`` where a spec, a build or the probe against the eager halves refuses."""
    from dataclasses import fields

    if os.environ.get(SWITCH, "1") == "0":
        return None, f"turned off ({SWITCH}=0)"
    layers = target.layers
    spec, why = layer_spec(layers[0], target)
    if spec is None:
        return None, why
    try:
        libraries = {half: layer_library(spec, half) for half in MATRICES}
    except Exception as exc:  # a compiler or AOTInductor failure here: the eager layers keep running
        return None, f"building the layer kernels failed: {type(exc).__name__}: {str(exc)[:200]}"
    out = []
    generator = torch.Generator().manual_seed(0)
    x = probe_rows(spec.hidden, torch.float32)
    angles = (x.shape[0], spec.heads + spec.kv_heads, spec.head_dim)
    cos, sin = torch.randn(*angles, generator=generator), torch.randn(*angles, generator=generator)
    attention = torch.randn(x.shape[0], spec.heads * spec.head_dim, generator=generator)
    for i, layer in enumerate(layers):
        other, why = layer_spec(layer, target)
        if other != spec:
            return None, f"layer {i} differs from layer 0 ({why or other})"
        params = _layer_params(layer, spec.kind)
        before, after = (CompiledHalf(*libraries[half], params) for half in MATRICES)
        if spec.down_apart:
            down, why = int8_dot.int8_dot_weight(layer.down.kernel)
            if down is None:
                return None, f"layer {i}'s down through int8_dot: {why}"
            after = HalfThenDown(after, down)
        with torch.inference_mode():
            eager_before = target.attention_inputs(layer, x, cos, sin)
            if not all(close_to_rounding(g, w, spec.kind) for g, w in zip(before(x, cos, sin), eager_before)):
                return None, f"layer {i}'s compiled attention inputs are not the eager ones"
            if not close_to_rounding(after(x, attention), target.finish_layer(layer, x, attention), spec.kind):
                return None, f"layer {i}'s compiled finish is not the eager one"
        out.append(CompiledLayer(**{f.name: getattr(layer, f.name) for f in fields(FusedLayer)}, before=before, after=after))
    rows = ", rows unsigned" if spec.kind == "w8a8" and spec.rows == "uint8" else ""
    rows += ", down through bf16 dot products" if spec.down_apart else ""
    return out, f"{len(out)} of {len(layers)} decoder layers compiled whole around attention ({spec.kind} matrices{rows})"
