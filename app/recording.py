"""Turning the engine's event stream into what the studio shows: tokens with their origin,
cycle records, running counters. No Gradio here, so it is testable on its own."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from dflash_core.speculative import CycleEvent


class IncrementalDetokenizer:
    """Each new token's text, without decoding the whole output again (which made a run's
    rendering quadratic in its length).

    Decodes a short window: the tokens since the last point where the text was complete, so
    that tokenizers that merge a space or a multi-byte character across tokens give the same
    text as decoding everything at once. A token that ends in the middle of a character yields
    "" and the next one carries the whole character."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start: the text before it is final
        self._read = 0  # tokens whose text has been given out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            piece = after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += piece
            return piece
        return ""


@dataclass
class TokenView:
    text: str
    kind: str  # "accepted" (a drafted token the target kept) | "target" (the target's own token)
    cycle: int
    confidence: float | None  # drafter probability, for accepted drafts
    special: bool = False


@dataclass
class CycleRecord:
    index: int
    drafted: list[str]
    confidence: list[float]
    num_accepted: int
    bonus: str
    target_choices: list[str]
    committed: int
    draft_s: float
    verify_s: float
    at_s: float  # wall-clock time since the run started when the cycle ended
    tokens_so_far: int
    tree_nodes: int = 0  # drafts verified as a tree (``drafted`` is one path through them); 0: a chain
    lookup_nodes: int = 0  # verified drafts that prompt lookup proposed
    lookup_only: bool = False  # the drafter did not run this cycle (lookup's guesses alone)
    lookup_drafted: int = 0  # the first this many of ``drafted`` were guessed by a lookup
    answer_nodes: int = 0  # verified drafts guessed from the model's earlier answers


@dataclass
class RunRecord:
    """One generation as the UI sees it (DFlash or the autoregressive baseline)."""

    mode: str
    tokens: list[TokenView] = field(default_factory=list)
    cycles: list[CycleRecord] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (seconds, tokens so far)
    started: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    elapsed_s: float = 0.0
    finish_reason: str | None = None
    _detokenizer: IncrementalDetokenizer | None = None

    @property
    def text(self) -> str:
        return self._detokenizer.text if self._detokenizer else ""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tau(self) -> float | None:
        lengths = [c.num_accepted + 1 for c in self.cycles if c.drafted]
        return sum(lengths) / len(lengths) if lengths else None

    @property
    def decode_s(self) -> float:
        """Time after the first token (what tokens/s is measured over)."""
        return max(0.0, self.elapsed_s - (self.first_token_s or 0.0))

    @property
    def tokens_per_s(self) -> float | None:
        # Tokens after the first over the time after the first: prefill excluded, as in
        # z-lab's benchmark, so DFlash and AR are compared on decoding alone.
        if self.num_tokens < 2 or self.decode_s <= 0:
            return None
        return (self.num_tokens - 1) / self.decode_s

    @property
    def mean_draft_s(self) -> float:
        drafted = [c.draft_s for c in self.cycles if c.drafted]
        return sum(drafted) / len(drafted) if drafted else 0.0

    @property
    def mean_verify_s(self) -> float:
        return sum(c.verify_s for c in self.cycles) / len(self.cycles) if self.cycles else 0.0

    def add(self, event: CycleEvent, tokenizer: Any, at: float | None = None) -> None:
        """Record one event; ``at`` is the ``time.perf_counter()`` at which the engine produced it
        (default: now), so that the run's timer is the engine's whatever the consumer's delay."""
        now = (time.perf_counter() if at is None else at) - self.started
        if event.is_prefill:
            self.first_token_s = now
        if self._detokenizer is None:
            self._detokenizer = IncrementalDetokenizer(tokenizer)
        ids = event.committed
        confidences = event.draft_confidence
        for i, tok in enumerate(ids):
            self.token_ids.append(tok)
            piece = self._detokenizer.push(tok)
            accepted = i < event.num_accepted and not event.is_prefill
            special = tok in getattr(tokenizer, "all_special_ids", ())
            self.tokens.append(TokenView(piece, "accepted" if accepted else "target", event.index,
                                         confidences[i] if accepted and i < len(confidences) else None, special))
        if not event.is_prefill and event.finish_reason != "cancelled":
            convert = lambda xs: [tokenizer.decode([x], skip_special_tokens=False) for x in xs]  # noqa: E731
            self.cycles.append(CycleRecord(
                index=event.index, drafted=convert(event.drafted), confidence=list(event.draft_confidence),
                num_accepted=event.num_accepted, bonus=convert([event.bonus])[0],
                target_choices=convert(event.target_choices), committed=len(ids), draft_s=event.draft_s,
                verify_s=event.verify_s, at_s=now, tokens_so_far=event.tokens_so_far, tree_nodes=event.tree_nodes,
                lookup_nodes=event.lookup_nodes, lookup_only=event.lookup_only,
                lookup_drafted=event.lookup_drafted, answer_nodes=event.answer_nodes,
            ))
        self.timeline.append((now, self.num_tokens))
        self.elapsed_s = now
        if event.finish_reason:
            self.finish_reason = event.finish_reason
