"""Target families ``FastTarget`` runs: how each lays out its weights, norms and biases.

A family adapter turns a transformers causal LM into ``FusedWeights``: the embedding, the LM
head, the final norm, the rotary embedding, and per decoder layer one fused QKV and one fused
gate/up projection (fewer, larger matrix products: what a CPU rewards), the two RMSNorm weights,
the q/k biases and q/k norms where the model has them. ``FastTarget`` then runs every family with
the same code. Llama, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms) and Mistral share one
layout, ``LlamaLayout``; a family with another layout (Gemma's ``1 + weight`` norms, say) would
be another adapter here, and ``fast_path_reason`` sends every other model to ``HFTarget``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .kernels import Linear


@dataclass
class FusedLayer:
    ln1: torch.Tensor
    qkv: Linear  # q, k and v projections fused (with their biases where the model has them)
    qk_norm: torch.Tensor | None  # (q_heads + kv_heads, D): Qwen3's q_norm / k_norm, stacked
    o: Linear
    ln2: torch.Tensor
    gate_up: Linear  # gate and up projections fused
    down: Linear


@dataclass
class FusedWeights:
    embed: torch.Tensor  # (V, H)
    lm_head: Linear
    final_norm: torch.Tensor  # (H,)
    rotary: torch.nn.Module  # transformers' rotary embedding: (x, positions) -> (cos, sin)
    layers: list[FusedLayer]


def fuse_linears(linears: Sequence[torch.nn.Linear]) -> torch.Tensor:
    """One weight for several linears sharing an input; the modules keep views of it, so the
    fused copy costs no extra memory and the transformers model still works."""
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()
    offset = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused[offset : offset + rows], requires_grad=False)
        offset += rows
    return fused


class LlamaLayout:
    """``model.model.{embed_tokens, layers, norm, rotary_emb}``; each layer has ``input_layernorm``,
    ``self_attn.{q,k,v,o}_proj`` (optional ``q_norm`` / ``k_norm``), ``post_attention_layernorm``
    and a SiLU-gated ``mlp.{gate,up,down}_proj``. Biases on q/k/v are fused with them; the MLP and
    the output projection have none (``unsupported`` refuses a model that has them)."""

    # Projections whose biases FastTarget does not apply (module names as transformers spells them).
    UNFUSED_BIAS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj")

    def unsupported(self, model: torch.nn.Module) -> str | None:
        """Why this model does not fit the layout (None when it does)."""
        cfg = model.config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            return f"hidden_act {cfg.hidden_act!r} is not silu"
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", cfg.model_type == "mistral"):
            return "sliding-window attention"
        # A Llama with mlp_bias or attention_bias (which biases o_proj too) goes to HFTarget.
        biased = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if name.endswith(self.UNFUSED_BIAS) and getattr(module, "bias", None) is not None})
        if biased:
            return f"biases on {', '.join(biased)} (FastTarget has none on the MLP or the output projection)"
        return None

    def fuse(self, model: torch.nn.Module) -> FusedWeights:
        inner = model.model
        return FusedWeights(
            embed=inner.embed_tokens.weight.detach(),
            lm_head=Linear(model.get_output_embeddings().weight.detach()),
            final_norm=inner.norm.weight.detach(),
            rotary=inner.rotary_emb,
            layers=[self.fuse_layer(layer) for layer in inner.layers],
        )

    @staticmethod
    def fuse_layer(layer: torch.nn.Module) -> FusedLayer:
        att, mlp = layer.self_attn, layer.mlp
        wqkv = fuse_linears((att.q_proj, att.k_proj, att.v_proj))
        bqkv = None
        if att.q_proj.bias is not None:
            bqkv = torch.cat([p.bias.detach() for p in (att.q_proj, att.k_proj, att.v_proj)], dim=0)
        q_norm = getattr(att, "q_norm", None)
        k_norm = getattr(att, "k_norm", None)
        qk_norm = None
        if q_norm is not None:
            heads = att.q_proj.weight.shape[0] // q_norm.weight.shape[0]
            kv_heads = att.k_proj.weight.shape[0] // k_norm.weight.shape[0]
            qk_norm = torch.cat((q_norm.weight.detach().expand(heads, -1), k_norm.weight.detach().expand(kv_heads, -1)))
        return FusedLayer(
            ln1=layer.input_layernorm.weight.detach(),
            qkv=Linear(wqkv, bqkv),
            qk_norm=qk_norm,
            o=Linear(att.o_proj.weight.detach()),
            ln2=layer.post_attention_layernorm.weight.detach(),
            gate_up=Linear(fuse_linears((mlp.gate_proj, mlp.up_proj))),
            down=Linear(mlp.down_proj.weight.detach()),
        )


LLAMA_LAYOUT = LlamaLayout()
ADAPTERS: dict[str, LlamaLayout] = {"llama": LLAMA_LAYOUT, "qwen2": LLAMA_LAYOUT, "qwen3": LLAMA_LAYOUT,
                                    "mistral": LLAMA_LAYOUT}
FAST_FAMILIES = tuple(ADAPTERS)


def fast_path_reason(model: torch.nn.Module) -> str | None:
    """Why ``FastTarget`` cannot run this model (None when it can)."""
    family = getattr(model.config, "model_type", "")
    if family not in ADAPTERS:
        return f"model_type {family!r} is not one of {FAST_FAMILIES}"
    if any(not p.dtype.is_floating_point for p in model.parameters()):
        return "quantized weights (e.g. bitsandbytes 4/8-bit)"
    if len({p.device for p in model.parameters()}) > 1:
        return "weights spread over several devices"
    return ADAPTERS[family].unsupported(model)
