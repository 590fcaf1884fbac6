"""The DFlash block-diffusion drafter, implemented natively (no remote code).

It loads and saves the checkpoint format z-lab publishes (``config.json`` + safetensors), which
vLLM and SGLang also serve. Architecture (the DFlash paper's, as z-lab's reference implementation,
github.com/z-lab/dflash, builds it):

* the selected target layers' hidden states are concatenated and fused: ``fc`` -> ``hidden_norm``;
* Qwen3-style decoder layers run on the *block* (the anchor token then ``MASK`` tokens, embedded
  with the target's own input embedding). In every layer K and V come from the fused context
  (all committed positions) followed by the block itself; Q comes from the block only;
* a final ``norm``; logits come from the target's own LM head.

Which keys a block query sees is decided per layer: ``drafter_config.py`` says how.

The module is a pure function of its inputs plus an optional context K/V cache: no sampling, no
timing, no generation loop (those live in ``speculative.py``). A sliding-window layer's cache
keeps only the context its window can still reach, so its cost stops growing with the context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .drafter_config import DrafterConfig, LayerAttention, default_target_layer_ids
from .errors import DrafterMismatchError, ModelLoadError
from .kernels import Linear, pack_linears

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# Optional and ours (see DFlashDrafter.draft_vocab); JSON, so that vLLM/SGLang, which load every
# *.safetensors file of a drafter folder, never meet an unknown tensor.
DRAFT_VOCAB_NAME = "draft_vocab.json"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 per position: hidden states carry "massive activations" (RMS ~1e3 at
        # position 0 in SmolLM2), so any global statistic would be dominated by them.
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for any RoPE flavour transformers knows (default, llama3, yarn, ...)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        params = config.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)  # (..., T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (N, heads, T, D); cos/sin: (N or 1, T, D)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DrafterCache:
    """Context K/V per drafter layer, already normalised and rotated, with their absolute
    positions. Blocks are never cached: each cycle's block K/V is recomputed, so rolling back
    after verification costs nothing. A sliding-window layer drops the context its window can no
    longer reach (block positions only grow from one cycle to the next), so its cache and its
    attention stay within ``sliding_window`` positions however long the context grows."""

    def __init__(self, num_layers: int, windows: list[int | None] | None = None,
                 track_positions: list[bool] | None = None) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        # (K,) absolute positions of the cached keys, kept for the layers whose mask needs them
        self.positions: list[torch.Tensor | None] = [None] * num_layers
        self.windows = list(windows) if windows is not None else [None] * num_layers
        self.track = list(track_positions) if track_positions is not None else [w is not None for w in self.windows]
        self.seen = [0] * num_layers  # context positions appended so far, dropped ones included
        self.floor = [None] * num_layers  # lowest query position served since keys were dropped
        self.buffers = None  # q8_drafter.FusedDrafterPass's (keys, values) buffers, of which keys / values are views

    @property
    def length(self) -> int:
        """How many context positions the cache has been given (layer 0)."""
        return self.seen[0]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.keys[layer], self.values[layer]
        count = k.shape[2]
        if self.track[layer]:
            if positions is None:
                positions = torch.arange(self.seen[layer], self.seen[layer] + count, device=k.device)
            if self.positions[layer] is not None:
                positions = torch.cat((self.positions[layer], positions.to(self.positions[layer].device)))
            self.positions[layer] = positions
        if old_k is not None:
            k, v = torch.cat((old_k, k), dim=2), torch.cat((old_v, v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        self.seen[layer] += count
        return k, v

    def trim(self, layer: int, first_query: int) -> None:
        """Drop what a sliding window can no longer reach from ``first_query`` or any later query."""
        window, floor = self.windows[layer], self.floor[layer]
        if floor is not None and first_query < floor:
            raise RuntimeError(f"drafter cache: a block at position {first_query} after one at {floor}; the sliding "
                               "window has dropped the context it would need (start a new cache)")
        if window is None or self.positions[layer] is None:
            return
        keep = self.positions[layer] > first_query - window
        if not bool(keep.all()):
            self.keys[layer] = self.keys[layer][:, :, keep]
            self.values[layer] = self.values[layer][:, :, keep]
            self.positions[layer] = self.positions[layer][keep]
            self.floor[layer] = first_query


@dataclass
class BlockLayout:
    """The training layout, as a cheaper alternative to a dense boolean mask: ``A`` blocks of
    ``block_size`` slots per sequence, block ``a`` anchored at ``anchors[:, a]``. A block sees the
    context strictly before its anchor and its own slots, never another block — exactly
    ``training.objective.training_mask`` — but attention is computed block-wise, so its cost
    grows with ``A * B * (T + B)`` instead of ``A * B * (T + A * B)``. The context holds
    positions ``0..T-1`` and slot ``k`` of a block sits at its anchor + ``k``; a sliding-window or
    causal layer narrows what each slot sees accordingly (``LayerAttention``)."""

    anchors: torch.Tensor  # (N, A) absolute anchor positions
    block_size: int


def _blockwise_attention(q, k_ctx, v_ctx, k_blk, v_blk, layout: BlockLayout,
                         spec: "LayerAttention | None" = None) -> torch.Tensor:
    """q: (N, H, A*B, D); k/v_ctx: (N, KV, T, D); k/v_blk: (N, KV, A*B, D) -> (N, H, A*B, D)."""
    n, h, q_len, d = q.shape
    kv = k_blk.shape[1]
    g = h // kv
    b = layout.block_size
    a = q_len // b
    t = k_ctx.shape[2]
    scale = d**-0.5
    qg = q.view(n, kv, g, a, b, d) * scale
    scores_ctx = torch.matmul(qg.reshape(n, kv, g * a * b, d), k_ctx.transpose(-1, -2)).view(n, kv, g, a, b, t)
    ctx_pos = torch.arange(t, device=q.device)
    hidden = ctx_pos[None, None, None, :] >= layout.anchors[:, :, None, None]  # (N, A, 1, T)
    window = spec.sliding_window if spec is not None else None
    if window is not None:
        slot_pos = layout.anchors[:, :, None] + torch.arange(b, device=q.device)  # (N, A, B)
        hidden = hidden | (slot_pos[..., None] - ctx_pos >= window)  # (N, A, B, T)
    scores_ctx = scores_ctx.masked_fill(hidden[:, None, None], float("-inf"))
    scores_blk = torch.matmul(qg, k_blk.view(n, kv, 1, a, b, d).transpose(-1, -2))  # (N, KV, G, A, B, B)
    if spec is not None and not spec.plain:
        slots = torch.arange(b, device=q.device)
        offset = slots[:, None] - slots[None, :]  # query slot - key slot
        blocked = torch.zeros(b, b, dtype=torch.bool, device=q.device)
        if spec.causal:
            blocked |= offset < 0
        if window is not None:
            blocked |= offset.abs() >= window
        scores_blk = scores_blk.masked_fill(blocked, float("-inf"))
    probs = torch.softmax(torch.cat((scores_ctx, scores_blk), dim=-1).float(), dim=-1).to(q.dtype)
    p_ctx, p_blk = probs.split((t, b), dim=-1)
    out = torch.matmul(p_ctx.reshape(n, kv, g * a * b, t), v_ctx).view(n, kv, g, a, b, d)
    out = out + torch.matmul(p_blk, v_blk.view(n, kv, 1, a, b, d))
    return out.view(n, h, q_len, d)


def layer_mask(spec: LayerAttention, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
    """(N, 1, Q, K) bool, True where a query at ``q_pos`` may see a key at ``k_pos`` under
    ``spec`` (None for a plain layer: it sees everything it is given)."""
    if spec.plain:
        return None
    offset = q_pos[:, :, None] - k_pos[:, None, :]  # (N, Q, K): query position - key position
    allowed = torch.ones(offset.shape, dtype=torch.bool, device=offset.device)
    if spec.causal:
        allowed &= offset >= 0
    if spec.sliding_window is not None:
        allowed &= offset.abs() < spec.sliding_window
    return allowed[:, None]


class DrafterAttention(nn.Module):
    def __init__(self, config: DrafterConfig, spec: LayerAttention | None = None) -> None:
        super().__init__()
        q = config.qwen3
        self.spec = spec or LayerAttention()
        self.num_heads = q.num_attention_heads
        self.num_kv_heads = q.num_key_value_heads
        self.head_dim = config.head_dim
        bias = bool(getattr(q, "attention_bias", False))
        self.q_proj = nn.Linear(q.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(q.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(q.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, q.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, q.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, q.rms_norm_eps)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(n, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(n, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,  # (N, Q, H) block hidden states
        context: torch.Tensor | None,  # (N, C, H) fused context not yet in the cache
        rope_block: tuple[torch.Tensor, torch.Tensor],
        rope_context: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,  # bool (Q, K_total) or broadcastable; True = may attend
        cache: DrafterCache | None,
        layer_index: int,
        positions: tuple | None = None,  # (N, Q) block, (N, C) context or None, first block position (int)
    ) -> torch.Tensor:
        n, qlen, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, qlen, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *rope_block)
        k_blk, v_blk = self._kv(x, *rope_block)
        block_pos, ctx_pos, first_query = positions if positions is not None else (None, None, None)
        if context is not None and context.shape[1] > 0:
            k_ctx, v_ctx = self._kv(context, *rope_context)
        else:
            k_ctx = v_ctx = None
        if cache is not None:
            if k_ctx is not None:
                k_ctx, v_ctx = cache.extend(layer_index, k_ctx, v_ctx, None if ctx_pos is None else ctx_pos[0])
            if self.spec.sliding_window is not None and first_query is not None:
                cache.trim(layer_index, first_query)
            k_ctx, v_ctx = cache.keys[layer_index], cache.values[layer_index]
            if cache.positions[layer_index] is not None:
                ctx_pos = cache.positions[layer_index][None]
        if isinstance(mask, BlockLayout):
            out = _blockwise_attention(q, k_ctx, v_ctx, k_blk, v_blk, mask, self.spec)
            return self.o_proj(out.transpose(1, 2).reshape(n, qlen, -1))
        if k_ctx is not None:
            k, v = torch.cat((k_ctx, k_blk), dim=2), torch.cat((v_ctx, v_blk), dim=2)
        else:
            k, v = k_blk, v_blk
        if mask is not None and mask.dim() == 2:
            mask = mask[None, None]
        if not self.spec.plain:
            if block_pos is None or (k_ctx is not None and ctx_pos is None):
                raise ValueError("a sliding-window or causal drafter layer needs the block and context positions")
            k_pos = block_pos if k_ctx is None else torch.cat((ctx_pos.expand(n, -1), block_pos.expand(n, -1)), dim=1)
            own = layer_mask(self.spec, block_pos.expand(n, -1), k_pos)
            mask = own if mask is None else (mask & own)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads
        )  # (N, heads, Q, D)
        return self.o_proj(out.transpose(1, 2).reshape(n, qlen, -1))


class DrafterMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig, spec: LayerAttention | None = None) -> None:
        super().__init__()
        q = config.qwen3
        self.self_attn = DrafterAttention(config, spec)
        self.mlp = DrafterMLP(q.hidden_size, q.intermediate_size)
        self.input_layernorm = RMSNorm(q.hidden_size, q.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(q.hidden_size, q.rms_norm_eps)
        self.compiled = None  # aoti_drafter.CompiledDrafterLayer: its decode passes compiled

    def forward(self, x, context, rope_block, rope_context, mask, cache, layer_index, positions=None):  # noqa: ANN001, D102
        if self.compiled is not None and self.compiled.handles(x, context, mask, cache):
            return self.compiled(x, context, rope_block, rope_context, cache, layer_index,
                                 None if positions is None else positions[1])
        # As in z-lab's layer: the context is *not* normalised by input_layernorm (hidden_norm
        # already did that once for all layers).
        x = x + self.self_attn(self.input_layernorm(x), context, rope_block, rope_context, mask, cache, layer_index,
                               positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """z-lab's ``DFlashDraftModel``, as a plain ``nn.Module`` with the same parameter names."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        q = config.qwen3
        self.layer_specs = [config.layer_attention(i) for i in range(q.num_hidden_layers)]
        self.layers = nn.ModuleList(DrafterLayer(config, spec) for spec in self.layer_specs)
        self.fc = nn.Linear(len(config.target_layer_ids) * q.hidden_size, q.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(q.hidden_size, q.rms_norm_eps)
        self.norm = RMSNorm(q.hidden_size, q.rms_norm_eps)
        self.rotary = RotaryEmbedding(q)
        # Optional draft vocabulary (sorted token ids): the drafter then scores only these rows of
        # the LM head. On a CPU the full head is a memory-bound read of vocab x hidden weights every
        # cycle; the tokens a drafter can usefully propose are the frequent ones. Lossless either
        # way: the target verifies every draft. Kept out of the state dict (its own file).
        self.draft_vocab: torch.Tensor | None = None
        self._head_cache: tuple | None = None
        self._packed = False  # see pack_for_inference
        self._head_kernel = None  # weight -> linear for the draft head's rows (see set_head_kernel)
        self.fused_pass = None  # q8_drafter.FusedDrafterPass: a decode pass's layers in one call

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        if token_ids is not None:
            ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
            if ids.numel() == 0 or ids.min() < 0 or ids.max() >= self.config.vocab_size or ids.unique().numel() != ids.numel():
                raise ModelLoadError(f"draft vocabulary must be distinct token ids in [0, {self.config.vocab_size})")
            token_ids = ids.sort().values
        self.draft_vocab = token_ids
        self._head_cache = None

    def draft_logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits over the draft vocabulary (or the whole one) and the token id of each column
        (``None``: column i is token i)."""
        if self.draft_vocab is None:
            return self.logits(hidden, lm_head_weight), None
        key = (lm_head_weight.data_ptr(), lm_head_weight.device, lm_head_weight.dtype, self._packed)
        if self._head_cache is None or self._head_cache[0] != key:
            vocab = self.draft_vocab.to(lm_head_weight.device)
            weight = lm_head_weight.index_select(0, vocab).contiguous()
            rows = self._head_kernel(weight) if self._head_kernel is not None else Linear(weight, pack=self._packed)
            self._head_cache = (key, rows, vocab)
        _, rows, vocab = self._head_cache
        return self._shape_logits(rows(hidden)), vocab

    def pack_for_inference(self) -> int:
        """Run this (frozen, inference-only) drafter's matrix products through weights packed
        once for oneDNN (``kernels.py``: only where the numbers stay F.linear's); a weight that
        is later replaced or changed falls back to the plain product. Returns how many linears
        were packed."""
        self._packed = True
        self._head_cache = None
        return pack_linears(self)

    def set_head_kernel(self, make) -> None:
        """``make(weight)``: the kernel that computes the draft head's rows ``x @ weight.T`` from
        now on (``aoti_kernels.drafter_kernels``), instead of ``kernels.Linear``."""
        self._head_kernel = make
        self._head_cache = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def new_cache(self) -> DrafterCache:
        return DrafterCache(len(self.layers), [spec.sliding_window for spec in self.layer_specs],
                            [not spec.plain for spec in self.layer_specs])

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """(…, T, len(ids)*H) concatenated target features -> (…, T, H) drafter context."""
        return self.hidden_norm(self.fc(features))

    def forward(
        self,
        noise_embedding: torch.Tensor,  # (N, Q, H): target embeddings of [anchor, MASK, ...]
        block_positions: torch.Tensor,  # (N, Q) or (Q,)
        context_features: torch.Tensor | None = None,  # (N, C, len(ids)*H) raw concatenated features
        context_positions: torch.Tensor | None = None,  # (N, C) or (C,)
        mask: "torch.Tensor | BlockLayout | None" = None,  # bool (Q, C+Q) / (N, 1, Q, C+Q), or a BlockLayout
        cache: DrafterCache | None = None,
    ) -> torch.Tensor:
        """Hidden states for every block slot, after the final norm: (N, Q, H)."""
        dtype = noise_embedding.dtype
        x = noise_embedding * self.config.input_embedding_scale if self.config.input_embedding_scale != 1.0 else noise_embedding
        block_pos = block_positions if block_positions.dim() == 2 else block_positions[None]
        rope_block = self.rotary(block_pos, dtype)
        ctx_pos = None if context_positions is None else (
            context_positions if context_positions.dim() == 2 else context_positions[None])
        if self.fused_pass is not None and self.fused_pass.handles(x, context_features, ctx_pos, mask, cache):
            return self.fused_pass(x, context_features, rope_block, self.rotary(ctx_pos, dtype), cache)
        context = rope_context = None
        if context_features is not None and context_features.shape[-2] > 0:
            context = self.fuse(context_features.to(dtype))
            rope_context = self.rotary(ctx_pos, dtype)
        else:
            ctx_pos = None  # no context this call: its positions mean nothing to the layers
        # Where the block starts, for the sliding-window caches to drop what no later block can see
        # (read once per call, and only for drafters that have such layers: it waits for the device).
        windowed = cache is not None and any(spec.sliding_window is not None for spec in self.layer_specs)
        first_query = int(block_pos.min()) if windowed else None
        positions = (block_pos, ctx_pos, first_query)
        for i, layer in enumerate(self.layers):
            x = layer(x, context, rope_block, rope_context, mask, cache, i, positions)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Logits through the target's (shared, frozen) LM head, with the optional z-lab scalings."""
        return self._shape_logits(F.linear(hidden, lm_head_weight))

    def _shape_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ------------------------------------------------------------------ z-lab checkpoint format
    def save_pretrained(self, directory: str | Path, model_card: str | None = None) -> Path:
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_NAME).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n", encoding="utf-8")
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        vocab_file = out / DRAFT_VOCAB_NAME
        if self.draft_vocab is not None:
            vocab_file.write_text(json.dumps({"token_ids": self.draft_vocab.tolist()}) + "\n", encoding="utf-8")
        elif vocab_file.exists():
            vocab_file.unlink()
        if model_card is not None:
            (out / "README.md").write_text(model_card, encoding="utf-8")
        return out

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> "DFlashDrafter":
        """Load a z-lab checkpoint directory (single or sharded safetensors)."""
        root = Path(directory)
        cfg_file = root / CONFIG_NAME
        if not cfg_file.is_file():
            raise ModelLoadError(f"{root}: no {CONFIG_NAME}; a DFlash drafter directory holds config.json + safetensors")
        try:
            raw = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{cfg_file} is not valid JSON: {exc}") from exc
        config = DrafterConfig.from_dict(raw, source=str(cfg_file))
        state = _read_safetensors(root)
        state = {k.removeprefix("model."): v for k, v in state.items()}
        model = cls(config)
        expected = set(model.state_dict())
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise ModelLoadError(
                f"{root}: weights do not match the config: missing {sorted(missing)[:6]}, "
                f"unexpected {sorted(unexpected)[:6]}"
            )
        for name, tensor in model.state_dict().items():
            if state[name].shape != tensor.shape:
                raise ModelLoadError(f"{root}: {name} has shape {tuple(state[name].shape)}, config implies {tuple(tensor.shape)}")
        model.load_state_dict(state)
        vocab_file = root / DRAFT_VOCAB_NAME
        if vocab_file.is_file():
            try:
                ids = torch.tensor(json.loads(vocab_file.read_text(encoding="utf-8"))["token_ids"], dtype=torch.long)
            except (ValueError, UnicodeDecodeError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
                raise ModelLoadError(f"{vocab_file} is truncated or corrupted ({exc}); re-export the drafter or delete the file") from exc
            model.set_draft_vocab(ids)
        return model.to(device=device, dtype=dtype).eval()

    # ------------------------------------------------------------------ compatibility with a target
    def check_fits(self, num_target_layers: int, hidden_size: int, vocab_size: int, target_name: str = "target") -> None:
        """Refuse, with a message that says why, a drafter made for another target."""
        cfg = self.config
        problems = []
        if cfg.hidden_size != hidden_size:
            problems.append(f"hidden size {cfg.hidden_size} != target's {hidden_size}")
        bad = [i for i in cfg.target_layer_ids if not 0 <= i < num_target_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} out of range for a {num_target_layers}-layer target")
        if cfg.num_target_layers is not None and cfg.num_target_layers != num_target_layers:
            problems.append(f"made for a {cfg.num_target_layers}-layer target, this one has {num_target_layers}")
        if not 0 <= cfg.mask_token_id < vocab_size:
            problems.append(f"mask_token_id {cfg.mask_token_id} outside the target's vocabulary of {vocab_size}")
        if cfg.vocab_size != vocab_size:
            problems.append(f"vocabulary {cfg.vocab_size} != target's {vocab_size}")
        if problems:
            raise DrafterMismatchError(f"this drafter does not fit {target_name}: " + "; ".join(problems))


def _read_safetensors(root: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = root / WEIGHTS_INDEX_NAME
    files = (
        sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
        if index.is_file()
        else sorted(root.glob("*.safetensors"))
    )
    if not files:
        raise ModelLoadError(f"{root}: no *.safetensors weights found")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{file} is truncated or corrupted ({exc}); re-export or re-download it") from exc
    return state


def init_drafter_weights(model: DFlashDrafter, std: float = 0.02, seed: int | None = None) -> None:
    """Small normal init for linear layers, ones for norms (what the training recipe starts from)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for module in model.modules():
        if isinstance(module, nn.Linear):
            with torch.no_grad():
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
                if module.bias is not None:
                    module.bias.zero_()
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "DFlashDrafter",
    "DrafterCache",
    "DrafterConfig",
    "LayerAttention",
    "default_target_layer_ids",
    "init_drafter_weights",
    "count_parameters",
]
