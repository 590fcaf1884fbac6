"""The bitsandbytes 4/8-bit target path (tested on CPU; the same code runs on CUDA)."""

from __future__ import annotations

import pytest
import torch

from dflash_core.loading import converted_gguf_dir, load_target, resolve_gguf
from dflash_core.registry import ModelSource, load_registry
from dflash_core.speculative import GenerationConfig, collect, stream
from dflash_core.target import HFTarget
from dflash_core.testing import tiny_drafter, tiny_target

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny-target")
    tiny_target("llama", seed=9).save_pretrained(folder)
    # Any tokenizer makes the folder loadable; the tests feed token ids directly.
    gguf = converted_gguf_dir(resolve_gguf(load_registry().get("smollm2-135m-random").target))
    AutoTokenizer.from_pretrained(gguf).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("quantization", ["8bit", "4bit"])
def test_quantized_target_is_lossless_through_the_generic_runner(tiny_dir, quantization):
    target = load_target(ModelSource("path", str(tiny_dir)), "float32", "cpu", quantization=quantization)
    assert isinstance(target.runner, HFTarget)  # quantized weights never take the fused fast path
    assert any(not p.dtype.is_floating_point for p in target.model.parameters())
    drafter = tiny_drafter(target.model)
    prompt = [5, 9, 14, 22, 31]
    ar = collect(stream(target.runner, None, prompt, GenerationConfig(max_new_tokens=24, block_size=1).validated(16)))
    for block in (4, 16):
        out = collect(stream(target.runner, drafter, prompt, GenerationConfig(max_new_tokens=24, block_size=block).validated(16)))
        assert out.token_ids == ar.token_ids
