"""Each browser session's run in progress, and its Stop.

A run (the Live tab's Generate, the Chat tab's Send, Regenerate and baseline) holds its session's
entry for as long as its generator runs; the Stop buttons of both tabs reach it. Stop waits for the
run to end before it answers, because its answer and the run's last update travel to the page on
different connections (Stop's is a plain request, beside the queue, so that it is answered while the
run holds the engine): a Stop that answered at once could land after the run's "stopped" and leave
the page saying "stopping" for good, which is what a loaded machine showed.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

# How long Stop waits for the run to end. A cycle on a CPU takes well under a second for the
# registry's small pairs; a run still going after this (a big model's slow cycle) is told to stop
# and Stop says so.
STOP_WAIT_S = 5.0
# How long Clear waits for a run that has said its last word to let its session go.
SETTLE_WAIT_S = 1.0


def session_of(request: Any) -> str:
    """The Gradio session a request comes from ("default" outside a browser, as in the tests)."""
    return getattr(request, "session_hash", None) or "default"


@dataclass
class _Run:
    stop: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)


class Sessions:
    """The runs in progress, one per session at most."""

    def __init__(self) -> None:
        self._runs: dict[str, _Run] = {}

    @contextmanager
    def run(self, request: Any) -> Iterator[threading.Event]:
        """Hold ``request``'s session while the body runs; yields the run's Stop event."""
        session, run = session_of(request), _Run()
        self._runs[session] = run
        try:
            yield run.stop
        finally:
            if self._runs.get(session) is run:  # a newer run of the session keeps its own entry
                del self._runs[session]
            run.ended.set()

    def idle(self) -> bool:
        """No run in progress in any session (nothing is kept once a run is over)."""
        return not self._runs

    def stop(self, request: Any, wait_s: float = STOP_WAIT_S) -> bool | None:
        """Ask the session's run to stop within its cycle and wait up to ``wait_s`` for it to end.
        True: it ended (its own last update says so); False: still ending; None: nothing ran."""
        run = self._runs.get(session_of(request))
        if run is None:
            return None
        run.stop.set()
        return run.ended.wait(wait_s)

    def settled(self, request: Any, wait_s: float = SETTLE_WAIT_S) -> bool:
        """Whether the session has no run, waiting up to ``wait_s`` for one to end. A run's last
        update ("done", "stopped") reaches the page a moment before the run lets its session go:
        what the page offers once it shows that update (Clear) must not find the run still there."""
        run = self._runs.get(session_of(request))
        return run is None or run.ended.wait(wait_s)
