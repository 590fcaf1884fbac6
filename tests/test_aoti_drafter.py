"""The drafter's layers compiled whole around attention (``aoti_drafter``): its decode passes propose
what the eager layers propose, every other call runs the eager layers, a probe refuses a kernel
whose weights were put together wrongly, and the load log says what runs."""

from __future__ import annotations

import copy

import pytest
import torch

from dflash_core import aoti_drafter, aoti_kernels, int8_dot
from dflash_core.aoti_drafter import compile_drafter_layers
from dflash_core.aoti_layers import CompiledHalf, HalfThenDown, layer_library
from dflash_core.speculative import GenerationConfig, collect, stream
from dflash_core.target import FastTarget
from dflash_core.testing import PROMPTS, tiny_drafter, tiny_target, two_shape_llama

pytestmark = pytest.mark.skipif(not aoti_kernels.available(), reason="no C++ compiler or AOTInductor here")


def test_the_switch_and_the_drafter_decide_before_anything_is_built(monkeypatch):
    monkeypatch.setattr(aoti_drafter, "before_library", lambda spec: pytest.fail("nothing is built"))
    model = tiny_target("llama")
    monkeypatch.setenv(aoti_drafter.SWITCH, "0")
    assert compile_drafter_layers(tiny_drafter(model), "float32") == "layers eager (turned off, DFLASH_AOTI_DRAFTER_LAYERS=0)"
    monkeypatch.delenv(aoti_drafter.SWITCH)
    bf16 = tiny_drafter(model).to(torch.bfloat16)
    assert compile_drafter_layers(bf16, "float32") == "layers eager (compiled for fp32 drafters on CPU with a compiler)"
    assert all(layer.compiled is None for layer in bf16.layers)


class Counting:
    def __init__(self, compiled) -> None:
        self.compiled, self.calls = compiled, 0

    def handles(self, *args) -> bool:
        return self.compiled.handles(*args)

    def __call__(self, *args):
        self.calls += 1
        return self.compiled(*args)


@pytest.mark.slow
def test_compiled_drafter_layers_propose_as_the_eager_ones_and_step_aside_for_other_calls(kernel_cache):
    model = two_shape_llama()
    runner = FastTarget(model)
    drafter = tiny_drafter(model, layers=2)
    eager = copy.deepcopy(drafter)
    note = compile_drafter_layers(drafter, "float32")
    if note.startswith("layers eager"):  # a build or probe refused here: it says why, and nothing runs compiled
        assert all(layer.compiled is None for layer in drafter.layers)
        return
    assert note == "2 of 2 layers compiled whole around attention (float32 matrices)"
    counters = [Counting(layer.compiled) for layer in drafter.layers]
    for layer, counter in zip(drafter.layers, counters):
        layer.compiled = counter
    # Decoding: the same drafts cycle by cycle (fp32 rounding apart, no draft moves here), through
    # the compiled passes.
    for prompt in PROMPTS:
        cfg = GenerationConfig(max_new_tokens=40, block_size=8).validated(16)
        want, got = (collect(stream(runner, d, prompt, cfg)) for d in (eager, drafter))
        assert got.token_ids == want.token_ids
        assert [c.drafted for c in got.cycles] == [c.drafted for c in want.cycles]
    assert all(counter.calls > 0 for counter in counters)
    # A batch of sequences (training's calls) runs the eager layers: the same numbers bit for bit.
    noise = torch.randn(2, 8, model.config.hidden_size)
    features = torch.randn(2, 5, len(drafter.target_layer_ids) * model.config.hidden_size)
    calls = sum(c.calls for c in counters)
    with torch.inference_mode():
        assert torch.equal(drafter(noise, torch.arange(5, 13), features, torch.arange(5)),
                           eager(noise, torch.arange(5, 13), features, torch.arange(5)))
    assert sum(c.calls for c in counters) == calls
    # Weights changed in place (a drafter being trained): that layer runs eager from then on.
    for d in (drafter, eager):
        with torch.no_grad():  # as an optimizer steps
            d.layers[0].mlp.down_proj.weight.mul_(2)
    for counter in counters:
        counter.calls = 0
    cfg = GenerationConfig(max_new_tokens=20, block_size=8).validated(16)
    want, got = (collect(stream(runner, d, PROMPTS[0], cfg)) for d in (eager, drafter))
    assert [c.drafted for c in got.cycles] == [c.drafted for c in want.cycles]
    assert counters[0].calls == 0 and counters[1].calls > 0


