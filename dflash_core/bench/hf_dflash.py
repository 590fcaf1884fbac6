"""The ``hf_dflash`` peer: transformers' own DFlash loop with our drafter converted to its assistant.

``model.generate(..., assistant_model=A, speculation_type="dflash")`` runs
``DFlashTokenCandidateGenerator`` in transformers' assisted-decoding loop. Its acceptance length
is not returned, so it is counted from what the loop streams: ``generate`` puts the prompt, then
once per loop iteration the tokens that iteration committed (``valid_tokens``, after its own EOS
and length cuts). The first iteration is the prefill (one token, no drafts: the generator needs
the target's hidden states first); every later one is a draft/verify cycle whose committed count
is ``accepted drafts + 1`` — the same quantity our ``CycleEvent.accept_len`` counts — except an
iteration that starts with one token of budget left: transformers' generator then proposes nothing
(a plain target step), and our loop likewise drafts nothing, so neither counts it.

One difference at the end of the budget stays: transformers always drafts a whole block and cuts
the committed tokens to the budget afterwards, while our loop shortens the last blocks to the
budget before drafting; their last one or two cycles can therefore count differently.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers.generation.streamers import BaseStreamer


class CycleCounter(BaseStreamer):
    """Records how many tokens each ``generate`` iteration committed (the first put is the prompt)."""

    def __init__(self, max_new_tokens: int) -> None:
        self.max_new_tokens = max_new_tokens
        self.puts: list[int] = []
        self.times: list[float] = []  # perf_counter at each put: the decode time, prefill excluded

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(int(value.numel()))
        self.times.append(time.perf_counter())

    @property
    def decode_seconds(self) -> float:
        """From the first generated token (the prefill's) to the last."""
        return self.times[-1] - self.times[1] if len(self.times) > 1 else 0.0

    def end(self) -> None:
        pass

    @property
    def acceptance_lengths(self) -> list[int]:
        # puts[0]: the prompt; puts[1]: the prefill's token; then one entry per iteration, a
        # DFlash cycle unless it began with a single token of budget left (no draft then).
        lengths, generated = [], sum(self.puts[1:2])
        for count in self.puts[2:]:
            if self.max_new_tokens - generated > 1:
                lengths.append(count)
            generated += count
        return lengths


@dataclass
class HFDFlashResult:
    token_ids: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)
    decode_seconds: float = 0.0

    @property
    def tau(self) -> float:
        lengths = self.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else 1.0


def hf_dflash_generate(model: Any, assistant: Any, prompt_ids: Sequence[int], max_new_tokens: int,
                       stop_ids: Sequence[int] = (), temperature: float = 0.0) -> HFDFlashResult:
    """transformers' DFlash generation after ``prompt_ids`` (batch 1), with its acceptance lengths."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt_ids)], device=device)
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens, "attention_mask": torch.ones_like(input_ids),
        "eos_token_id": list(stop_ids) or None, "pad_token_id": stop_ids[0] if stop_ids else None,
    }
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    counter = CycleCounter(max_new_tokens)
    with torch.inference_mode():
        out = model.generate(input_ids, assistant_model=assistant, speculation_type="dflash", streamer=counter, **kwargs)
    return HFDFlashResult(out[0, input_ids.shape[1]:].tolist(), counter.acceptance_lengths, counter.decode_seconds)
