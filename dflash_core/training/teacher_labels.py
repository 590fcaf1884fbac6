"""Drafter labels from one target pass over existing text (teacher forcing), and which are exact.

The drafter learns the target's *greedy* continuation: for an anchor at position ``p``, slot
``k`` must predict the token the target would emit ``k`` steps after ``p``. Generated answers
give every slot an exact label, at one decode step per token. One forward pass over text that
already exists (a package's real code, a person's real reply) gives the target's argmax after
every position at once, at a prefill's price, and the same pass gives the hidden states the
features stage needs anyway. But the label for slot ``k > 1`` is the target's choice after the
*text's* tokens ``p+1..p+k-1``; it is the target's own continuation only where the text agreed
with the target's argmax at each of those positions. Past the first disagreement the target
would have left the text, so those slots have no exact label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch


def greedy_after_each_position(runner: Any, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """For each sequence, the target's argmax after each of its prefixes, all from one pass.

    Where the runner can stack sequences for its matrix products (``FastTarget.stacked_features``,
    the features stage's pass) they go through together, and the last layer's residual stream
    meets the LM head one sequence at a time (a whole stack's logits would be rows x 49k);
    otherwise each sequence takes a cached forward of its own."""
    tokens = [torch.tensor(list(ids), dtype=torch.long) for ids in sequences]
    stack = None if getattr(runner, "compiled_layers", True) else getattr(runner, "stacked_features", None)
    with torch.inference_mode():
        if stack is not None:
            finals = stack(tokens, [len(runner.layers) - 1])
            return [runner.logits(x).argmax(dim=-1).cpu().numpy() for x in finals]
        out = []
        for ids in tokens:
            runner.reset(ids.shape[0])
            out.append(runner.forward(ids, None).logits.argmax(dim=-1).cpu().numpy())
        return out


def exact_label_counts(ids: Sequence[int], greedy: Sequence[int], first_anchor: int, slots: int) -> np.ndarray:
    """For each anchor ``p`` in ``first_anchor..len(ids)-1``: how many of its slots ``1..slots``
    have an exact label.

    ``greedy[i]`` is the target's argmax after ``ids[:i+1]``. Slot 1's label ``greedy[p]`` is
    always exact; slot ``k`` needs ``ids[p+j] == greedy[p+j-1]`` for ``j = 1..k-1``, and a label
    at all (``p+k-1 <= len(ids)-1``)."""
    ids, greedy = np.asarray(ids), np.asarray(greedy)
    n = len(ids)
    if len(greedy) != n:
        raise ValueError(f"greedy has {len(greedy)} entries for {n} tokens")
    # agree[i]: the text's next token is the target's choice after position i.
    agree = np.zeros(n, dtype=bool)
    agree[:-1] = ids[1:] == greedy[:-1]
    # Index of the first disagreement at or after i; the last position, with no next token, counts
    # as one, which also keeps every label inside the text.
    positions = np.where(~agree, np.arange(n), n)
    next_miss = np.minimum.accumulate(positions[::-1])[::-1]
    anchors = np.arange(first_anchor, n)
    run = next_miss[anchors] - anchors  # consecutive agreements starting at the anchor
    return np.minimum(1 + run, slots)


@dataclass
class LabelTally:
    """Exact labels by slot over many texts, and what the passes that gave them cost."""

    slots: int
    anchors: int = 0
    text_tokens: int = 0  # tokens the passes ran over (prompts included)
    agreements: int = 0  # answer positions whose next token was the target's argmax
    comparisons: int = 0  # answer positions that have a next token
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.by_slot = np.zeros(self.slots, dtype=np.int64)

    def add(self, ids: Sequence[int], greedy: Sequence[int], first_anchor: int, seconds: float) -> None:
        counts = exact_label_counts(ids, greedy, first_anchor, self.slots)
        self.by_slot += np.array([(counts >= k).sum() for k in range(1, self.slots + 1)])
        self.anchors += len(counts)
        self.text_tokens += len(ids)
        answer = np.asarray(ids)[first_anchor:]
        self.agreements += int((answer[1:] == np.asarray(greedy)[first_anchor:-1]).sum())
        self.comparisons += max(len(answer) - 1, 0)
        self.seconds += seconds

    def summary(self) -> dict[str, Any]:
        exact = self.by_slot / max(self.anchors, 1)
        per_s = self.anchors / self.seconds if self.seconds else 0.0
        return {
            "anchors": self.anchors, "text_tokens": self.text_tokens, "seconds": round(self.seconds, 2),
            "text_tokens_per_s": round(self.text_tokens / self.seconds, 1) if self.seconds else None,
            "next_token_agreement": round(self.agreements / max(self.comparisons, 1), 4),
            "exact_fraction_by_slot": [round(float(f), 4) for f in exact],
            "exact_labels_per_anchor": round(float(self.by_slot.sum()) / max(self.anchors, 1), 3),
            "exact_labels_per_s_by_slot": [round(float(f) * per_s, 1) for f in exact],
        }