@pytest.mark.slow
def test_the_probe_refuses_a_layer_whose_weights_were_put_together_wrongly(kernel_cache):
    model = two_shape_llama()
    layer = tiny_drafter(model).layers[0]
    before_spec, after_spec = aoti_drafter._spec(layer, "float32")
    before, after = aoti_drafter._params(layer, "float32")
    half = after["gate_up.weight"].shape[0] // 2
    swapped = {**after, "gate_up.weight": torch.cat((after["gate_up.weight"][half:], after["gate_up.weight"][:half]))}
    right = aoti_drafter.CompiledDrafterLayer(layer, CompiledHalf(*aoti_drafter.before_library(before_spec), before),
                                              CompiledHalf(*layer_library(after_spec, "after"), after))
    wrong = aoti_drafter.CompiledDrafterLayer(layer, CompiledHalf(*aoti_drafter.before_library(before_spec), before),
                                              CompiledHalf(*layer_library(after_spec, "after"), swapped))
    assert aoti_drafter.probe_layer(layer, right, "float32")
    assert not aoti_drafter.probe_layer(layer, wrong, "float32")


@pytest.mark.slow
def test_w8a8_drafter_layers_round_their_rows_as_the_targets_and_keep_the_output(kernel_cache):
    # Beside a w8a8 target the drafter's layers take int8 rows too (unsigned where inductor has a
    # kernel for those only): drafts may move, the output may not; a misplaced weight is refused.
    model = two_shape_llama()
    runner = FastTarget(model)
    drafter = tiny_drafter(model, layers=2)
    rows = aoti_kernels.w8a8_rows()[0]
    note = compile_drafter_layers(drafter, "w8a8")
    if rows is None:  # no int8 x int8 kernel here (AVX2): the int8 weight-only layers
        assert note.endswith("(int8 matrices)") or note.startswith("layers eager"), note
        return
    if note.startswith("layers eager"):
        pytest.fail(f"the w8a8 drafter layers were refused: {note}")
    dot = int8_dot.unavailable() is None  # down through bf16 dot products where they run, as the target's
    assert note == "2 of 2 layers compiled whole around attention (w8a8 matrices" + (
        ", rows unsigned" if rows == "uint8" else "") + (", down through bf16 dot products)" if dot else ")")
    assert all(isinstance(layer.compiled.after, HalfThenDown) == dot for layer in drafter.layers)
    counters = [Counting(layer.compiled) for layer in drafter.layers]
    for layer, counter in zip(drafter.layers, counters):
        layer.compiled = counter
    for prompt in PROMPTS:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=40, block_size=1).validated(16)))
        got = collect(stream(runner, drafter, prompt, GenerationConfig(max_new_tokens=40, block_size=8).validated(16)))
        assert got.token_ids == ar.token_ids
    assert all(counter.calls > 0 for counter in counters)
    layer = drafter.layers[0]
    before_spec, after_spec = aoti_drafter._spec(layer, "w8a8", rows)
    before, after = aoti_drafter._params(layer, "w8a8")
    half = after["gate_up.weight"].shape[0] // 2
    swapped = {**after, **{key: torch.cat((after[key][half:], after[key][:half]))
                           for key in ("gate_up.weight", "gate_up.scales")},
               "gate_up.codes_t": torch.cat((after["gate_up.codes_t"][:, half:], after["gate_up.codes_t"][:, :half]), 1)}
    wrong = aoti_drafter.CompiledDrafterLayer(layer, CompiledHalf(*aoti_drafter.before_library(before_spec), before),
                                              CompiledHalf(*layer_library(after_spec, "after"), swapped))
    assert not aoti_drafter.probe_layer(layer, wrong, "w8a8", aoti_drafter.W8A8_TOLERANCE)
