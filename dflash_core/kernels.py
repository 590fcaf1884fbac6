"""Linear layers with weights pre-packed for oneDNN on CPU, when that changes no number.

Decoding a 135M model on two cores is bound by reading its weights: every target forward
streams ~270 MB of bf16 matrices. ``F.linear`` hands them to oneDNN in PyTorch's plain layout,
and oneDNN reorders them into its blocked layout on every call; packing each weight once, at
load time, removes that work from every forward (docs/BENCHMARKS.md has the timings per CPU).
fp32 weights are packed the same way: on CPUs without bf16 instructions (AVX2 only, or AVX-512
without AVX512-BF16 and AMX), where ``dtype = "auto"`` runs the target in fp32 (``native_bf16``),
the packed fp32 kernel is the fast one and, on AVX2, unlike ``F.linear``'s, gives every row the
same numbers whatever the rows beside it.

The engine's losslessness rests on batch invariance: a row's result must not depend on how many
rows share its call (see ``target.py``). A packed weight is only used after a probe shows, on
this machine, one of two things: its rows equal ``F.linear``'s bit for bit for every row count
but one (a lone row then still goes to ``F.linear``, whose matrix-vector path rounds its own
way), or its rows do not change with the number of rows at all, a lone row included (then every
input goes to it). Otherwise (another CPU, another dtype, a GPU) the plain ``F.linear`` runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Row counts the probe compares: the decoder's minimum, odd, a block (the widest pass decoding
# runs after the prompt). A lone row is left out: oneDNN and F.linear both take a matrix-vector
# path for it that rounds differently, which is why FastTarget never runs fewer than two rows. A
# prompt's many rows are left out too: AR and DFlash run the same prefill, so its rounding need not
# match a decode pass's (oneDNN's bf16 kernels on an AMX Xeon take another path above 32 rows,
# where the packed and plain layouts round apart: docs/BENCHMARKS.md).
PROBE_ROWS = (2, 3, 16)


def padded_rows(least: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` (rows first) with their last row repeated up to ``least`` rows: how a pass, or
    a call inside one, keeps off the matrix-vector path a lone row takes (see ``PROBE_ROWS``)."""
    real = tensors[0].shape[0]
    if real >= least:
        return tensors
    return tuple(torch.cat((t, t[-1:].expand(least - real, *t.shape[1:]))) for t in tensors)


def _packing_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float32)
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def rows_match(call, reference: torch.Tensor, probe: torch.Tensor) -> bool:
    """Whether ``call`` on the first rows of ``probe`` gives ``reference``'s rows bit for bit, for
    every row count of ``PROBE_ROWS`` (``probe`` has ``max(PROBE_ROWS)`` rows)."""
    return all(torch.equal(call(probe[:rows]), reference[:rows]) for rows in PROBE_ROWS)


def rows_independent(call, own: torch.Tensor, probe: torch.Tensor) -> bool:
    """Whether ``call``'s rows never change with the rows beside them: ``own`` (its result on all
    of ``probe``) again for every row count of ``PROBE_ROWS``, and for a lone row."""
    return rows_match(call, own, probe) and torch.equal(call(probe[:1]), own[:1])


def file_product_refusal(kernel, weights: torch.Tensor) -> str | None:
    """Why ``kernel`` (fp32 rows in, rounded to bf16 inside) does not run a file's matrix
    (``weights``, dequantized (N, K)): where its results on the probe rows are not the weights'
    product to fp32 rounding (to ``kernel.tolerance`` where it rounds its rows more than to bf16),
    or its rows change with their company; None where it passes."""
    probe = probe_rows(weights.shape[1], torch.float32)
    with torch.inference_mode():
        own = kernel(probe)
        want = probe.bfloat16().float() @ weights.T
        if not (own - want).norm() <= getattr(kernel, "tolerance", 1e-4) * want.norm():
            return "its results are not the file's weights' product"
        if not rows_independent(kernel, own, probe):
            return "its rows change with the number of rows in a call"
    return None


def probe_rows(in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The fixed input the probes compare kernels on."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(max(PROBE_ROWS), in_features, generator=generator).to(dtype)


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN can pack bf16 weights on this CPU (AVX-512 or AVX-NE-CONVERT and up), whether
    or not the CPU multiplies bf16 in hardware. Asked once per process: the CPU does not change."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 16)
    except RuntimeError:  # "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl ..."
        return False
    return True


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX, as PyTorch reports
    them) on oneDNN's bf16 path. AVX-512 without those instructions has that path too, but it
    converts to fp32 and back, so bf16 costs more per row than fp32 there, as on an AVX2-only CPU's
    generic path (docs/BENCHMARKS.md, "A CPU without bf16 matrix kernels" and "AVX-512 without bf16
    instructions")."""
    # Private PyTorch probes: a release without one counts as a CPU without those instructions (fp32).
    probes = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return any(probe is not None and probe() for probe in probes) and onednn_bf16()


def _packed_rows(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> str | None:
    """Which inputs the packed weight may serve without changing a number: "multi-row" (it equals
    ``F.linear`` for every row count of the probe), "all" (its rows never change with the number of
    rows, a lone row included), or None (neither: stay on ``F.linear``)."""
    probe = probe_rows(weight.shape[1], weight.dtype)

    def call(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    if rows_match(call, F.linear(probe, weight, bias), probe):
        return "multi-row"
    if rows_independent(call, call(probe), probe):
        return "all"
    return None


class Linear:
    """``x @ weight.T (+ bias)``, with ``weight`` pre-packed where that is exact (see above).

    ``weight`` stays available unchanged (the drafter shares the target's LM head)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True) -> None:
        self.weight = weight
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.lone_row_packed = False  # whether a single row goes to the packed kernel too
        if pack and _packing_available(weight) and (bias is None or bias.dtype == weight.dtype):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
            except RuntimeError:  # a oneDNN build or CPU without this layout: stay on F.linear
                packed = None
            serves = _packed_rows(weight, bias, packed) if packed is not None else None
            if serves is not None:
                self.packed, self.lone_row_packed = packed, serves == "all"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A lone row goes to F.linear unless the packed kernel rounds it as it rounds a block,
        # so the result is either always F.linear's or never depends on the rows beside it.
        if self.packed is not None and x.dtype == self.weight.dtype and (self.lone_row_packed or x.numel() > x.shape[-1]):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class PackedModuleForward:
    """A frozen ``nn.Linear``'s forward through a packed copy of its weight (``Linear``); while
    the module's weight or bias is replaced or changed in place, the module's own math runs."""

    def __init__(self, module: torch.nn.Linear, linear=None) -> None:
        self.module = module
        # ``linear``: another kernel of the same product (``aoti_kernels.drafter_kernels``).
        self.linear = linear or Linear(module.weight.detach(), None if module.bias is None else module.bias.detach())
        self._source = self._state()

    def _state(self) -> tuple:
        return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in (self.module.weight, self.module.bias) if p is not None)

    @property
    def active(self) -> bool:
        return getattr(self.linear, "packed", True) is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._state() == self._source:
            return self.linear(x)
        return F.linear(x, self.module.weight, self.module.bias)


def pack_linears(model: torch.nn.Module) -> int:
    """Route every ``nn.Linear`` of a model used for inference through packed weights where that
    is exact (see ``Linear``); the state dict is untouched. Returns how many were packed."""
    packed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            forward = PackedModuleForward(module)
            if forward.active:
                module.forward = forward  # an instance attribute: nn.Module.__call__ runs it
                packed += 1
    return packed
