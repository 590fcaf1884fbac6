"""The DFlash drafter's configuration: z-lab's ``config.json`` (a Qwen3 config plus the DFlash
fields), read, checked and written back; no network, no weights.

Which keys a block query sees is decided per layer (``DrafterConfig.layer_attention``), as the
published implementations decide it (z-lab's ``model.py`` and MLX backend, vLLM's
``qwen3_dflash.py``, SGLang's ``dflash.py``):

* a ``full_attention`` layer sees the whole context and the whole block (no causal mask);
* a ``sliding_attention`` layer (``layer_types``) sees, for a query at absolute position ``p``,
  only keys at positions ``j`` with ``|p - j| < sliding_window`` (a window of ``W`` positions
  ending at the query, itself included: flash-attention's ``window_size=(W-1, W-1)`` that z-lab's
  ``model.py`` passes, SGLang's ``window_left = W - 1``, vLLM's ``per_layer_sliding_window``);
  so each slot of a block sees a slightly different stretch of the context;
* a causal layer lets block slot ``i`` see slots ``0..i`` only (and the context). Causality is
  resolved as vLLM does: the top-level ``is_causal`` when the config sets it, else
  ``dflash_config.causal``, else sliding-window layers are causal and full layers are not (the
  convention of the checkpoints that declare neither, which SGLang follows too by running
  sliding layers as decoder attention).

A config asking for what the drafter does not implement (DFlash2's convolution and selector,
attention sinks, a reduced vocabulary mapped by ``d2t``, ...) is refused by name
(``_unsupported_features``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import Qwen3Config

from .errors import ModelLoadError

ARCHITECTURE = "DFlashDraftModel"


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default spacing: one layer -> the middle one; else spread from layer 1 to L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
# DFlash fields this module models (read from ``dflash_config`` or, in older checkpoints, the top
# level), as opposed to the extra ``dflash_config`` keys it keeps verbatim.
_DFLASH_FIELDS = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "input_embedding_scale",
                  "output_multiplier", "final_logit_softcapping")


@dataclass(frozen=True)
class LayerAttention:
    """Which keys one drafter layer's block queries see (module docstring)."""

    sliding_window: int | None = None  # query at p sees keys j with |p - j| < sliding_window
    causal: bool = False  # block slot i sees block slots 0..i only

    @property
    def plain(self) -> bool:
        """The classic layer: the whole context and the whole block, no mask needed."""
        return self.sliding_window is None and not self.causal

    def describe(self) -> str:
        kind = f"sliding window {self.sliding_window}" if self.sliding_window is not None else "full"
        return kind + (", causal" if self.causal else "")


def _unsupported_features(raw: dict[str, Any], dflash: dict[str, Any]) -> list[str]:
    """What a config asks for that this drafter does not implement (each named, with its field)."""
    problems = []
    archs = raw.get("architectures") or []
    conv = {k: dflash.get(k) for k in ("conv_kernel_size", "conv_group_size") if dflash.get(k)}
    selector = {k: dflash.get(k) for k in ("selector_rank", "selector_top_k") if dflash.get(k)}
    if "DFlash2DraftModel" in archs or conv or selector:
        fields = ", ".join(f"{k}={v}" for k, v in {**conv, **selector}.items()) or "architectures = DFlash2DraftModel"
        problems.append(
            f"this is a DFlash2 drafter ({fields}): it needs a grouped convolution over the block in every layer "
            "and a candidate selector that walks the top-k candidates of each slot, and DFlash Studio implements "
            f"neither; use a {ARCHITECTURE} checkpoint"
        )
    if dflash.get("attention_sink_bias") or raw.get("add_swa_attention_sink_bias"):
        problems.append("attention_sink_bias (a learned per-head attention sink, MiMo drafters) is not implemented")
    if dflash.get("attention_value_scale") is not None:
        problems.append("attention_value_scale (scaled attention values) is not implemented")
    projector = dflash.get("projector_type", raw.get("projector_type"))
    if projector:
        problems.append(f"projector_type = {projector!r} (a projector other than fc + hidden_norm) is not implemented")
    if raw.get("has_embed_tokens") or raw.get("has_lm_head"):
        problems.append("a drafter with its own embedding or LM head (has_embed_tokens / has_lm_head) is not "
                        "implemented: DFlash Studio drafts through the target's own")
    draft_vocab = raw.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != raw.get("vocab_size"):
        problems.append(f"draft_vocab_size = {draft_vocab} (a reduced vocabulary mapped by d2t) is not implemented")
    if dflash.get("use_aux_hidden_state", raw.get("use_aux_hidden_state", True)) is False:
        problems.append("use_aux_hidden_state = false (no fused target features) is not implemented")
    if dflash.get("sample_from_anchor", raw.get("sample_from_anchor", True)) is False:
        problems.append("sample_from_anchor = false (queries without the anchor slot) is not implemented")
    if raw.get("is_neox_style", raw.get("rope_is_neox_style", True)) is False:
        problems.append("is_neox_style = false (interleaved RoPE) is not implemented")
    # A partial_rotary_factor with default RoPE is ignored, as z-lab's model.py (Qwen3's rotary
    # embedding) and MLX backend both rotate the whole head; with another RoPE type transformers
    # would rotate part of it, which this drafter (like z-lab's code) cannot.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if isinstance(rope, dict) and rope.get("partial_rotary_factor", 1.0) != 1.0 and rope_type != "default":
        problems.append(f"partial_rotary_factor = {rope['partial_rotary_factor']} with {rope_type} RoPE (a partly "
                        "rotated head) is not implemented")
    return problems


