"""Shared fixtures: tiny random targets built in the test, drafters shaped for them, SmolLM2."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Families ``tiny_target`` builds. The hybrid ones alternate layer kinds (the published models
# use 3 linear : 1 full and 1 sliding : 1 full; alternating gives both kinds in 2 layers).
TINY_FAMILIES = ("llama", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss")
TINY_SLIDING_WINDOW = 8  # gpt_oss: small, so generations of a few dozen tokens cross the window


def tiny_target(family: str = "llama", vocab: int = 96, layers: int = 4, seed: int = 0, dtype=torch.float32):
    """A randomly initialised causal LM small enough for hundreds of generations per second.

    ``qwen3_5``, ``qwen3_5_moe`` and ``qwen3_next`` alternate Gated DeltaNet (linear-attention)
    and full-attention layers; ``gpt_oss`` alternates sliding-window (``TINY_SLIDING_WINDOW``)
    and full-attention layers with attention sinks and a mixture of experts."""
    import transformers
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
    elif family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        hybrid = dict(
            head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=[("linear_attention", "full_attention")[i % 2] for i in range(layers)],
        )
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        if family == "qwen3_5":
            model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**hybrid, **common))
        elif family == "qwen3_5_moe":
            dense = {k: v for k, v in common.items() if k != "intermediate_size"}  # experts only
            model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**hybrid, **moe, **dense))
        else:
            model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**hybrid, **moe, **common))
    elif family == "gpt_oss":
        # gpt-oss's YaRN RoPE, its factor consistent with the short context (no warning).
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": common["max_position_embeddings"] // 32}
        config = transformers.GptOssConfig(
            head_dim=16, sliding_window=TINY_SLIDING_WINDOW, num_local_experts=4, num_experts_per_tok=2,
            layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
            rope_parameters=rope, **common,
        )
        model = transformers.GptOssForCausalLM(config)
    else:
        raise ValueError(f"family {family!r} is not one of {TINY_FAMILIES}")
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
