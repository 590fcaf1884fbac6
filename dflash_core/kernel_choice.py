"""Which kernels a ``FastTarget`` runs on this machine, decided when it loads.

A target asks for a weight format (``weight_formats.WEIGHT_FORMATS``) and a family of matrix
kernels (``aoti_kernels.KERNELS``); what runs depends on the CPU (AVX2, AVX512-VNNI, AVX512-BF16,
AMX), on a C++ compiler and on the file the weights came from. ``choose_kernels`` settles it in
order, each step falling back to what runs here and saying why in the target's notes
(``weight_note``, ``kernel_note``):

1. the weight format: w8a8 and w4a8 need int8 rows, int4 needs ``q4_dot``; else the next format
   that runs (int4, int8, bf16);
2. the kernels: with ``"aoti"``, whole compiled layers and attention (``aoti_layers``,
   ``q4_layers``, ``aoti_attention``) where they build, else inductor's GEMM matrix by matrix; the
   LM head on the GGUF's own Q8_0 blocks where they are the loaded head's weights;
3. the padding probe (``probe_min_rows``): the fewest rows per pass that make every position's
   logits independent of how many rows share its pass. Kernels that no padding makes batch
   invariant are given up for those that are (oneDNN, bf16), so greedy DFlash still equals
   greedy AR bit for bit;
4. a w4a8 target's layers in one C++ call per pass (``q4_layers.fused_pass``), and CUDA graphs
   on a GPU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from . import cuda_graphs
from .int8_dot import Int8DotWeight, Q8DotWeight, int8_dot_weight, q8_dot_weight
from .int8_rows import Q8Q8DotWeight, instructions as int8_rows_instructions, q8q8_dot_weight
from .kv_cache import round_capacity
from .weight_formats import Int8Weight, QuantizedLinear, quantized_layers

if TYPE_CHECKING:
    from .target import FastTarget

# Fewest rows per pass the probe tries (``probe_min_rows``): with oneDNN's and PyTorch's matrix
# kernels a lone row takes a matrix-vector path that rounds differently, so 2 is the least; more
# padding costs a little more compute per autoregressive step.
MIN_ROWS_CANDIDATES = (2, 4, 8, 16)
# Weight formats whose matrices (and LM head) run on int8_rows' C++ tiles, which compute each row
# alone whatever its company, with no matrix-vector path for a lone row: there one row is probed
# first, and a pass with it saves an autoregressive step a padding row's products.
LONE_ROW_FORMATS = ("w4a8",)
# What the probe decodes: a prompt in one pass, then the rest in passes of every size up to a
# block of 16 (single tokens are autoregressive steps; blocks and trees are verify passes),
# compared with the same positions decoded 16 at a time. The prompt's pass is shared: greedy AR
# and DFlash run the same prefill, so only the passes after it must agree (matrix kernels may
# take another path for a prompt's many rows: the AMX Xeon's oneDNN bf16 kernels do above 32
# rows, docs/BENCHMARKS.md).
PROBE_PROMPT = 37
PROBE_CHUNKS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 8)  # 144 = 9 blocks of 16
PROBE_BLOCK = 16  # the widest pass the probe covers: the block size of every drafter we know


def choose_kernels(target: FastTarget, weights: str, kernels: str, q4_blocks: dict | None,
                   calibration_ids: torch.Tensor | None) -> None:
    """Set ``target``'s layers, LM head, ``weight_format`` / ``weight_note``, ``kernels`` /
    ``kernel_note``, ``min_rows`` / ``batch_invariant`` and its compiled parts to what runs here
    (the steps in the module's docstring). ``target`` holds its bf16 fused weights and those
    attributes' defaults (bf16, oneDNN) on entry;
    ``q4_blocks``: a GGUF's own blocks (``weight_formats.q4_1_blocks``), or None."""
    bf16_layers = target.layers
    asked, weights, missing = weights, *_runnable_format(target, weights, kernels)
    if weights != "bf16":
        if asked == "w8a8" and calibration_ids is None:
            raise ValueError("weights = 'w8a8' needs calibration_ids: token ids of a text whose activation maxima "
                             "set the smoothing factors (loading passes weight_formats' calibration text)")
        maxima = target.activation_maxima(calibration_ids) if weights == "w8a8" else None
        layers, note = quantized_layers(target.layers, weights, target.dtype, q4_blocks, maxima)
        if layers is None:
            target.weight_note = f"asked for {weights}, running bf16: {note}"
        else:
            target.layers, target.weight_format, target.weight_note = layers, weights, note
        if missing:
            target.weight_note = f"asked for {asked}, running {weights} ({missing}): {target.weight_note}"
    onednn_layers, onednn_head = target.layers, target._lm_head
    if kernels == "aoti":
        target.kernels, target.kernel_note = _use_aoti(target)
    target.min_rows, target.batch_invariant = probe_min_rows(target)
    if target.kernels == "aoti" and not target.batch_invariant:
        target.layers, target._lm_head, target.kernels = onednn_layers, onednn_head, "onednn"
        target.compiled_layers, target.attention = False, None
        target.kernel_note = ("asked for aoti, running oneDNN: with its kernels no padding made a position's "
                              "logits independent of the size of its pass on this CPU")
        target.min_rows, target.batch_invariant = probe_min_rows(target)
    if target.weight_format != "bf16" and not target.batch_invariant:
        ran = target.weight_format
        target.layers, target.weight_format = bf16_layers, "bf16"
        target.min_rows, target.batch_invariant = probe_min_rows(target)
        target.weight_note = (f"asked for {asked}, running bf16: {f'{missing}; ' if missing else ''}with {ran} kernels "
                              "no padding made a position's logits independent of the size of its pass on this CPU")
    if target.compiled_layers and target.batch_invariant and target.weight_format == "w4a8":
        from .q4_layers import fused_pass

        target._fused_pass, fused_note = fused_pass(target)
        target.kernel_note += f"; {fused_note}"
    if cuda_graphs.wanted(target.device):
        target.graphs = cuda_graphs.CudaGraphs(target)


def _runnable_format(target: FastTarget, weights: str, kernels: str) -> tuple[str, str | None]:
    """The weight format nearest ``weights`` whose kernels run here, and why it is not
    ``weights`` (None where it is)."""
    missing = None
    on_cpu = target.device.type == "cpu"
    if weights == "w8a8" and kernels == "aoti" and on_cpu:
        # Compiled int8 x int8 products through a reference loop run several times slower than
        # the int8 weight-only kernels (docs/BENCHMARKS-AMD.md): those run instead where
        # inductor has a vector kernel for neither signed nor unsigned rows.
        from .aoti_kernels import w8a8_rows

        missing = w8a8_rows()[1]
        weights = "int8" if missing else weights
    if weights == "w4a8" and on_cpu:
        # int8 rows need AVX2 or AVX512-VNNI: elsewhere the file's codes run with bf16 rows (int4), or int8 below
        from .int8_rows import refusal

        why = refusal()
        missing = f"w4a8's kernel cannot run: {why}" if why else None
        weights = "int4" if missing else weights
    if weights == "int4" and kernels == "aoti" and on_cpu:
        # PyTorch's own int4 kernel costs several 2-row passes for a 16-row one (docs/BENCHMARKS.md):
        # where q4_dot cannot run, the compiled int8 layers run instead.
        from .int8_dot import cannot_run

        why = cannot_run()
        if why:
            missing = f"{missing + '; ' if missing else ''}q4_dot cannot run: {why}"
        weights = "int8" if why else weights
    return weights, missing


def _use_aoti(target: FastTarget) -> tuple[str, str]:
    """Every matrix (the layers' and the LM head) through inductor's C++ GEMM where its probe
    allows (``aoti_kernels``): fp32 matrices as they are, the layers' int8 weight-only ones
    (``weights = "int8"``) through its int8 GEMM; returns (kernels, note)."""
    from . import aoti_attention, aoti_kernels, aoti_layers

    if target.weight_format in ("int4", "w4a8") and target.device.type == "cpu":
        return _q4_layers(target)
    if target.weight_format not in ("bf16", "int8", "w8a8"):
        return "onednn", f"asked for aoti, running oneDNN: the layers run {target.weight_format} kernels (no C++ GEMM for them)"
    if target.device.type != "cpu" or not aoti_kernels.available():
        return "onednn", "asked for aoti, running oneDNN: AOTInductor needs a CPU target and a C++ compiler"
    # Whole layers first (the element-wise work fused around the GEMMs); else matrix by matrix.
    compiled, layers_note = aoti_layers.compiled_layers(target)
    head_why = _aoti_head(target, aoti_kernels)
    head_note = f"the LM head {_head_note(target, head_why)}"
    if compiled is not None:
        target.layers, target.compiled_layers = compiled, True
        target.attention, attention_note = aoti_attention.compiled_attention(target)
        if target.attention is None:
            attention_note = f"attention eager ({attention_note})"
        return "aoti", f"{layers_note}; {attention_note}; {head_note}"
    refused: list[str] = []

    def swap(linear):
        if isinstance(linear, QuantizedLinear):
            kernel, why = aoti_kernels.aoti_int8_linear(linear)
        else:
            kernel, why = aoti_kernels.aoti_linear(linear)
        if why:
            refused.append(why)
        return kernel

    target.layers = [replace(layer, qkv=swap(layer.qkv), o=swap(layer.o), gate_up=swap(layer.gate_up),
                             down=swap(layer.down)) for layer in target.layers]
    if head_why:
        refused.append(head_why)
    total = 4 * len(target.layers) + 1
    if len(refused) == total:
        return "onednn", f"asked for aoti, running oneDNN: {refused[0]}"
    note = f"inductor C++ GEMM (AOTInductor) for {total - len(refused)} of {total} matrices"
    if target.weight_format == "int8":
        note += " (int8 weight-only, their rows in bf16)"
    note += f"; layers not compiled whole: {layers_note}"
    return "aoti", note + (f"; the others run their own kernels ({refused[0]})" if refused else "")


def _q4_layers(target: FastTarget) -> tuple[str, str]:
    """A Q4_1 GGUF's layers on ``q4_dot`` with the work between the products fused into their
    calls (``q4_layers``), attention and the LM head compiled where they run; returns (kernels, note)."""
    from . import aoti_attention, aoti_kernels, q4_layers

    layers, note = q4_layers.q4_layers(target)
    head = f"the LM head {_head_note(target, _aoti_head(target, aoti_kernels))}"
    if layers is None:
        return "aoti", f"the int4 layers eager ({note}); {head}"
    target.layers, target.compiled_layers = layers, True
    target.attention, attention_note = aoti_attention.compiled_attention(target)
    if target.attention is None:
        attention_note = f"attention eager ({attention_note})"
    return "aoti", f"{note}; {attention_note}; {head}"


def file_head(target: FastTarget) -> str | None:
    """The LM head on the GGUF's own Q8_0 blocks (``int8_dot.q8_dot_weight``; w4a8's with int8
    rows, ``int8_rows.q8q8_dot_weight``) where they are the loaded head's weights and the kernel
    runs here; else why not."""
    blocks = target._head_blocks
    weight = target.lm_head_weight
    if tuple(blocks.q.shape) != tuple(weight.shape) or not torch.equal(blocks.dequantize().to(weight.dtype), weight):
        return "the GGUF's Q8_0 output blocks are not the loaded head's weights"
    head, why = q8q8_dot_weight(blocks) if target.weight_format == "w4a8" else q8_dot_weight(blocks)
    if head is not None:
        target._lm_head = QuantizedLinear(head)
    return why


def _head_note(target: FastTarget, why: str | None) -> str:
    if why:
        return f"on oneDNN ({why})"
    kernel = getattr(target._lm_head, "kernel", None)
    if isinstance(kernel, Q8DotWeight):
        return "the GGUF's Q8_0 blocks through bf16 dot products"
    if isinstance(kernel, Q8Q8DotWeight):
        return f"the GGUF's Q8_0 blocks with int8 rows ({int8_rows_instructions()})"
    note = ("int8 through bf16 dot products" if isinstance(kernel, Int8DotWeight)
            else "int8 through the int8 GEMM" if target.weight_format != "bf16" else "through the C++ GEMM")
    return note + (f" (not the GGUF's Q8_0 blocks: {target._file_head_why})" if target._file_head_why else "")


def _aoti_head(target: FastTarget, aoti_kernels) -> str | None:
    """The LM head through the C++ GEMM (the int8 one where the layers run int8: the head's
    113 MB in fp32 was then a step's largest read); why not, where it stays as it was."""
    if target.weight_format in ("int4", "w4a8") and target._head_blocks is not None:
        target._file_head_why = file_head(target)
        if target._file_head_why is None:
            return None
    if target.weight_format in ("int8", "w8a8", "int4", "w4a8"):
        int8 = QuantizedLinear(Int8Weight(target.lm_head_weight, target.dtype))
        dot, _ = int8_dot_weight(int8.kernel)  # where it does not run, inductor's int8 GEMM
        head, why = (QuantizedLinear(dot), None) if dot else aoti_kernels.aoti_int8_linear(int8)
    else:
        head, why = aoti_kernels.aoti_linear(target._lm_head)
    if why is None:
        target._lm_head = head
    return why


def probe_min_rows(target: FastTarget) -> tuple[int, bool]:
    """The fewest rows per pass (1 first for the ``LONE_ROW_FORMATS``, then
    ``MIN_ROWS_CANDIDATES``) with which, after a prompt's pass, decoding in passes of every
    size in ``PROBE_CHUNKS`` gives, bit for bit, the logits of decoding the same positions
    ``PROBE_BLOCK`` at a time; ``(MIN_ROWS_CANDIDATES[0], False)`` when none does.

    Matrix kernels choose their code path (GEMV, register blocking, K split) from the number
    of rows, and which row counts share a path differs between CPUs (AMD / Intel, AVX2 /
    AVX-512 / AMX) and dtypes. Padding small passes to ``min_rows`` keeps them on the path
    the larger passes take; the probe finds the padding that does so here. Every decode pass
    of the engine (an autoregressive step, a verify block, a tree of up to ``PROBE_BLOCK``
    nodes) is one of these sizes; the prompt's pass is the same in AR and DFlash."""
    chunks = list(PROBE_CHUNKS)
    while PROBE_PROMPT + sum(chunks) > target.max_positions and len(chunks) > 1:  # a short context
        chunks.pop()
    prompt = max(1, min(PROBE_PROMPT, target.max_positions - sum(chunks)))
    decoded = sum(chunks)
    blocks = [PROBE_BLOCK] * (decoded // PROBE_BLOCK) + ([decoded % PROBE_BLOCK] if decoded % PROBE_BLOCK else [])
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (prompt + decoded,), generator=generator).to(target.device)
    capacity = round_capacity(prompt + decoded)

    def decode(sizes: list[int]) -> torch.Tensor:
        target.reset(capacity)
        target.forward(ids[:prompt], None, last_only=True)
        pieces, start = [], prompt
        for size in sizes:
            pieces.append(target.forward(ids[start : start + size], None).logits)
            start += size
        return torch.cat(pieces)

    lone = (1,) if target.weight_format in LONE_ROW_FORMATS else ()
    for min_rows in lone + MIN_ROWS_CANDIDATES:
        target.min_rows = min_rows
        if torch.equal(decode(chunks), decode(blocks)):
            target.reset(capacity)
            return min_rows, True
    target.reset(capacity)
    return MIN_ROWS_CANDIDATES[0], False
