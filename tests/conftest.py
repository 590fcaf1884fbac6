"""Shared fixtures: tiny random targets built in the test, drafters shaped for them, SmolLM2."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def tiny_target(family: str = "llama", vocab: int = 96, layers: int = 4, seed: int = 0, dtype=torch.float32):
    """A randomly initialised causal LM small enough for hundreds of generations per second."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        raise ValueError(family)
    # Sharper logits than the default init, so greedy decoding has clear winners and the
    # generated text is not one token repeated.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.to(dtype).eval()


def tiny_drafter(target, layers: int = 1, block_size: int = 16, seed: int = 0, mask_token_id: int = 3):
    from dflash_core.drafter import DFlashDrafter, DrafterConfig, init_drafter_weights

    config = DrafterConfig.for_target(target.config, num_layers=layers, mask_token_id=mask_token_id, block_size=block_size)
    drafter = DFlashDrafter(config)
    init_drafter_weights(drafter, std=0.2, seed=seed)
    return drafter.to(target.dtype).eval()


@pytest.fixture(scope="session")
def smollm2_engine():
    """The real SmolLM2-135M target with a random drafter (the pair that needs no training)."""
    from dflash_core.engine import Engine

    return Engine.from_registry("smollm2-135m-random")
