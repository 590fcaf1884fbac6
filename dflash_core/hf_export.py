"""Our drafters as transformers' own DFlash assistant (``muse_glimmer_assistant``).

transformers 5.x runs DFlash itself: ``model.generate(..., assistant_model=A,
speculation_type="dflash")`` drafts with ``DFlashTokenCandidateGenerator``, whose assistant class
``MuseGlimmerAssistantModel`` is z-lab's architecture under other parameter names. The weights map
one to one except the context projection: our ``fc`` / ``hidden_norm`` are its ``encoder.fc`` /
``encoder.output_norm_enc``. The config carries the same Qwen3 shapes plus ``block_size``,
``mask_token_id`` and ``target_layer_ids`` at top level.

What the assistant class cannot express is refused by name (``unsupported_for_hf``) rather than
exported into a model that would draft differently:

* causal layers and attention biases (the class has neither);
* sliding-window layers: transformers reads a window ``W`` as ``|p - j| <= W`` (its
  ``sliding_window_bidirectional_overlay``) where z-lab, vLLM, SGLang and we use ``|p - j| < W``,
  and its sliding cache layers keep ``W - 1`` past entries, so no single ``sliding_window`` value
  makes the two agree;
* z-lab's optional input/output scalings and logit soft-capping (its generator applies the target's
  LM head directly).

A reduced draft vocabulary (``draft_vocab.json``) is not refused: transformers' generator always
drafts over the target's whole vocabulary, so the exported assistant proposes from all of it.
``export_hf_assistant`` says so in its notes; it is one reason greedy acceptance can differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .drafter import DFlashDrafter
from .errors import ModelLoadError

# Our parameter names -> the assistant's (everything else keeps its name).
_RENAMES = (("fc.", "encoder.fc."), ("hidden_norm.", "encoder.output_norm_enc."))


def unsupported_for_hf(drafter: DFlashDrafter) -> list[str]:
    """What this drafter does that transformers' assistant class cannot (empty: it converts exactly)."""
    cfg = drafter.config
    problems = []
    if any(spec.causal for spec in drafter.layer_specs):
        problems.append("causal layers (the assistant attends bidirectionally over the block in every layer)")
    if any(spec.sliding_window is not None for spec in drafter.layer_specs):
        problems.append("sliding-window layers (transformers reads a window W as |p - j| <= W and its cache keeps "
                        "W - 1 entries; z-lab, vLLM, SGLang and DFlash Studio use |p - j| < W)")
    if getattr(cfg.qwen3, "attention_bias", False):
        problems.append("attention_bias (the assistant's projections have no bias)")
    if cfg.input_embedding_scale != 1.0 or cfg.output_multiplier != 1.0 or cfg.final_logit_softcapping:
        problems.append("input_embedding_scale / output_multiplier / final_logit_softcapping (the assistant's "
                        "generator reads the target's LM head output as is)")
    return problems


def assistant_config(drafter: DFlashDrafter):  # -> MuseGlimmerAssistantConfig (imported lazily)
    """The assistant's config for this drafter: the same shapes, RoPE and DFlash fields."""
    from transformers import MuseGlimmerAssistantConfig

    cfg, q = drafter.config, drafter.config.qwen3
    rope = dict(q.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    rope.setdefault("rope_type", "default")
    return MuseGlimmerAssistantConfig(
        hidden_size=q.hidden_size, intermediate_size=q.intermediate_size, num_hidden_layers=q.num_hidden_layers,
        num_attention_heads=q.num_attention_heads, num_key_value_heads=q.num_key_value_heads, head_dim=cfg.head_dim,
        rms_norm_eps=q.rms_norm_eps, rope_parameters=rope, max_position_embeddings=q.max_position_embeddings,
        hidden_act=q.hidden_act, layer_types=["full_attention"] * q.num_hidden_layers,
        block_size=cfg.block_size, mask_token_id=cfg.mask_token_id, target_layer_ids=list(cfg.target_layer_ids),
        vocab_size=cfg.vocab_size,
        # The assistant's own defaults are Muse Glimmer's special tokens; ours are the target's.
        bos_token_id=q.bos_token_id, eos_token_id=q.eos_token_id, pad_token_id=q.pad_token_id,
    )


def assistant_state_dict(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    """Our weights under the assistant's parameter names (the same tensors, not copies)."""
    state = {}
    for name, tensor in drafter.state_dict().items():
        for ours, theirs in _RENAMES:
            if name.startswith(ours):
                name = theirs + name.removeprefix(ours)
        state[name] = tensor
    return state


def to_hf_assistant(drafter: DFlashDrafter):  # -> MuseGlimmerAssistantModel
    """transformers' DFlash assistant with this drafter's weights, on its device and dtype.

    Raises ``ModelLoadError`` naming what the assistant class cannot express."""
    from transformers import MuseGlimmerAssistantModel

    problems = unsupported_for_hf(drafter)
    if problems:
        raise ModelLoadError("this drafter cannot be written as transformers' DFlash assistant "
                             "(muse_glimmer_assistant): " + "; ".join(problems))
    weight = next(drafter.parameters())
    model = MuseGlimmerAssistantModel(assistant_config(drafter))
    missing, unexpected = model.load_state_dict(assistant_state_dict(drafter), strict=False)
    # The rotary buffers are computed, not stored; anything else missing means the mapping is wrong.
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise RuntimeError(f"drafter -> assistant mapping incomplete: missing {missing[:6]}, unexpected {unexpected[:6]}")
    return model.to(device=weight.device, dtype=weight.dtype).eval()


def export_hf_assistant(drafter_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Write ``drafter_dir`` (z-lab format) as a transformers assistant folder that plain
    ``MuseGlimmerAssistantModel.from_pretrained(out_dir)`` loads. Returns what was written and
    the notes a user should read (e.g. a dropped draft vocabulary)."""
    drafter = DFlashDrafter.from_pretrained(drafter_dir, dtype=dtype)
    model = to_hf_assistant(drafter)
    out = Path(out_dir)
    model.save_pretrained(out)
    notes = []
    if drafter.draft_vocab is not None:
        notes.append(f"the drafter's reduced draft vocabulary ({len(drafter.draft_vocab)} tokens) is not part of the "
                     "assistant format: transformers drafts over the target's whole vocabulary, so its drafts (and "
                     "acceptance) can differ from DFlash Studio's")
    info = {"source": str(drafter_dir), "out": str(out), "model_type": model.config.model_type,
            "dtype": str(dtype).removeprefix("torch."), "notes": notes,
            "usage": "target.generate(ids, assistant_model=MuseGlimmerAssistantModel.from_pretrained(OUT), "
                     "speculation_type='dflash', do_sample=False)"}
    (out / "dflash_export.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info
