"""Turning the engine's event stream into what the studio shows: tokens with their origin,
cycle records, running counters. No Gradio here, so it is testable on its own."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from dflash_core.speculative import CycleEvent


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
    lookup_only: bool = False  # the drafter did not run this cycle (prompt lookup's guess alone)
    lookup_drafted: int = 0  # the first this many of ``drafted`` were guessed by prompt lookup


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
    _text: str = ""

    @property
    def text(self) -> str:
        return self._text

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

    def add(self, event: CycleEvent, tokenizer: Any) -> None:
        now = time.perf_counter() - self.started
        if event.is_prefill:
            self.first_token_s = now
        ids = event.committed
        confidences = event.draft_confidence
        for i, tok in enumerate(ids):
            self.token_ids.append(tok)
            full = tokenizer.decode(self.token_ids, skip_special_tokens=False)
            piece = full[len(self._text):] if full.startswith(self._text) else tokenizer.decode([tok], skip_special_tokens=False)
            self._text = full
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
                lookup_drafted=event.lookup_drafted,
            ))
        self.timeline.append((now, self.num_tokens))
        self.elapsed_s = now
        if event.finish_reason:
            self.finish_reason = event.finish_reason

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "tokens": self.num_tokens,
            "cycles": len(self.cycles),
            "tau": None if self.tau is None else round(self.tau, 3),
            "tokens_per_s": None if self.tokens_per_s is None else round(self.tokens_per_s, 2),
            "elapsed_s": round(self.elapsed_s, 3),
            "finish_reason": self.finish_reason,
        }
