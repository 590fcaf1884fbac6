"""Weight-only int8 products through bf16 dot products (``int8_dot``): the eager int8 product's
numbers to fp32 rounding, every row's numbers independent of the rows beside it, a residual added
in the same pass, and clear reasons where the kernel does not run."""

from __future__ import annotations

import pytest
import torch

from dflash_core import int8_dot
from dflash_core.weight_formats import Int8Weight

needs_kernel = pytest.mark.skipif(int8_dot.cannot_run() is not None, reason=f"int8_dot cannot run here: {int8_dot.cannot_run()}")


def weight(out_features: int, in_features: int, seed: int = 0) -> Int8Weight:
    generator = torch.Generator().manual_seed(seed)
    return Int8Weight(torch.randn(out_features, in_features, generator=generator) / in_features**0.5, torch.float32)


def exact(rows: torch.Tensor, eager: Int8Weight) -> torch.Tensor:
    """The product in float64 of the rows rounded to bf16, as the kernel takes them."""
    return (rows.bfloat16().double() @ eager.q.double().T) * eager.scales.double()


def test_codes_are_packed_a_pair_of_inputs_for_sixteen_outputs_at_a_time():
    q = torch.arange(32 * 4, dtype=torch.int16).reshape(32, 4).to(torch.int8)
    packed = int8_dot.pack(q)
    assert packed.shape == (2, 2, 32)
    # block 1, pair 1: outputs 16..31, inputs 2 and 3, interleaved
    assert packed[1, 1].tolist() == [v for n in range(16, 32) for v in q[n, 2:4].tolist()]


@needs_kernel
@pytest.mark.parametrize("shape", [(64, 48), (576, 1536), (1024, 576)])
def test_products_are_the_exact_ones_to_fp32_rounding_and_rows_never_depend_on_their_company(shape):
    eager = weight(*shape)
    kernel = int8_dot.Int8DotWeight(eager.q, eager.scales)
    rows = torch.randn(40, shape[1], generator=torch.Generator().manual_seed(1))
    got = kernel(rows)
    assert got.dtype == torch.float32 and got.shape == (40, shape[0])
    want = exact(rows, eager)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    # every number of rows, across the kernel's blocks of 16 and the tile widths of few rows
    for count in range(1, 41):
        assert torch.equal(kernel(rows[:count]), got[:count]), count
    # the eager int8 kernel of the same codes, to its own rounding
    assert ((got - eager(rows)).norm() / got.norm()).item() < 1e-2


@needs_kernel
def test_a_residual_is_added_in_the_same_pass_and_the_result_takes_its_dtype():
    eager = weight(64, 96)
    kernel = int8_dot.Int8DotWeight(eager.q, eager.scales)
    generator = torch.Generator().manual_seed(2)
    rows, residual = torch.randn(5, 96, generator=generator).bfloat16(), torch.randn(5, 64, generator=generator)
    got = kernel(rows, add=residual)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact(rows, eager) + residual.double(), rtol=1e-5, atol=1e-5)
    assert torch.equal(kernel.rows(rows, residual), got)
    # rows of any leading shape, in and out in their dtype
    assert kernel(rows.float().reshape(5, 1, 96)).shape == (5, 1, 64)
    assert kernel(rows).dtype == torch.bfloat16


@needs_kernel
def test_the_probe_accepts_the_kernel_and_refuses_shapes_it_does_not_take(monkeypatch):
    monkeypatch.setattr(int8_dot, "unavailable", lambda: None)  # whatever the policy on this CPU
    kernel, why = int8_dot.int8_dot_weight(weight(64, 96))
    assert why is None and isinstance(kernel, int8_dot.Int8DotWeight)
    kernel, why = int8_dot.int8_dot_weight(weight(60, 96))
    assert kernel is None and why == "a 60x96 matrix on cpu (it takes CPU matrices of 16 outputs and pairs of inputs)"


def test_where_it_does_not_run_the_engine_is_told_why(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert int8_dot.cannot_run() == "PyTorch runs this CPU as AVX2, not AVX512"
    assert int8_dot.int8_dot_weight(weight(64, 96)) == (None, "PyTorch runs this CPU as AVX2, not AVX512")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert int8_dot.cannot_run() == "this CPU has no AVX512-BF16"


def test_with_amx_inductors_kernel_is_left_to_its_tiles(monkeypatch):
    from dflash_core import isa_emulation

    monkeypatch.setattr(int8_dot, "cannot_run", lambda: None)
    monkeypatch.setattr(isa_emulation, "has_amx", lambda: True)
    monkeypatch.delenv(isa_emulation.VARIABLE, raising=False)
    assert int8_dot.unavailable() == "this CPU has AMX, whose tiles inductor's int8 GEMM uses"
    monkeypatch.setenv(isa_emulation.VARIABLE, "avx512-no-amx")  # AMX hidden: as an EPYC Zen 4
    assert int8_dot.unavailable() is None


def q8_blocks(out_features: int, in_features: int, seed: int = 0):
    """Random Q8_0 blocks with fp16 scales, as a GGUF holds them."""
    from dflash_core.weight_formats import Q8Blocks

    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    d = (torch.rand(out_features, in_features // 32, generator=generator) * 0.01 + 1e-4).half().float()
    return Q8Blocks(q, d)


@needs_kernel
@pytest.mark.parametrize("shape", [(64, 64), (49152 // 64, 576)])
def test_q8_0_products_are_the_files_weights_to_fp32_rounding_and_rows_never_depend_on_their_company(shape):
    blocks = q8_blocks(*shape)
    kernel, why = int8_dot.q8_dot_weight(blocks)
    assert why is None
    rows = torch.randn(20, shape[1], generator=torch.Generator().manual_seed(1))
    got = kernel(rows)
    want = rows.bfloat16().double() @ blocks.dequantize().double().T
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    # closer to the file than int8 with one scale per output (what the int8 head requantizes to)
    requantized = Int8Weight(blocks.dequantize(), torch.float32)
    assert (got.double() - want).norm() < (exact(rows, requantized) - want).norm()
    lone = torch.cat([kernel(rows[i : i + 1]) for i in range(rows.shape[0])])
    assert torch.equal(lone, got)
    add = torch.randn(20, shape[0])
    assert torch.equal(kernel.rows(rows.bfloat16().contiguous(), add), got + add)


def test_q8_0_blocks_are_read_as_gguf_dequantizes_them():
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from dflash_core import weight_formats

    rng = np.random.default_rng(0)
    rows, cols = 8, 64
    raw = rng.integers(0, 256, size=(rows * cols // 32, 34), dtype=np.uint8)
    raw[:, 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)  # a finite scale
    blocks = weight_formats._unpack_q8_0(raw.reshape(rows, -1), rows, cols)
    expected = gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(expected))
