"""Running the target model one block at a time, with a KV cache that can roll back.

Two runners share one small interface (``TargetRunner``):

* ``FastTarget`` — our own forward for the families ``families.py`` has an adapter for (Llama,
  Qwen2, Qwen3, Mistral without a sliding window), whose weights it fuses (one QKV and one
  gate/up matmul per layer). The KV cache is position-indexed (``kv_cache.py``: rolling back is
  forgetting a length; rejected slots are overwritten later), and a row's attention spans the
  whole cache (the compiled attention: the row's position rounded up, ``aoti_attention.span_of``),
  with a causal mask: a span set by the position alone, never by the pass. That last choice makes
  the computation *batch invariant*: the logits of a position are bit-for-bit the same in bf16
  whether the position is verified alone (autoregressive decoding) or inside a block of 16, so
  greedy DFlash reproduces the engine's own greedy autoregressive output exactly (tested). That
  rests on the matrix kernels giving a row the same numbers whatever the number of rows beside
  it, which depends on the CPU and the dtype: a probe at load (``FastTarget.batch_invariant``)
  finds how many rows a pass needs for that and says whether any number suffices; where none
  does, outputs agree within rounding instead.
  ``forward_tree`` scores a whole draft tree in one pass with the same per-row arithmetic
  (``tree_attention.py``), so tree verification is exactly greedy decoding too.
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
from dataclasses import replace
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F

from .aoti_attention import MIN_CALL_ROWS, eager_attention
from .aoti_kernels import KERNELS
from .kernels import padded_rows
from . import cuda_graphs
from .aoti_layers import CompiledHalf, CompiledLayer
from .families import ADAPTERS, FusedLayer, fast_path_reason
from .kernel_choice import MIN_ROWS_CANDIDATES, choose_kernels
from .kv_cache import KVCache
from .rollback import CacheRollback
from .tree import DraftTree
from .tree_attention import TreeAttention
from .weight_formats import DYNAMIC_MATRICES, WEIGHT_FORMATS

PREFILL_CHUNK = 512  # longest slice of a prompt FastTarget processes at once


class TargetOutput:
    """A pass's logits (T, V, in the model's dtype) and, where asked, its features (T,
    len(layer_ids) * H). Given ``hidden`` and ``head`` instead of logits (``FastTarget`` on CPU),
    a row's logits are ``head`` of its row of ``hidden``, computed when first read
    (``logits_at``, ``logits``): on CPU the LM head is a large part of a verify pass, and a greedy
    walk needs only the rows on its path. A row's logits do not depend on the rows computed
    beside it (the runner's batch invariance), so they are the same either way."""

    def __init__(self, logits: torch.Tensor | None, features: torch.Tensor | None,
                 hidden: torch.Tensor | None = None, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if (logits is None) == (head is None or hidden is None):
            raise ValueError("TargetOutput takes its logits, or the rows and head that compute them")
        self.features = features
        self.rows = len(logits) if logits is not None else len(hidden)
        self._hidden, self._head = hidden, head
        self._logits = logits  # (T, V): every row's where given, else rows filled in as computed
        self._known = [logits is not None] * self.rows

    @property
    def computed(self) -> int:
        """How many rows' logits exist so far."""
        return sum(self._known)

    def logits_at(self, rows: Sequence[int]) -> torch.Tensor:
        """The logits of ``rows`` (len(rows), V), computing those not yet computed in one call of the head."""
        rows = list(rows)
        missing = sorted({r for r in rows if not self._known[r]})
        if len(missing) == self.rows:  # all at once: no gathering or scattering of rows
            self._logits = self._head(self._hidden)
        elif missing:
            a, b = missing[0], missing[-1] + 1
            # a run of rows is a view; scattered rows are gathered
            at = slice(a, b) if b - a == len(missing) else torch.tensor(missing, device=self._hidden.device)
            computed = self._head(self._hidden[at])
            if self._logits is None:
                self._logits = computed.new_empty(self.rows, computed.shape[-1])
            self._logits[at] = computed
        for r in missing:
            self._known[r] = True
        if rows == list(range(self.rows)):
            return self._logits
        if rows == list(range(rows[0], rows[-1] + 1)):
            return self._logits[rows[0] : rows[-1] + 1]
        return self._logits[torch.tensor(rows, dtype=torch.long, device=self._logits.device)]

    @property
    def logits(self) -> torch.Tensor:
        """Every row's logits (T, V)."""
        return self.logits_at(range(self.rows))


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
class FastTarget:
    """A ``families`` adapter's fused weights run over a position-indexed, batch-invariant
    ``KVCache``; ``forward_tree`` / ``keep_path`` are ``tree_attention``'s.

    ``layers``, ``attention_inputs``, ``finish_layer``, ``logits``, ``embed`` and ``rope_tables``
    are the per-layer interface the batched decoder of the training data shares
    (``training/batched_decode.py``): the same weights and math over its own cache."""

    def __init__(self, model: torch.nn.Module, weights: str = "bf16", q4_blocks: dict | None = None,
                 kernels: str = "onednn", calibration_ids: torch.Tensor | None = None) -> None:
        reason = fast_path_reason(model)
        if reason:
            raise ValueError(f"FastTarget cannot run this model: {reason}")
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights = {weights!r}; allowed: {', '.join(WEIGHT_FORMATS)}")
        if kernels not in KERNELS:
            raise ValueError(f"kernels = {kernels!r}; allowed: {', '.join(KERNELS)}")
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
        fused = ADAPTERS[cfg.model_type].fuse(model)
        self.embed_weight = fused.embed
        self.device = self.embed_weight.device
        self.dtype = self.embed_weight.dtype
        self._lm_head = fused.lm_head
        self._lm_head_weight = fused.lm_head.weight  # full precision whatever runs the head (the drafter shares it)
        self.final_norm = fused.final_norm
        self.rotary = fused.rotary
        self.layers = fused.layers
        self.cache = KVCache(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.device)
        self.cos = self.sin = None  # rope_tables for the cache's capacity
        self._tree_attention = TreeAttention(self)
        self.graphs: cuda_graphs.CudaGraphs | None = None  # set by choose_kernels after its probes (they run eager)
        # The GGUF's Q8_0 output matrix, for an int4 target's LM head as the file has it (weight_formats.q4_1_blocks)
        self._head_blocks = (q4_blocks or {}).get("lm_head")
        self._file_head_why: str | None = None  # why the head does not run those blocks, where it does not
        # What runs on this machine, set by choose_kernels from probes, never assumed: the layers'
        # weight format and kernels, each with a note saying why where it is not the one asked for;
        # the fewest rows a pass runs with (see forward) and whether that makes every position's
        # numbers independent of how many rows share its pass.
        self.weight_format, self.weight_note = "bf16", "bf16"
        self.kernels, self.kernel_note = "onednn", "oneDNN"
        self.compiled_layers = False  # whether the layers run whole-layer C++ kernels (aoti_layers, q4_layers)
        self.attention = None  # aoti_attention's kernel, beside compiled layers; None: eager_attention
        self._fused_pass = None  # q4_layers.FusedPass: a w4a8 target's layers in one call per chain pass
        self.min_rows, self.batch_invariant = MIN_ROWS_CANDIDATES[0], False
        choose_kernels(self, weights, kernels, q4_blocks, calibration_ids)

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self, capacity: int) -> None:
        allocated = self.cache.capacity
        self.cache.reset(max(1, min(capacity, self.max_positions)))
        if self.cache.capacity != allocated:
            self.cos, self.sin = self.rope_tables(self.cache.capacity)
        self._tree_attention.reset()

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
        self.cache.truncate(length)
        self._tree_attention.truncate(self.cache.length)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids.to(self.device), self.embed_weight)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._lm_head_weight

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * y.to(x.dtype)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + x.roll(self.head_dim // 2, dims=-1) * sin

    # One decoder layer in two halves around attention, which each caller lays out its own way.
    @torch.inference_mode()
    def activation_maxima(self, ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Per layer, the largest |value| of each input channel of ``DYNAMIC_MATRICES`` over the
        sequence ``ids`` (run from position 0 by the layers as they are): what ``w8a8``'s
        smoothing factors are computed from."""
        maxima: list[dict[str, torch.Tensor]] = [{} for _ in self.layers]

        def recording(i: int, name: str, linear):
            def call(x: torch.Tensor) -> torch.Tensor:
                seen = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()
                maxima[i][name] = torch.maximum(maxima[i][name], seen) if name in maxima[i] else seen
                return linear(x)
            return call

        layers = self.layers
        self.layers = [replace(layer, **{name: recording(i, name, getattr(layer, name)) for name in DYNAMIC_MATRICES})
                       for i, layer in enumerate(layers)]
        try:
            self.stacked_features([ids.reshape(-1)], [len(layers) - 1])
        finally:
            self.layers = layers
        return maxima

    def attention_inputs(self, layer: FusedLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (T, heads, D), already scaled by 1/sqrt(D), keys and values (T, kv_heads, D)."""
        if isinstance(layer, CompiledLayer):
            return layer.before(x, cos, sin)
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = layer.qkv(self.norm(x, layer.ln1)).unflatten(-1, (h + 2 * kv, d))
        qk = qkv[:, : h + kv]
        if layer.qk_norm is not None:
            qk = self.norm(qk, layer.qk_norm)
        qk = self.rope(qk, cos, sin)
        return qk[:, :h], qk[:, h:], qkv[:, h + kv :]

    def finish_layer(self, layer: FusedLayer, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The residual stream after the layer, given its attention output (T, heads * D)."""
        if isinstance(layer, CompiledLayer):
            return layer.after(x, attention)
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
        cache = self.cache
        real = ids.shape[0]
        start = cache.length
        end = start + real
        # Matrix kernels may pick another code path (a GEMV, a different K split) for a single
        # row, which rounds differently; repeating the last row up to ``min_rows`` keeps every
        # position on the multi-row path, so a token decoded alone matches the same token inside a
        # block (``min_rows`` 1, no padding, where the probe found a lone row rounds the same).
        (ids,) = padded_rows(self.min_rows, ids)
        cache.check_room(end)
        rows = torch.arange(start, start + ids.shape[0], device=self.device).clamp_max(end - 1)
        if self.graphs is not None:
            out = self.graphs.forward(ids, rows, real, layer_ids, last_only)
            if out is not None:
                cache.length = end
                return out
        out = self.positions_pass(ids, rows, real, layer_ids, last_only)
        cache.length = end
        return out

    def positions_pass(self, ids: torch.Tensor, rows: torch.Tensor, real: int, layer_ids: Sequence[int] | None,
                       last_only: bool) -> TargetOutput:
        """The layers over ``ids`` at cache positions ``rows`` (T,), whose first ``real`` are new
        (the rest repeat the last: see ``min_rows``): writes their keys and values, reads the
        cache up to each row. Positions come as a tensor, never as Python numbers, and every shape
        is fixed by T, ``real`` and the cache's capacity: a CUDA graph captured once replays it at
        any position (``cuda_graphs.py``)."""
        cache = self.cache
        keys, values = cache.k, cache.v
        new_rows = rows[:real]
        cos = self.cos[rows]  # (T, heads + kv_heads, D)
        sin = self.sin[rows]
        wanted = {i: n for n, i in enumerate(layer_ids or ())}
        feats: list[torch.Tensor | None] = [None] * len(wanted)

        x = F.embedding(ids, self.embed_weight)  # (T, H)
        if self.attention is not None:  # aoti_attention's kernel, between compiled halves
            x = self._compiled_layers(x, cos, sin, rows, wanted, feats, real)
        else:
            # Causal mask over the whole cache: query at absolute position p sees keys 0..p.
            hidden_mask = ~(torch.arange(cache.capacity, device=self.device)[None, :] <= rows[:, None])  # (T, cap)
            for li, layer in enumerate(self.layers):
                q, k, v = self.attention_inputs(layer, x, cos, sin)
                keys[li].index_copy_(1, new_rows, k[:real].transpose(0, 1))
                values[li].index_copy_(1, new_rows, v[:real].transpose(0, 1))
                x = self.finish_layer(layer, x, eager_attention(q, keys[li], values[li], rows, hidden_mask))
                if li in wanted:
                    feats[wanted[li]] = x[:real]
        features = torch.cat(feats, dim=-1) if feats else None
        return self.output(x[real - 1 : real] if last_only else x[:real], features)

    @property
    def logits_as_read(self) -> bool:
        """Whether a pass's logits are computed as they are read (``TargetOutput``): on CPU; on a
        GPU the head costs little and every read would wait for the device, so all at once."""
        return self.device.type == "cpu"

    def output(self, hidden: torch.Tensor, features: torch.Tensor | None) -> TargetOutput:
        """A pass's output for its final rows ``hidden`` (``logits_as_read``)."""
        if self.logits_as_read:
            return TargetOutput(None, features, hidden, self.logits)
        return TargetOutput(self.logits(hidden), features)

    def _compiled_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                         wanted: dict[int, int], feats: list, real: int) -> torch.Tensor:
        """``positions_pass``'s layer loop where the layers and attention run compiled: the same
        kernels on the same inputs as ``attention_inputs``, ``self.attention`` and
        ``finish_layer``, called straight through their runners where the rows share one span
        (the Python between kernels is a measurable part of a pass on a small model:
        docs/BENCHMARKS.md). AOTInductor reads its inputs as contiguous, hence the ``contiguous``
        calls (free where they already are). The attention kernel writes the padding rows too: at
        the last real row's position, the same keys and values (the same token there, rows
        independent of their company)."""
        if self._fused_pass is not None:
            return self._fused_pass(x, cos, sin, rows, wanted, feats, real)
        attention, (keys, values) = self.attention, (self.cache.k, self.cache.v)
        runs = attention.runs(rows.tolist(), self.cache.capacity)  # the rows' spans, the same in every layer
        attend, columns = attention.runner.run, runs[0][2]
        direct = len(runs) == 1 and len(rows) >= MIN_CALL_ROWS  # else the wrapper splits and pads the calls
        for li, layer in enumerate(self.layers):
            before = layer.before
            q, k, v = before.runner.run([x, cos, sin]) if isinstance(before, CompiledHalf) else before(x, cos, sin)
            if direct:
                att = attend([q.contiguous(), k.contiguous(), v.contiguous(), keys[li], values[li], rows, columns])[0]
            else:
                att = attention(q, k, v, keys[li], values[li], rows, runs)
            after = layer.after
            x = after.runner.run([x, att.contiguous()])[0] if isinstance(after, CompiledHalf) else after(x, att)
            if li in wanted:
                feats[wanted[li]] = x[:real]
        return x

    @torch.inference_mode()
    def stacked_features(self, sequences: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> list[torch.Tensor]:
        """The residual stream after ``layer_ids`` (as ``forward`` returns it) for several
        independent sequences, each from position 0, without the cache: their rows are stacked
        for the matrix products, which run faster on many rows than on one sequence's few
        hundred, and attention runs per sequence. For the training features, which need no
        logits and no bit-for-bit agreement with a decode (they are rounded to bf16 anyway)."""
        if self.compiled_layers:
            raise ValueError("stacked_features runs eager layers only (compiled ones have fixed shapes)")
        ids = [s.reshape(-1).to(self.device) for s in sequences]
        lengths = [int(s.shape[0]) for s in ids]
        cos, sin = self.rope_tables(max(lengths))
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        cos, sin = cos[positions], sin[positions]
        wanted = {i: n for n, i in enumerate(layer_ids)}
        last = max(wanted)
        feats: list[torch.Tensor | None] = [None] * len(wanted)
        h, d = self.num_heads, self.head_dim
        x = F.embedding(torch.cat(ids), self.embed_weight)  # (sum of lengths, H)
        for li, layer in enumerate(self.layers):
            q, k, v = self.attention_inputs(layer, x, cos, sin)
            att = [
                F.scaled_dot_product_attention(  # queries carry the scale (rope_tables)
                    qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                    is_causal=True, scale=1.0, enable_gqa=True,
                )[0].transpose(0, 1).reshape(-1, h * d)
                for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths))
            ]
            x = self.finish_layer(layer, x, torch.cat(att))
            if li in wanted:
                feats[wanted[li]] = x
            if li == last:
                break  # the layers above the deepest wanted one do not change the features
        return list(torch.cat(feats, dim=-1).split(lengths))

    @torch.inference_mode()
    def forward_tree(self, tree: DraftTree, layer_ids: Sequence[int] | None) -> TargetOutput:
        """Score every node of a draft tree in one pass (see ``tree_attention.py``); logits and
        features come in node order. ``tree`` must be depth-first
        (``dflash_core.tree.depth_first``). Call ``keep_path`` next: it moves the kept nodes'
        K/V into place. In bf16 every node's numbers equal, bit for bit, those of decoding its
        path token by token."""
        return self.output(*self._tree_attention.forward(tree, layer_ids))

    def keep_path(self, nodes: Sequence[int]) -> None:
        """After ``forward_tree``: keep the K/V of ``nodes`` (a root-first path) at consecutive
        positions, where autoregressive decoding of that path would have put them."""
        self._tree_attention.keep_path(nodes)


def make_runner(model: torch.nn.Module, engine: str = "auto", weights: str = "bf16",
                q4_blocks: dict | None = None, kernels: str = "onednn",
                calibration_ids: torch.Tensor | None = None) -> TargetRunner:
    """``FastTarget`` when the model allows it (``engine='auto'|'fast'``), else ``HFTarget``.
    ``weights`` (``weight_formats.WEIGHT_FORMATS``) and ``kernels`` (``aoti_kernels.KERNELS``)
    apply to ``FastTarget`` only: the runner's ``weight_format`` / ``weight_note`` and
    ``kernels`` / ``kernel_note`` say what runs."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights = {weights!r}; allowed: {', '.join(WEIGHT_FORMATS)}")
    if engine == "hf":
        return HFTarget(model)
    reason = fast_path_reason(model)
    if reason is None:
        return FastTarget(model, weights, q4_blocks, kernels, calibration_ids)
    if engine == "fast":
        raise ValueError(f"engine='fast' cannot run this target: {reason}; use engine='hf' or 'auto'")
    return HFTarget(model)
