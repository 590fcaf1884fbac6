"""Greedy decoding of many prompts at once, with continuous batching (Llama-family targets).

The self-distillation stage spends most of the recipe's time generating, so its throughput
decides how much data a CPU-hour buys. transformers' batched ``generate()`` leaves most of that
on the table here (SmolLM2-135M, bf16, 2 cores, 64 rows: 200 ms per decode step against 71 ms
of matrix products, ``scripts/profile_generation.py``): its cache grows by concatenation, every
KV head is repeated for its query heads at every step, and a batch runs until its longest answer
ends, so rows whose answer ended early compute padding.

Here every slot owns a preallocated stretch of the KV cache, query heads read their shared KV
head in place (no repeat), and a slot whose answer ended takes the next prompt at once: the
decode step always runs full. The weights and the per-layer math are ``FastTarget``'s (its
per-layer interface: ``layers``, ``attention_inputs``, ``finish_layer``, ``logits``); the cache is
``kv_cache.SlotKVCache``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F

from ..kv_cache import SlotKVCache
from ..target import FastTarget


@dataclass
class Answer:
    key: Hashable
    response: list[int]
    finished: bool  # ended with EOS (else cut at max_new_tokens)
    # (prompt + response tokens, len(layer_ids) * H) when features were asked for, else None
    features: torch.Tensor | None = None


@dataclass
class _Slot:
    key: Hashable | None = None
    response: list[int] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)
    closing: bool = False  # answer complete; one more step computes its last token's features


class ContinuousBatchDecoder:
    """``slots`` sequences decoded together; each slot holds at most ``capacity`` positions."""

    def __init__(self, target: FastTarget, slots: int, capacity: int, layer_ids: Sequence[int] = ()) -> None:
        self.t = target
        # Hidden states to hand back with every position (the drafter's training features): the
        # residual stream after these layers, as ``TargetRunner.forward`` defines them.
        self.layer_ids = list(layer_ids)
        self.slots = slots
        self.cache = SlotKVCache(target.num_layers, slots, target.num_kv_heads, target.head_dim, capacity,
                                 target.dtype, target.device)
        self.cos, self.sin = target.rope_tables(self.cache.capacity)

    def _keep(self, feats: list[torch.Tensor | None], li: int, x: torch.Tensor) -> None:
        if li in self.layer_ids:
            feats[self.layer_ids.index(li)] = x

    def _features(self, feats: list[torch.Tensor | None]) -> torch.Tensor | None:
        return torch.cat(feats, dim=-1) if feats else None

    @torch.inference_mode()
    def prefill(self, slot: int, ids: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """Put prompt ``ids`` (P,) in ``slot`` (forgetting what it held); returns the next token
        and the prompt's features (P, len(layer_ids) * H), None without layer ids."""
        t, cache = self.t, self.cache
        p = ids.shape[0]
        if p + 1 > cache.capacity:
            raise ValueError(f"a prompt of {p} tokens does not fit slots of {cache.capacity} positions")
        h, d = t.num_heads, t.head_dim
        x = t.embed(ids)
        cos, sin = self.cos[:p], self.sin[:p]
        feats: list[torch.Tensor | None] = [None] * len(self.layer_ids)
        for li, layer in enumerate(t.layers):
            q, k, v = t.attention_inputs(layer, x, cos, sin)
            cache.k_t[li, slot, :, :, :p] = k.permute(1, 2, 0)
            cache.v[li, slot, :, :p] = v.transpose(0, 1)
            att = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=1.0, enable_gqa=True,
            )
            x = t.finish_layer(layer, x, att[0].transpose(0, 1).reshape(p, h * d))
            self._keep(feats, li, x)
        cache.lengths[slot] = p
        return int(t.logits(x[-1:]).argmax(-1)), self._features(feats)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append one token (slots,) to every slot; returns each slot's greedy next token and the
        appended tokens' features (slots, len(layer_ids) * H), None without layer ids."""
        t, cache = self.t, self.cache
        h, kv, d = t.num_heads, t.num_kv_heads, t.head_dim
        group = h // kv
        n = self.slots
        pos = cache.lengths.clone()
        if int(pos.max()) >= cache.capacity:
            raise ValueError(f"a slot is full ({cache.capacity} positions)")
        span = int(pos.max()) + 1  # attention reads only the filled part of the cache
        rows = torch.arange(n, device=pos.device)
        hidden = (torch.arange(span, device=pos.device)[None, :] > pos[:, None])[:, None, None, :]
        x = t.embed(tokens)
        cos, sin = self.cos[pos], self.sin[pos]
        feats: list[torch.Tensor | None] = [None] * len(self.layer_ids)
        for li, layer in enumerate(t.layers):
            q, k, v = t.attention_inputs(layer, x, cos, sin)
            keys_t, values = cache.k_t[li], cache.v[li]
            keys_t[rows, :, :, pos] = k
            values[rows, :, pos] = v
            # (slots*kv, group, d) @ (slots*kv, d, span): the query heads of a group share their
            # KV head (no repeat), and only the filled part of the cache takes part.
            scores = torch.matmul(q.reshape(n * kv, group, d), keys_t[..., :span].reshape(n * kv, d, span))
            scores = scores.view(n, kv, group, span).masked_fill(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(t.dtype).view(n * kv, group, span)
            att = torch.matmul(probs, values[:, :, :span].reshape(n * kv, span, d)).reshape(n, h * d)
            x = t.finish_layer(layer, x, att)
            self._keep(feats, li, x)
        cache.lengths += 1
        # Converting to fp32 first: its argmax is faster than bf16's, more than paying for the copy.
        return t.logits(x).float().argmax(-1), self._features(feats)

    def release(self, slot: int) -> None:
        self.cache.release(slot)


def greedy_decode_stream(
    target: FastTarget,
    prompts: Iterable[tuple[Hashable, list[int]]],
    max_new_tokens: int,
    eos_token_id: int | None,
    slots: int = 64,
    max_prompt_tokens: int = 640,
    stop: Callable[[], bool] = lambda: False,
    layer_ids: Sequence[int] = (),
) -> Iterator[Answer]:
    """Yield an ``Answer`` per prompt as answers end (not in input order).

    A response ends with ``eos_token_id`` (``finished``) or after ``max_new_tokens`` tokens.
    Once ``stop()`` is true no new prompt starts; the answers under way are completed. With
    ``layer_ids``, every answer comes with the target's features at each of its positions, prompt
    and response (the last response token takes one more step through the batch for them)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    decoder = ContinuousBatchDecoder(target, slots, max_prompt_tokens + max_new_tokens, layer_ids)
    capture = bool(layer_ids)
    queue = iter(prompts)
    state = [_Slot() for _ in range(slots)]
    last = torch.zeros(slots, dtype=torch.long, device=target.device)
    exhausted = False

    def complete(slot: _Slot) -> bool:
        return slot.response[-1] == eos_token_id or len(slot.response) >= max_new_tokens

    def answer(slot: _Slot) -> Answer:
        features = torch.cat(slot.features) if capture else None
        return Answer(slot.key, slot.response, slot.response[-1] == eos_token_id, features)

    while True:
        # Refill free slots; a prompt whose first token already ends it is yielded at once.
        for i, slot in enumerate(state):
            while slot.key is None and not exhausted:
                if stop():
                    exhausted = True
                    break
                item = next(queue, None)
                if item is None:
                    exhausted = True
                    break
                key, ids = item
                if len(ids) > max_prompt_tokens:
                    raise ValueError(f"prompt {key!r} has {len(ids)} tokens; at most {max_prompt_tokens}")
                first, feats = decoder.prefill(i, torch.tensor(ids, dtype=torch.long, device=target.device))
                slot.key, slot.response = key, [first]
                slot.features = [feats] if capture else []
                last[i] = first
                if complete(slot):
                    if capture:
                        slot.closing = True
                    else:
                        yield answer(slot)
                        state[i] = slot = _Slot()
                        decoder.release(i)
        if not any(slot.key is not None for slot in state):
            return
        nxt, feats = decoder.step(last)
        nxt = nxt.tolist()
        for i in range(slots):
            slot = state[i]
            if slot.key is None:
                decoder.release(i)  # idle slots decode padding at position 0
                continue
            if capture:
                slot.features.append(feats[i : i + 1])
            if not slot.closing:
                slot.response.append(nxt[i])
                last[i] = nxt[i]
                slot.closing = complete(slot)
                if not (slot.closing and not capture):
                    continue
            yield answer(slot)
            state[i] = _Slot()
            decoder.release(i)
