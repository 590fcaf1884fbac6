"""A GGUF's Q4_1 matrices through bf16 dot products (``q4_dot``): the product of the file's own
weights (its fp16 scales and minimums kept exactly) to fp32 rounding, every row's numbers
independent of the rows beside it, and the int4 format running it where it can."""

from __future__ import annotations

import pytest
import torch

from dflash_core import int8_dot, q4_dot
from dflash_core.weight_formats import Int4Weight, Q4Blocks, int4_kernel

needs_kernel = pytest.mark.skipif(int8_dot.cannot_run() is not None, reason=f"q4_dot cannot run here: {int8_dot.cannot_run()}")


def blocks(out_features: int, in_features: int, seed: int = 0) -> Q4Blocks:
    """Random Q4_1 blocks with fp16 scales and minimums, as a GGUF holds them."""
    generator = torch.Generator().manual_seed(seed)
    groups = (out_features, in_features // 32)
    return Q4Blocks(torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.int32),
                    (torch.rand(groups, generator=generator) * 0.01 + 1e-3).half().float(),
                    (-torch.rand(groups, generator=generator) * 0.08).half().float())


def test_a_group_is_packed_as_four_input_pairs_per_load_then_the_files_fp16_scales_and_minimums():
    q = Q4Blocks(torch.arange(16 * 64).reshape(16, 64) % 16, torch.full((16, 2), 0.5), torch.full((16, 2), -2.0))
    q.d[3, 1], q.m[5, 1] = 0.25, -1.5
    packed = q4_dot.pack(q)
    assert packed.shape == (1, 2, q4_dot.GROUP_BYTES) and packed.dtype == torch.uint8
    group = packed[0, 1]  # inputs 32..63
    words = group[:256].view(torch.uint16).view(4, 32)
    # run 1 (inputs 40..47): word 2 j + s holds output j's input 40 + 2 v + s in nibble v
    for j in range(16):
        for s in range(2):
            word = int(words[1, 2 * j + s])
            assert [(word >> 4 * v) & 15 for v in range(4)] == [int(q.q[j, 40 + 2 * v + s]) for v in range(4)]
    scales, minimums = group[256:288].view(torch.float16), group[288:].view(torch.float16)
    assert torch.equal(scales.float(), q.d[:, 1]) and torch.equal(minimums.float(), q.m[:, 1])


def test_scales_that_are_not_fp16_numbers_are_refused():
    q = Q4Blocks(torch.zeros(16, 32, dtype=torch.int32), torch.full((16, 1), 0.1), torch.zeros(16, 1))
    with pytest.raises(ValueError, match="fp16"):
        q4_dot.pack(q)


@needs_kernel
@pytest.mark.parametrize("shape", [(64, 64), (576, 1536), (960, 576)])
def test_products_are_the_files_weights_to_fp32_rounding_and_rows_never_depend_on_their_company(shape):
    q4 = blocks(*shape)
    kernel = q4_dot.Q4DotWeight(q4)
    rows = torch.randn(40, shape[1], generator=torch.Generator().manual_seed(1))
    got = kernel(rows)
    exact = rows.bfloat16().double() @ (q4.q.double().view(shape[0], -1, 32) * q4.d.double()[..., None]
                                        + q4.m.double()[..., None]).view(*shape).T
    assert ((got.double() - exact).abs().max() / exact.abs().max()).item() < 1e-5
    for count in range(1, 41):  # across the kernel's sets of 8 rows and the tile widths of few rows
        assert torch.equal(kernel(rows[:count]), got[:count]), count
    # PyTorch's int4 kernel rounds the file's scales to bf16: farther from the file than this one
    torch_int4 = Int4Weight(q4, torch.float32)(rows).double()
    assert ((got.double() - exact).norm() < (torch_int4 - exact).norm())


@needs_kernel
def test_the_int4_format_runs_it_and_its_probe_refuses_shapes_it_does_not_take():
    assert isinstance(int4_kernel(blocks(64, 64), torch.bfloat16), q4_dot.Q4DotWeight)
    kernel, why = q4_dot.q4_dot_weight(blocks(40, 64))
    assert kernel is None and why == "a 40x64 matrix (it takes matrices of 16 outputs and groups of 32 inputs)"


def test_where_it_cannot_run_pytorchs_int4_kernel_runs(monkeypatch):
    monkeypatch.setattr(q4_dot, "cannot_run", lambda: "this CPU has no AVX512-BF16")
    assert q4_dot.q4_dot_weight(blocks(64, 64)) == (None, "this CPU has no AVX512-BF16")
    assert isinstance(int4_kernel(blocks(64, 64), torch.bfloat16), Int4Weight)
