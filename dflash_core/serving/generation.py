"""One request's generation on an engine: the engine's cycles turned into text cut at the stop
strings, and the usage figures (tokens and DFlash's own). The request itself is checked and
encoded by ``Engine.resolve``, as every front end's is.

Everything here is synchronous and runs in a worker thread; ``routes`` decides when.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..engine import Engine
from ..request import Resolved
from ..speculative import CycleEvent
from .protocol import Request
from .stops import StopCutter


class Generation:
    """The engine's cycles for one request, consumed one ``step`` at a time.

    The engine is held from the first ``step`` until the answer ends or ``close`` is called;
    ``cancel`` (set from any thread) makes the engine end at its next cycle.
    """

    def __init__(self, engine: Engine, resolved: Resolved, request: Request) -> None:
        self.engine = engine
        self.config = resolved.config
        self.variant = resolved.variant.name
        self.prompt_tokens = len(resolved.prompt_ids)
        self.cancel = threading.Event()
        self.cutter = StopCutter(request.stops)
        self.tokens: list[int] = []
        self.events: list[CycleEvent] = []
        self.finish_reason: str | None = None
        self._first_at = self._last_at = 0.0
        self._events = engine.stream_ids(resolved.prompt_ids, resolved.config, should_stop=self.cancel.is_set)

    @property
    def text(self) -> str:
        return self.cutter.sent

    def step(self) -> str:
        """Run one cycle and return the text it lets through (may be empty); sets
        ``finish_reason`` ("stop" | "length" | "cancelled") on the last one."""
        event = next(self._events)
        self._last_at = time.perf_counter()
        if not self.events:
            self._first_at = self._last_at
        self.events.append(event)
        self.tokens.extend(event.committed)
        ended = event.finish_reason is not None
        delta = self.cutter.feed(self.engine.decode(self.tokens), final=ended)
        if self.cutter.stopped:
            self.finish_reason = "stop"
            self.close()  # a stop string ends the answer: free the engine now
        elif ended:
            self.finish_reason = event.finish_reason
        return delta

    def run(self) -> str:
        """All the cycles (``stream`` false); the whole answer."""
        while self.finish_reason is None:
            self.step()
        return self.text

    def close(self) -> None:
        """Release the engine (never while ``step`` runs in another thread)."""
        self.cancel.set()
        self._events.close()

    def usage(self) -> dict[str, Any]:
        """OpenAI's token counts plus DFlash's figures under ``dflash``."""
        cycles = [e for e in self.events if not e.is_prefill]
        lengths = [e.accept_len for e in cycles if e.drafted]
        figures = {
            "variant": self.variant,
            "block_size": self.config.block_size,
            "cycles": len(cycles),  # target passes after the prompt's
            "tau": round(sum(lengths) / len(lengths), 4) if lengths else None,  # mean tokens per drafting cycle
            "prefill_s": round(self.events[0].verify_s, 6) if self.events else 0.0,
            "draft_s": round(sum(e.draft_s for e in cycles), 6),
            "verify_s": round(sum(e.verify_s for e in cycles), 6),
            "decode_s": round(self._last_at - self._first_at, 6),
        }
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens),
                "total_tokens": self.prompt_tokens + len(self.tokens), "dflash": figures}
