"""Pre-packed linear layers (dflash_core/kernels.py): same numbers as F.linear, or not used."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash_core.kernels import Linear, native_bf16, onednn_bf16, padded_rows
from dflash_core.target import TargetOutput
from dflash_core.testing import tiny_target


def _packing_expected() -> bool:
    """bf16 weights can be packed: oneDNN has a bf16 path on this CPU (AVX-512 and up; not AVX2)."""
    return onednn_bf16()


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_for_every_row_count(bias):
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(384, 192, generator=g) * 0.05).to(torch.bfloat16)
    b = (torch.randn(384, generator=g) * 0.1).to(torch.bfloat16) if bias else None
    linear = Linear(weight, b)
    if linear.packed is None:
        assert not _packing_expected(), "oneDNN is available, yet the packed weight was refused"
        pytest.skip("this machine's oneDNN does not pack bf16 weights exactly")
    x = torch.randn(70, 192, generator=g).to(torch.bfloat16)
    reference = F.linear(x, weight, b)
    for rows in (2, 3, 5, 16, 17, 64, 70):
        assert torch.equal(linear(x[:rows]), reference[:rows]), rows
    # Rows that are a view with an offset (as a decoder slices its hidden states) pack the same.
    assert torch.equal(linear(x[5:21]), reference[5:21])


@pytest.mark.parametrize("bias", [False, True])
def test_float32_weights_are_packed_only_where_no_row_changes_with_its_neighbours(bias):
    """fp32 packing is used either as F.linear's equal (a lone row then stays on F.linear) or as
    a kernel whose every row, a lone one included, is the same whatever rows share its call."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(384, 192, generator=g) * 0.05
    b = torch.randn(384, generator=g) * 0.1 if bias else None
    linear = Linear(weight, b)
    x = torch.randn(70, 192, generator=g)
    if linear.packed is None:
        assert torch.equal(linear(x), F.linear(x, weight, b))
        pytest.skip("this machine's oneDNN packs no fp32 weight exactly")
    whole = linear(x)
    for rows in (1, 2, 3, 5, 16, 17, 64):
        if rows == 1 and not linear.lone_row_packed:
            assert torch.equal(linear(x[:1]), F.linear(x[:1], weight, b))
        else:
            assert torch.equal(linear(x[:rows]), whole[:rows]), rows
    if not linear.lone_row_packed:  # the other way to qualify: F.linear's numbers on every block
        assert torch.equal(whole, F.linear(x, weight, b))
    torch.testing.assert_close(whole, F.linear(x, weight, b))


def test_other_dtypes_and_unpacked_linears_stay_on_f_linear():
    weight = torch.randn(64, 32).to(torch.float16)
    linear = Linear(weight)
    assert linear.packed is None
    x = torch.randn(4, 32).to(torch.float16)
    assert torch.equal(linear(x), F.linear(x, weight))
    assert Linear(weight.to(torch.bfloat16), pack=False).packed is None
    assert Linear(torch.randn(64, 32), pack=False).packed is None


def test_a_cpu_without_a_bf16_path_leaves_bf16_weights_on_f_linear_and_avx512_has_one():
    """onednn_bf16 against an independent witness (PyTorch's own CPU capability), and what follows
    from it: where it is False, a bf16 Linear is unpacked and still gives F.linear's numbers."""
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512") and torch.backends.mkldnn.is_available():
        assert onednn_bf16()
    weight = torch.randn(64, 32).to(torch.bfloat16)
    linear = Linear(weight)
    if not onednn_bf16():
        assert linear.packed is None
    x = torch.randn(5, 32).to(torch.bfloat16)
    assert torch.equal(linear(x), F.linear(x, weight)) or linear.lone_row_packed


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


