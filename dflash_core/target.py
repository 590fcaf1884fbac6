"""Running the target model one block at a time, with a KV cache that can roll back.

Two runners share one small interface (``TargetRunner``):

* ``FastTarget`` — our own forward for the Llama family (Llama, Qwen2, Qwen3, Mistral without a
  sliding window). Weights are fused (one QKV and one gate/up matmul per layer: fewer, larger
  operations, which is what a CPU rewards), the KV cache is position-indexed (rolling back is
  forgetting a length; rejected slots are overwritten later), and attention always spans the
  whole cache with a causal mask. That last choice makes the computation *batch invariant*: the
  logits of a position are bit-for-bit the same in bf16 whether the position is verified alone
  (autoregressive decoding) or inside a block of 16, so greedy DFlash reproduces the engine's own
  greedy autoregressive output exactly (tested). That rests on the matrix kernels giving a row
  the same numbers whatever the number of rows beside it, which depends on the CPU and the dtype:
  a probe at load (``FastTarget.batch_invariant``) finds how many rows a pass needs for that and
  says whether any number suffices; where none does, outputs agree within rounding instead.
  ``forward_tree`` scores a whole draft tree in one pass with the same per-row arithmetic
  (see ``tree.py``), so tree verification is exactly greedy decoding too.
* ``HFTarget`` — any ``transformers`` causal LM through its own forward and ``DynamicCache``,
  including hybrid targets (Qwen3.5/3.6, Qwen3-Next: linear-attention layers) and sliding-window
  ones (gpt-oss); rolling back after a rejected draft is ``rollback.CacheRollback``'s job. Exact
  in fp32 in practice; in bf16, blocks and single tokens may round differently, so outputs can
  part at near-ties (the benchmark reports it).

Features: ``features[layer_id]`` is the residual stream after decoder layer ``layer_id``
(``hidden_states[layer_id + 1]`` in transformers' numbering, before the final norm).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from .kernels import Linear
from .rollback import CacheRollback
from .tree import DraftTree

FAST_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
CAPACITY_ALIGN = 64  # cache capacity granularity (positions)
PREFILL_CHUNK = 512  # longest slice of a prompt FastTarget processes at once
# Most memory tree verification may hold in per-path copies of the value cache (see
# FastTarget.forward_tree); above it, paths take turns in the cache itself (more, smaller ops).
REPLICA_BYTES = 256 << 20
# Fewest rows per pass FastTarget tries (see FastTarget._probe_min_rows): a lone row always takes
# a matrix-vector path that rounds differently, so 2 is the least; more padding costs a little
# more compute per autoregressive step.
MIN_ROWS_CANDIDATES = (2, 4, 8, 16)
# Pass sizes the probe decodes a sequence in: single tokens (autoregressive steps), every size
# up to a block of 16, and one longer pass (a prompt or a tree).
PROBE_CHUNKS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 1, 37)


@dataclass
class TargetOutput:
    logits: torch.Tensor  # (T, V) in the model's dtype
    features: torch.Tensor | None  # (T, len(layer_ids) * H) or None


class TargetRunner(Protocol):
    """What the speculative loop needs from a target."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    device: torch.device
    dtype: torch.dtype

    @property
    def length(self) -> int:
        """Positions currently held in the KV cache."""

    def reset(self, capacity: int) -> None:
        """Start a new sequence that will hold at most ``capacity`` positions."""

    def forward(self, input_ids: torch.Tensor, layer_ids: Sequence[int] | None, last_only: bool = False) -> TargetOutput:
        """Append ``input_ids`` (T,) after the cached positions and return their logits/features."""

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` cached positions."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's input embedding of ``input_ids`` (shared with the drafter)."""

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The target's output projection (shared with the drafter)."""


def round_capacity(positions: int) -> int:
    return -(-positions // CAPACITY_ALIGN) * CAPACITY_ALIGN


# ------------------------------------------------------------------------------------- HF runner
class HFTarget:
    """Any transformers causal LM: its own forward, a ``DynamicCache`` rolled back by
    ``CacheRollback`` (a crop for attention layers; see ``rollback.py`` for the others)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers import DynamicCache

        self._cache_cls = DynamicCache
        self.model = model.eval()
        # transformers renamed the cache argument (``past_key_values`` -> ``cache``, announced for
        # removal in 5.40); pass whichever this model's forward declares.
        declared = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in declared else "past_key_values"
        cfg = model.config.get_text_config()
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self.device = next(model.parameters()).device
        self.dtype = model.get_input_embeddings().weight.dtype
        self._cache = None
        self._length = 0
        self._forward_start = 0  # where the latest forward began: truncate reaches back to here
        # Layer outputs are captured with hooks: transformers' ``hidden_states[-1]`` is *after*
        # the final norm, while a drafter's feature for the last layer is the residual stream.
        self._layers = _decoder_layers(model)
        self._captured: dict[int, torch.Tensor] = {}
        self._wanted: set[int] = set()
        for index, layer in enumerate(self._layers or ()):
            layer.register_forward_hook(self._make_hook(index))
        self._rollback = CacheRollback(model, self._layers)

    def _make_hook(self, index: int):
        def hook(_module, _args, output):
            if index in self._wanted:
                self._captured[index] = output[0] if isinstance(output, tuple) else output
        return hook

    @property
    def length(self) -> int:
        return self._length

    def reset(self, capacity: int) -> None:
        self._cache = self._cache_cls(config=self.model.config)
        self._rollback.attach(self._cache)
        self._length = 0
        self._forward_start = 0

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, layer_ids: Sequence[int] | None, last_only: bool = False) -> TargetOutput:
        t = input_ids.shape[-1]
        self._wanted = set(layer_ids or ())
        positions = torch.arange(self._length, self._length + t, device=self.device)[None]
        self._rollback.begin(t)
        try:
            out = self.model(
                input_ids=input_ids.view(1, t).to(self.device),
                position_ids=positions,
                use_cache=True,
                output_hidden_states=bool(layer_ids) and self._layers is None,
                logits_to_keep=1 if last_only else 0,
                **{self._cache_arg: self._cache},
            )
        finally:
            self._rollback.end()
        self._wanted = set()
        self._forward_start = self._length
        self._length += t
        features = None
        if layer_ids:
            if self._layers is None:
                parts = [out.hidden_states[i + 1][0] for i in layer_ids]
            else:
                parts = [self._captured[i][0] for i in layer_ids]
            self._captured = {}
            features = torch.cat(parts, dim=-1)
        return TargetOutput(out.logits[0], features)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions; ``length`` must lie within the latest forward
        (rolling back further is not something the loop does, and linear-attention and
        sliding-window layers could not do it at a cost independent of the context)."""
        if length > self._length:
            raise ValueError(f"cannot truncate to {length} positions: the cache holds {self._length}")
        if length < self._forward_start:
            raise ValueError(f"cannot truncate to {length} positions: rolling back reaches only into the latest "
                             f"forward, which began at {self._forward_start}")
        self._rollback.rollback(length - self._forward_start, self._length - length)
        self._length = length

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(input_ids.to(self.device))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The decoder layer list of a causal LM, when it has the usual ``model.layers`` shape."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    n = model.config.get_text_config().num_hidden_layers
    return list(layers) if layers is not None and len(layers) == n else None


# ----------------------------------------------------------------------------------- fast runner
def fast_path_reason(model: torch.nn.Module) -> str | None:
    """Why ``FastTarget`` cannot run this model (None when it can)."""
    cfg = model.config
    family = getattr(cfg, "model_type", "")
    if family not in FAST_FAMILIES:
        return f"model_type {family!r} is not one of {FAST_FAMILIES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", family == "mistral"):
        return "sliding-window attention"
    if any(not p.dtype.is_floating_point for p in model.parameters()):
        return "quantized weights (e.g. bitsandbytes 4/8-bit)"
    if len({p.device for p in model.parameters()}) > 1:
        return "weights spread over several devices"
    # FastTarget fuses q/k/v with their biases (Qwen2) but has no bias on the MLP or the output
    # projection: a Llama with mlp_bias or attention_bias (which biases o_proj too) goes to HFTarget.
    biased = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if name.endswith(_UNFUSED_BIAS) and getattr(module, "bias", None) is not None})
    if biased:
        return f"biases on {', '.join(biased)} (FastTarget has none on the MLP or the output projection)"
    return None


# Projections whose biases FastTarget does not apply (module names as transformers spells them).
_UNFUSED_BIAS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj")


def _fuse_linears(linears: Sequence[torch.nn.Linear]) -> torch.Tensor:
    """One weight for several linears sharing an input; the modules keep views of it, so the
    fused copy costs no extra memory and the transformers model still works."""
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()
    offset = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused[offset : offset + rows], requires_grad=False)
        offset += rows
    return fused


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: Linear  # q, k and v projections fused (with their biases where the model has them)
    qk_norm: torch.Tensor | None  # (q_heads + kv_heads, D): Qwen3's q_norm / k_norm, stacked
    o: Linear
    ln2: torch.Tensor
    gate_up: Linear  # gate and up projections fused
    down: Linear


class FastTarget:
    """Llama-family forward with fused weights and a position-indexed, batch-invariant KV cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        reason = fast_path_reason(model)
        if reason:
            raise ValueError(f"FastTarget cannot run this model: {reason}")
        cfg = model.config
        self.config = cfg
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.hidden_size // self.num_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        inner = model.model
        self.embed_weight = inner.embed_tokens.weight.detach()
        self.device = self.embed_weight.device
        self.dtype = self.embed_weight.dtype
        self._lm_head = Linear(model.get_output_embeddings().weight.detach())
        self.final_norm = inner.norm.weight.detach()
        self.rotary = inner.rotary_emb
        self.layers = [self._fuse(layer) for layer in inner.layers]
        self._k = self._v = None
        self._tree: tuple | None = None  # (start, nodes, their V) between forward_tree and keep_path
        # Copies of the value cache for tree verification (see forward_tree); positions below
        # ``_replicas_valid`` equal the cache's.
        self._replicas: torch.Tensor | None = None
        self._replicas_valid: list[int] = []
        self._capacity = 0
        self._length = 0
        self._cos = self._sin = None
        # Fewest rows a forward runs with (see forward), and whether that makes every position's
        # numbers independent of how many rows share its pass: decided by a probe on this
        # machine's kernels, never assumed (they differ between CPUs and dtypes).
        self._min_rows, self.batch_invariant = self._probe_min_rows()

    def _probe_min_rows(self) -> tuple[int, bool]:
        """The fewest rows per pass (from ``MIN_ROWS_CANDIDATES``) with which decoding a sequence
        in passes of every size in ``PROBE_CHUNKS`` gives, bit for bit, the logits of one pass
        over the whole sequence; ``(smallest candidate, False)`` when none does.

        Matrix kernels choose their code path (GEMV, register blocking, K split) from the number
        of rows, and which row counts share a path differs between CPUs (AMD / Intel, AVX2 /
        AVX-512 / AMX) and dtypes. Padding small passes to ``min_rows`` keeps them on the path
        the larger passes take; the probe finds the padding that does so here."""
        chunks = list(PROBE_CHUNKS)
        while sum(chunks) > self.max_positions and len(chunks) > 1:  # a model with a short context
            chunks.pop()
        generator = torch.Generator().manual_seed(0)
        total = sum(chunks)
        ids = torch.randint(0, self.vocab_size, (total,), generator=generator).to(self.device)
        capacity = round_capacity(total)
        for min_rows in MIN_ROWS_CANDIDATES:
            self._min_rows = min_rows
            self.reset(capacity)
            whole = self.forward(ids, None).logits
            self.reset(capacity)
            pieces, start = [], 0
            for size in chunks:
                pieces.append(self.forward(ids[start : start + size], None).logits)
                start += size
            if torch.equal(torch.cat(pieces), whole):
                self.reset(capacity)
                return min_rows, True
        self.reset(capacity)
        return MIN_ROWS_CANDIDATES[0], False

    @staticmethod
    def _fuse(layer: torch.nn.Module) -> _Layer:
        att, mlp = layer.self_attn, layer.mlp
        if getattr(mlp.gate_proj, "bias", None) is not None or getattr(att.o_proj, "bias", None) is not None:
            raise ValueError("FastTarget does not support MLP / output-projection biases")
        wqkv = _fuse_linears((att.q_proj, att.k_proj, att.v_proj))
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
        return _Layer(
            ln1=layer.input_layernorm.weight.detach(),
            qkv=Linear(wqkv, bqkv),
            qk_norm=qk_norm,
            o=Linear(att.o_proj.weight.detach()),
            ln2=layer.post_attention_layernorm.weight.detach(),
            gate_up=Linear(_fuse_linears((mlp.gate_proj, mlp.up_proj))),
            down=Linear(mlp.down_proj.weight.detach()),
        )

    @property
    def length(self) -> int:
        return self._length

    def reset(self, capacity: int) -> None:
        capacity = round_capacity(max(1, min(capacity, self.max_positions)))
        if capacity != self._capacity:
            shape = (self.num_layers, self.num_kv_heads, capacity, self.head_dim)
            # Zeros, not empty: masked-out slots are multiplied by exactly 0 in attention, and
            # 0 * NaN would poison the row.
            self._k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._cos, self._sin = self.rope_tables(capacity)
            self._capacity = capacity
        self._length = 0
        self._replicas_valid = [0] * len(self._replicas_valid)

    def rope_tables(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (capacity, heads + kv_heads, D), for ``rope``: queries' rows carry
        the attention scale, so attention needs no separate scaling."""
        positions = torch.arange(capacity, device=self.device)[None]
        cos, sin = self.rotary(self.embed_weight[:1][None], positions)
        cos, sin = cos[0], sin[0]  # (capacity, D)
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, D/2) * (sin with its first half negated); and the
        # attention scale is folded into the queries' tables: one rotation for q and k.
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        scale = torch.ones(self.num_heads + self.num_kv_heads, 1, dtype=cos.dtype, device=self.device)
        scale[: self.num_heads] = self.scale
        return cos[:, None, :] * scale, sin[:, None, :] * scale

    def truncate(self, length: int) -> None:
        self._length = min(self._length, length)
        self._replicas_valid = [min(v, self._length) for v in self._replicas_valid]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids.to(self.device), self.embed_weight)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._lm_head.weight

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * y.to(x.dtype)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + x.roll(self.head_dim // 2, dims=-1) * sin

    # One decoder layer in two halves around attention, shared with the batched decoder of the
    # training data (training/batched_decode.py), which attends over its own cache layout.
    def attention_inputs(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (T, heads, D), already scaled by 1/sqrt(D), keys and values (T, kv_heads, D)."""
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = layer.qkv(self.norm(x, layer.ln1)).unflatten(-1, (h + 2 * kv, d))
        qk = qkv[:, : h + kv]
        if layer.qk_norm is not None:
            qk = self.norm(qk, layer.qk_norm)
        qk = self.rope(qk, cos, sin)
        return qk[:, :h], qk[:, h:], qkv[:, h + kv :]

    def finish_layer(self, layer: _Layer, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The residual stream after the layer, given its attention output (T, heads * D)."""
        x = x + layer.o(attention)
        gate, up = layer.gate_up(self.norm(x, layer.ln2)).chunk(2, dim=-1)
        return x + layer.down(F.silu(gate) * up)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._lm_head(self.norm(x, self.final_norm))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, layer_ids: Sequence[int] | None, last_only: bool = False) -> TargetOutput:
        ids = input_ids.reshape(-1).to(self.device)
        if ids.shape[0] > PREFILL_CHUNK:
            # Long prompts go through in chunks: attention scores are (heads, T, capacity).
            parts = [self.forward(ids[i : i + PREFILL_CHUNK], layer_ids, last_only) for i in range(0, ids.shape[0], PREFILL_CHUNK)]
            logits = parts[-1].logits if last_only else torch.cat([p.logits for p in parts])
            features = torch.cat([p.features for p in parts]) if layer_ids else None
            return TargetOutput(logits, features)
        real = ids.shape[0]
        start = self._length
        end = start + real
        if real < self._min_rows:
            # Matrix kernels pick another code path (a GEMV, a different K split) for a single
            # row, which rounds differently; repeating the last row keeps every position on the
            # multi-row path, so a token decoded alone matches the same token inside a block.
            ids = torch.cat((ids, ids[-1:].expand(self._min_rows - real)))
        t = ids.shape[0]
        if end > self._capacity:
            raise ValueError(f"KV cache holds {self._capacity} positions; {end} requested (call reset with more)")
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        group = h // kv
        cap = self._capacity
        rows = torch.arange(start, start + t, device=self.device).clamp_max(end - 1)
        cos = self._cos[rows]  # (T, heads + kv_heads, D)
        sin = self._sin[rows]
        # Causal mask over the whole cache: query at absolute position p sees keys 0..p. Every
        # query row has the same length whatever T is -> identical arithmetic per position.
        visible = torch.arange(cap, device=self.device)[None, :] <= rows[:, None]
        hidden_mask = ~visible  # (T, cap)
        wanted = {i: n for n, i in enumerate(layer_ids or ())}
        feats: list[torch.Tensor | None] = [None] * len(wanted)

        x = F.embedding(ids, self.embed_weight)  # (T, H)
        for li, layer in enumerate(self.layers):
            q, k, v = self.attention_inputs(layer, x, cos, sin)
            self._k[li, :, start:end] = k[:real].transpose(0, 1)
            self._v[li, :, start:end] = v[:real].transpose(0, 1)
            # (kv, group*T, d): the query heads that share a KV head, stacked.
            qg = q.reshape(t, kv, group, d).permute(1, 2, 0, 3).reshape(kv, group * t, d)
            scores = torch.matmul(qg, self._k[li].transpose(1, 2))  # (kv, group*T, cap)
            scores = scores.view(kv, group, t, cap).masked_fill(hidden_mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype).view(kv, group * t, cap)
            att = torch.matmul(probs, self._v[li])  # (kv, group*T, d)
            x = self.finish_layer(layer, x, att.view(kv, group, t, d).permute(2, 0, 1, 3).reshape(t, h * d))
            if li in wanted:
                feats[wanted[li]] = x[:real]
        self._length = end
        x = x[:real]
        logits = self.logits(x[-1:] if last_only else x)
        features = torch.cat(feats, dim=-1) if feats else None
        return TargetOutput(logits, features)

    # ------------------------------------------------------------------------- tree verification
    @torch.inference_mode()
    def forward_tree(self, tree: DraftTree, layer_ids: Sequence[int] | None) -> TargetOutput:
        """Score every node of a draft tree in one pass (see ``tree.py``); logits and features
        come in node order. ``tree`` must be depth-first (``dflash_core.tree.depth_first``).
        Call ``keep_path`` next: it moves the kept nodes' K/V into place.

        Node ``n`` sits at position ``length + depth(n)`` and sees the cached positions and its
        own ancestors. Its arithmetic is what autoregressive decoding of its path does: its
        attention row is laid out as if its ancestors filled the positions after the cache
        (scores gathered into that order; values read in that order: the first path's from the
        cache itself, every other path's from its own copy of the value cache with the path
        written in, or, when those copies would pass ``REPLICA_BYTES``, from the cache itself
        with the path written in, one path at a time), so the cache span, the masking and the
        order of every sum are those of ``forward``. In bf16 every node's logits and features equal, bit for bit, those of
        decoding its path token by token, so greedy tree verification is exactly the target's
        greedy decoding (tested); in fp32 they agree within rounding, as a chain's do.
        """
        groups = tree.leaf_groups()
        if [n for _, nodes in groups for n in nodes] != list(range(len(tree))):
            raise ValueError("forward_tree needs a depth-first tree (dflash_core.tree.depth_first)")
        ids = torch.tensor(tree.tokens, dtype=torch.long, device=self.device)
        real = ids.shape[0]
        start = self._length
        end = start + real
        if end > self._capacity:
            raise ValueError(f"KV cache holds {self._capacity} positions; {end} requested (call reset with more)")
        depths = torch.tensor(tree.depths, device=self.device)
        ancestors = torch.tensor(tree.ancestors(), device=self.device)  # (real, real) node ids
        if real < self._min_rows:  # as in forward: every row on the multi-row kernel path
            pad = self._min_rows - real
            ids = torch.cat((ids, ids[-1:].expand(pad)))
            depths = torch.cat((depths, depths[-1:].expand(pad)))
            ancestors = torch.cat((ancestors, ancestors[-1:].expand(pad, -1)))
        t = ids.shape[0]
        # The value product. The first path (nodes 0..L-1, depths 0..L-1) finds its values in
        # place in the cache: one product over its rows (at least the multi-row threshold).
        # Every other path p: one batched product of its run of nodes, widened to ``width`` rows
        # by borrowing neighbours (computed, then discarded), against replica p of the value
        # cache, which holds the committed values then p's path in depth order.
        main = max(len(groups[0][1]), self._min_rows)
        others = groups[1:]
        paths = len(others)
        cap = self._capacity
        replica_bytes = self.num_layers * paths * self.num_kv_heads * cap * self.head_dim * self._v.element_size()
        use_replicas = paths > 0 and replica_bytes <= REPLICA_BYTES
        if paths and not use_replicas:
            # Depth-first, path p's run [a, b) sits at depths depth(a)..; below depth(a) the path
            # before it left exactly p's ancestors in the cache.
            turns = []
            for _, nodes in others:
                a, b = nodes[0], nodes[-1] + 1
                first = max(0, min(a, b - self._min_rows))
                turns.append((tree.depths[a], first, a, b, max(b, min(t, first + self._min_rows))))
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if use_replicas:
            # Index vectors for the whole pass (the same in every layer), so that each layer
            # moves rows with index_select / index_copy_, the cheapest indexing ops.
            width = max(max(len(nodes) for _, nodes in others), self._min_rows)
            firsts = [min(nodes[0], t - width) for _, nodes in others]
            window = [f + i for f in firsts for i in range(width)]  # path p's rows: p*width..
            # Node r of path p is row r - firsts[p] of p's product.
            pick = [p * width + r - firsts[p] for p, (_, nodes) in enumerate(others) for r in nodes]
            # Path p's nodes go into replica p at their depths: flat rows of (paths, kv, cap).
            write_node = [n for path, _ in others for n in path]
            write_row = [(p * kv + head) * cap + start + tree.depths[n]
                         for p, (path, _) in enumerate(others) for n in path for head in range(kv)]
            window, pick, write_node, write_row = (torch.tensor(x, device=self.device)
                                                   for x in (window, pick, write_node, write_row))
            replicas = self._value_replicas(paths, start)
        group = h // kv
        positions = start + depths
        cos, sin = self._cos[positions], self._sin[positions]
        hidden_mask = ~(torch.arange(cap, device=self.device)[None, :] <= positions[:, None])  # (T, cap)
        gather = ancestors[None, :, None, :].expand(kv, t, group, real)
        wanted = {i: n for n, i in enumerate(layer_ids or ())}
        feats: list[torch.Tensor | None] = [None] * len(wanted)
        tree_values = []

        x = F.embedding(ids, self.embed_weight)
        for li, layer in enumerate(self.layers):
            q, k, v = self.attention_inputs(layer, x, cos, sin)
            self._k[li, :, start:end] = k[:real].transpose(0, 1)
            self._v[li, :, start:end] = v[:real].transpose(0, 1)
            # Rows ordered (kv head, node, query head in the group): a run of nodes is then one
            # (kv, rows, cap) view for the value product.
            qg = q.reshape(t, kv, group, d).transpose(0, 1).reshape(kv, t * group, d)
            scores = torch.matmul(qg, self._k[li].transpose(1, 2)).view(kv, t, group, cap)
            # Columns start.. hold the nodes in node order; each row wants its ancestors there.
            scores[..., start:end] = scores[..., start:end].gather(-1, gather)
            scores = scores.masked_fill(hidden_mask[:, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
            values = v[:real].transpose(0, 1)  # (kv, real, d), node order (what was written above)
            tree_values.append(values)
            first = torch.matmul(probs[:, :main].reshape(kv, main * group, cap), self._v[li])
            first = first.view(kv, main, group, d).transpose(0, 1)  # (rows, kv, group, d)
            if not paths:  # a chain (with its padding rows, if any)
                att = first
            elif use_replicas:
                layer_replicas = replicas[li, :paths]  # (paths, kv, cap, d), contiguous
                layer_replicas.view(-1, d).index_copy_(0, write_row, v.index_select(0, write_node).view(-1, d))
                chosen = probs.index_select(1, window).view(kv, paths, width * group, cap).transpose(0, 1)
                out = torch.bmm(chosen.reshape(paths * kv, width * group, cap), layer_replicas.view(paths * kv, cap, d))
                out = out.view(paths, kv, width, group, d).transpose(1, 2).reshape(paths * width, kv, group, d)
                parts = [first[: len(groups[0][1])], out.index_select(0, pick)]
                if t > real:  # padding rows: copies of the last node
                    parts.append(parts[-1][-1:].expand(t - real, -1, -1, -1))
                att = torch.cat(parts)
            else:  # one path at a time, its run written into the cache (keep_path restores it)
                att = torch.empty(t, kv, group, d, dtype=self.dtype, device=self.device)
                att[:main] = first
                for depth, lo, a, b, hi in turns:
                    self._v[li, :, start + depth : start + depth + b - a] = values[:, a:b]
                    part = torch.matmul(probs[:, lo:hi].reshape(kv, (hi - lo) * group, cap), self._v[li])
                    att[a:b] = part.view(kv, hi - lo, group, d).transpose(0, 1)[a - lo : b - lo]
                if t > real:  # padding rows: copies of the last node
                    att[real:] = att[real - 1 : real]
            x = self.finish_layer(layer, x, att.reshape(t, h * d))
            if li in wanted:
                feats[wanted[li]] = x[:real]
        self._tree = (start, real, torch.stack(tree_values))
        self._length = end
        features = torch.cat(feats, dim=-1) if feats else None
        return TargetOutput(self.logits(x[:real]), features)

    def _value_replicas(self, paths: int, start: int) -> torch.Tensor:
        """(layers, >= paths, kv, capacity, D) copies of the value cache, the first ``paths``
        valid before ``start`` (path-major, so one layer's first ``paths`` replicas are one
        contiguous block). Kept between calls: each replica copies in only the positions
        committed since it was last used."""
        old = self._replicas
        if old is None or old.shape[1] < paths or old.shape[3] != self._capacity:
            count = paths if old is None or old.shape[1] < paths else old.shape[1]
            shape = (self.num_layers, max(count, 8), self.num_kv_heads, self._capacity, self.head_dim)
            self._replicas = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._replicas_valid = [0] * shape[1]
        for p in range(paths):
            valid = self._replicas_valid[p]
            if valid < start:
                self._replicas[:, p, :, valid:start] = self._v[:, :, valid:start]
            self._replicas_valid[p] = start
        return self._replicas

    def keep_path(self, nodes: Sequence[int]) -> None:
        """After ``forward_tree``: keep the K/V of ``nodes`` (a root-first path) at consecutive
        positions, where autoregressive decoding of that path would have put them."""
        start, real, values = self._tree
        index = torch.tensor(list(nodes), device=self.device)
        keys = self._k[:, :, start : start + real].clone()
        self._k[:, :, start : start + len(nodes)] = keys[:, :, index]
        self._v[:, :, start : start + len(nodes)] = values[:, :, index]
        self._length = start + len(nodes)
        self._tree = None


def make_runner(model: torch.nn.Module, engine: str = "auto") -> TargetRunner:
    """``FastTarget`` when the model allows it (``engine='auto'|'fast'``), else ``HFTarget``."""
    if engine == "hf":
        return HFTarget(model)
    reason = fast_path_reason(model)
    if reason is None:
        return FastTarget(model)
    if engine == "fast":
        raise ValueError(f"engine='fast' cannot run this target: {reason}; use engine='hf' or 'auto'")
    return HFTarget(model)