@dataclass
class DrafterConfig:
    """The drafter's configuration: a Qwen3 config plus the DFlash fields."""

    qwen3: Qwen3Config
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # The window of the sliding_attention layers as the checkpoint gives it (top-level
    # ``sliding_window``; transformers' Qwen3Config drops it unless use_sliding_window is set).
    sliding_window: int | None = None
    is_causal: bool | None = None  # top-level causality override, as read
    dflash_extra: dict[str, Any] = field(default_factory=dict)  # other dflash_config keys (causal, use_swa, ...)
    nested: tuple[str, ...] = ()  # which of _DFLASH_FIELDS the checkpoint kept inside dflash_config
    extra: dict[str, Any] = field(default_factory=dict)  # unknown keys, kept for round-trips

    @property
    def hidden_size(self) -> int:
        return self.qwen3.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.qwen3.vocab_size

    @property
    def head_dim(self) -> int:
        return getattr(self.qwen3, "head_dim", None) or self.qwen3.hidden_size // self.qwen3.num_attention_heads

    @property
    def num_layers(self) -> int:
        return int(self.qwen3.num_hidden_layers)

    @property
    def layer_types(self) -> list[str]:
        """Per layer: full_attention or sliding_attention (``dflash_config.use_swa`` makes every
        layer sliding when ``layer_types`` names none, as vLLM reads it)."""
        types = list(getattr(self.qwen3, "layer_types", None) or [FULL_ATTENTION] * self.num_layers)
        if self.dflash_extra.get("use_swa") and SLIDING_ATTENTION not in types:
            types = [SLIDING_ATTENTION] * self.num_layers
        return types

    @property
    def window(self) -> int | None:
        """The sliding window in positions (``dflash_config.swa_window_size`` first)."""
        value = self.dflash_extra.get("swa_window_size", self.sliding_window)
        return None if value is None else int(value)

    def layer_attention(self, index: int) -> LayerAttention:
        sliding = self.layer_types[index] == SLIDING_ATTENTION
        if self.is_causal is not None:
            causal = bool(self.is_causal)
        elif self.dflash_extra.get("causal") is not None:
            causal = bool(self.dflash_extra["causal"])
        else:
            causal = sliding
        return LayerAttention(self.window if sliding else None, causal)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "DrafterConfig":
        archs = raw.get("architectures") or []
        dflash = dict(raw.get("dflash_config") or {})
        problems = _unsupported_features(raw, dflash)
        if problems:
            raise ModelLoadError(f"{source}: " + "; ".join(problems))
        if archs and ARCHITECTURE not in archs:
            raise ModelLoadError(f"{source}: architectures = {archs}; expected [{ARCHITECTURE!r}] (z-lab DFlash format)")

        def pick(name: str, default: Any = None) -> Any:
            # Newer checkpoints nest DFlash fields in dflash_config; older ones keep them top-level.
            return dflash.get(name, raw.get(name, default))

        layer_ids = pick("target_layer_ids")
        mask_id = pick("mask_token_id")
        if layer_ids is None or mask_id is None:
            raise ModelLoadError(
                f"{source}: missing dflash_config.target_layer_ids / mask_token_id; is this a DFlash drafter?"
            )
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in required if k not in raw]
        if missing:
            raise ModelLoadError(f"{source}: missing required key(s) {missing}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: hidden_act = {raw['hidden_act']!r}; only 'silu' is supported")
        qwen_keys = {k: v for k, v in raw.items() if k not in ("dflash_config", "auto_map", "architectures", "is_causal")}
        qwen_keys.pop("model_type", None)
        try:
            qwen3 = Qwen3Config(**qwen_keys)
        except Exception as exc:  # transformers validates with several exception types
            raise ModelLoadError(f"{source}: not a valid Qwen3-style config: {exc}") from exc
        is_causal = raw.get("is_causal")
        for name, value in (("is_causal", is_causal), ("dflash_config.causal", dflash.get("causal")),
                            ("dflash_config.use_swa", dflash.get("use_swa"))):
            if value is not None and not isinstance(value, bool):
                raise ModelLoadError(f"{source}: {name} = {value!r}; expected true or false")
        known = set(Qwen3Config().to_dict()) | {
            "dflash_config", "auto_map", "rope_theta", "rope_scaling", "is_causal", *_DFLASH_FIELDS,
        }
        softcap = pick("final_logit_softcapping")
        config = cls(
            qwen3=qwen3,
            block_size=int(pick("block_size", 16)),
            mask_token_id=int(mask_id),
            target_layer_ids=[int(i) for i in layer_ids],
            num_target_layers=pick("num_target_layers"),
            input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
            output_multiplier=float(pick("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            sliding_window=raw.get("sliding_window"),
            is_causal=is_causal,
            dflash_extra={k: v for k, v in dflash.items() if k not in _DFLASH_FIELDS},
            nested=tuple(k for k in _DFLASH_FIELDS if k in dflash),
            extra={k: v for k, v in raw.items() if k not in known},
        )
        types = config.layer_types
        odd = sorted({t for t in types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)})
        if odd:
            raise ModelLoadError(f"{source}: layer_types {odd} are not drafter layers; allowed: "
                                 f"{FULL_ATTENTION}, {SLIDING_ATTENTION}")
        window = config.window
        if SLIDING_ATTENTION in types and (window is None or isinstance(window, bool) or window < 1):
            raise ModelLoadError(f"{source}: sliding_attention layers need sliding_window (or "
                                 f"dflash_config.swa_window_size) >= 1, got {window!r}")
        return config

    def to_dict(self) -> dict[str, Any]:
        """The z-lab ``config.json``: loadable by z-lab's code (transformers 4.x) and by 5.x, with
        every field that was read kept where it was (``auto_map`` aside: it names remote code that
        is not shipped with an export)."""
        out = self.qwen3.to_dict()
        for noisy in ("transformers_version", "_name_or_path", "dtype", "id2label", "label2id", "problem_type",
                      "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions", "output_hidden_states",
                      "return_dict"):
            out.pop(noisy, None)
        rope = dict(out.get("rope_parameters") or {})
        # transformers 4.x reads rope_theta / rope_scaling at top level; 5.x reads rope_parameters.
        out["rope_theta"] = rope.get("rope_theta", 10000.0)
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        out["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
        out.update(self.extra)
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        out["architectures"] = [ARCHITECTURE]
        out["model_type"] = "qwen3"
        out["block_size"] = self.block_size
        out["num_target_layers"] = self.num_target_layers
        dflash: dict[str, Any] = dict(self.dflash_extra)
        dflash.update({
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        })
        if self.input_embedding_scale != 1.0 or "input_embedding_scale" in self.nested:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0 or "output_multiplier" in self.nested:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping or "final_logit_softcapping" in self.nested:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if "num_target_layers" in self.nested:
            dflash["num_target_layers"] = self.num_target_layers
        out["dflash_config"] = dflash
        return out

    @classmethod
    def for_target(
        cls,
        target_config: Any,
        num_layers: int,
        mask_token_id: int,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
        attention_bias: bool = False,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        is_causal: bool | None = None,
    ) -> "DrafterConfig":
        """A drafter shaped like ``target_config`` (hidden size, heads, RoPE, vocabulary);
        full-attention layers unless ``layer_types`` / ``sliding_window`` / ``is_causal`` say otherwise."""
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        num_target_layers = int(text.num_hidden_layers)
        layer_ids = target_layer_ids or default_target_layer_ids(num_target_layers, num_layers)
        heads = int(text.num_attention_heads)
        rope = dict(getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
        qwen3 = Qwen3Config(
            hidden_size=int(text.hidden_size),
            intermediate_size=int(intermediate_size or text.intermediate_size),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            vocab_size=int(text.vocab_size),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096)),
            rope_parameters=rope,
            tie_word_embeddings=False,
            attention_bias=attention_bias,
            layer_types=layer_types,
        )
        return cls(
            qwen3=qwen3,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=list(layer_ids),
            num_target_layers=num_target_layers,
            sliding_window=sliding_window,
            is_causal=is_causal,
        )