def test_bf16_counts_as_native_only_where_the_cpu_has_bf16_instructions():
    """native_bf16 (what ``dtype = "auto"`` follows) against the flags the operating system reports:
    an AVX-512 CPU without AVX512-BF16 or AMX has oneDNN's bf16 path but converts on it: fp32."""
    flags = _cpu_flags()
    if not flags:
        pytest.skip("this system has no /proc/cpuinfo flags to witness the CPU's instructions")
    if not {"avx512_bf16", "amx_bf16"} & flags:
        assert not native_bf16()
    else:
        assert native_bf16() == onednn_bf16()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fast_target_layers_are_packed_and_lossless(family):
    """A bf16 target's projections and LM head are packed, and a token decoded alone still
    gets exactly the logits it gets inside a block (the property greedy DFlash relies on)."""
    from dflash_core.target import FastTarget

    runner = FastTarget(tiny_target(family, dtype=torch.bfloat16))
    layer = runner.layers[0]
    g = torch.Generator().manual_seed(4)
    for lin in (layer.qkv, layer.o, layer.gate_up, layer.down, runner._lm_head):
        # Packed where this machine's probe found it exact; either way F.linear's numbers.
        x = torch.randn(19, lin.weight.shape[1], generator=g).to(torch.bfloat16)
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    ids = torch.randint(5, runner.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    runner.reset(64)
    runner.forward(ids[:8], None)  # the prompt's pass, the same in both
    block = runner.forward(ids[8:], None).logits
    runner.reset(64)
    runner.forward(ids[:8], None)
    alone = torch.cat([runner.forward(ids[i : i + 1], None).logits for i in range(8, len(ids))])
    if runner.batch_invariant:  # what the load probe found on this machine
        assert torch.equal(block, alone)
    else:
        torch.testing.assert_close(block, alone, rtol=0, atol=0.1)


class _RoundsSmallPassesDifferently:
    """A runner whose layers round differently in passes of fewer than ``below`` rows, as a
    CPU's matrix kernels can (they pick their code path by the number of rows)."""

    below = 8

    def finish_layer(self, layer, x, attention):  # noqa: ANN001, D102
        out = super().finish_layer(layer, x, attention)
        return out * (1 + 2**-6) if x.shape[0] < self.below else out


class _RoundsLongPassesDifferently:
    """A runner whose passes of more than 32 rows round differently, as oneDNN's bf16 kernels on
    an AMX Xeon do: only a prompt's pass is that long, and AR and DFlash share it."""

    def finish_layer(self, layer, x, attention):  # noqa: ANN001, D102
        out = super().finish_layer(layer, x, attention)
        return out * (1 + 2**-6) if x.shape[0] > 32 else out


class _RoundsByWhereThePassStarts:
    """A runner no padding makes batch invariant: a pass that starts at an odd position rounds
    differently (as a kernel whose blocking follows the cache's alignment could), so a token
    rounds one way alone and another inside a block."""

    def positions_pass(self, ids, rows, real, layer_ids, last_only):  # noqa: ANN001, D102
        out = super().positions_pass(ids, rows, real, layer_ids, last_only)
        return TargetOutput(out.logits * (1 + 2**-6), out.features) if int(rows[0]) % 2 else out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_load_probe_pads_small_passes_until_they_round_like_blocks(family):
    from dflash_core.kernel_choice import MIN_ROWS_CANDIDATES
    from dflash_core.target import FastTarget

    model = tiny_target(family, dtype=torch.bfloat16)
    if not FastTarget(model).batch_invariant:
        pytest.skip("this machine's bf16 kernels are not batch invariant at any padding")
    Padded = type("Padded", (_RoundsSmallPassesDifferently, FastTarget), {})
    runner = Padded(model)
    assert (runner.min_rows, runner.batch_invariant) == (8, True)
    ids = torch.randint(5, runner.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    runner.reset(64)
    block = runner.forward(ids, None).logits
    runner.reset(64)
    assert torch.equal(block, torch.cat([runner.forward(ids[i : i + 1], None).logits for i in range(12)]))
    # A prompt's pass may round its own way: decoding after it is still exact, so the probe says so.
    LongPrompt = type("LongPrompt", (_RoundsLongPassesDifferently, FastTarget), {})
    runner = LongPrompt(model)
    assert (runner.min_rows, runner.batch_invariant) == (MIN_ROWS_CANDIDATES[0], True)
    # Kernels that no padding helps: the probe says so (the engine then promises rounding only).
    Hopeless = type("Hopeless", (_RoundsByWhereThePassStarts, FastTarget), {})
    runner = Hopeless(model)
    assert (runner.min_rows, runner.batch_invariant) == (MIN_ROWS_CANDIDATES[0], False)


def test_packed_drafter_gives_the_same_hidden_states_and_follows_weight_changes():
    """pack_for_inference changes no number; a weight changed afterwards is not served stale."""
    from dflash_core.testing import tiny_drafter

    target = tiny_target("qwen3", dtype=torch.bfloat16)
    drafter = tiny_drafter(target).to(torch.bfloat16).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(2)
    noise = torch.randn(1, 16, 64, generator=g).to(torch.bfloat16)
    features = torch.randn(1, 7, len(drafter.target_layer_ids) * 64, generator=g).to(torch.bfloat16)
    args = (noise, torch.arange(7, 23), features, torch.arange(7))
    with torch.inference_mode():
        plain = drafter(*args)
        packed_count = drafter.pack_for_inference()
        if _packing_expected():
            assert packed_count == sum(isinstance(m, torch.nn.Linear) for m in drafter.modules())
        assert torch.equal(drafter(*args), plain)
        drafter.layers[0].mlp.down_proj.weight.mul_(2.0)  # in place: the packed copy is now stale
        changed = drafter(*args)
        drafter.layers[0].mlp.down_proj.weight.div_(2.0)
    assert not torch.equal(changed, plain)
    unpacked = tiny_drafter(target).to(torch.bfloat16).eval().requires_grad_(False)
    with torch.inference_mode():
        unpacked.layers[0].mlp.down_proj.weight.mul_(2.0)
        assert torch.equal(unpacked(*args), changed)


def test_padded_rows_repeat_every_tensors_last_row_up_to_the_fewest_and_leave_longer_ones_alone():
    ids, depths = torch.tensor([5]), torch.tensor([[3, 4]])
    got_ids, got_depths = padded_rows(3, ids, depths)
    assert got_ids.tolist() == [5, 5, 5] and got_depths.tolist() == [[3, 4]] * 3
    long = torch.arange(4)
    assert padded_rows(2, long)[0] is long
