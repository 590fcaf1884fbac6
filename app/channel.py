"""Live updates straight to the page, beside Gradio: one server-sent-event stream per run.

Why not Gradio's own messages: each one makes Gradio's frontend process a component update on
the two cores the engine is timed on; with four a second, the page showed 78-79% of the CLI's
autoregressive tokens/s (``scripts/studio_bench.py``, docs/BENCHMARKS.md). Here a handler publishes each update (a small JSON object: the new
token spans, cycle-log rows and counters) to a ``Channel``; the page's script opens
``GET /dfs/live/<key>`` as an ``EventSource`` and applies each message itself, without Gradio.

A channel's key is random (a run's text is only for the page that started it). Each message
carries its index as the event id, so a reconnecting ``EventSource`` resumes where it left off
instead of appending what it already has. The handler asks ``abandoned()`` to end a run whose
page has gone: a reader attached once and none has been attached for ``grace_s``.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from typing import AsyncIterator

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import StreamingResponse

PATH = "/dfs/live/"
KEEPALIVE_S = 1.0  # an idle stream sends a comment this often: a gone reader is noticed on send
CLOSED_KEPT_S = 60.0  # a closed channel stays readable this long (a late or reconnecting reader)


class Channel:
    """The updates of one run, in order; written from any thread, read by the SSE route."""

    def __init__(self, key: str, grace_s: float = 2.0) -> None:
        self.key = key
        self.url = PATH + key
        self.grace_s = grace_s
        self.messages: list[str] = []
        self.closed_at: float | None = None
        self._guard = threading.Lock()
        self._wakers: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._readers = 0
        self._ever_read = False
        self._last_left = 0.0

    # ------------------------------------------------------------------------ the writer side
    def publish(self, message: str) -> None:
        with self._guard:
            self.messages.append(message)
        self._wake()

    def close(self) -> None:
        with self._guard:
            self.closed_at = time.monotonic()
        self._wake()

    def _wake(self) -> None:
        """Wake the readers' streams (each waits in its own event loop)."""
        with self._guard:
            wakers = list(self._wakers)
        for loop, event in wakers:
            loop.call_soon_threadsafe(event.set)

    def abandoned(self) -> bool:
        """A reader came and went, and none has come back within ``grace_s``."""
        with self._guard:
            return self._ever_read and self._readers == 0 and time.monotonic() - self._last_left >= self.grace_s

    # ------------------------------------------------------------------------ the reader side
    def attach(self, waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None) -> None:
        with self._guard:
            self._readers += 1
            self._ever_read = True
            if waker is not None:
                self._wakers.add(waker)

    def detach(self, waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None) -> None:
        with self._guard:
            self._readers -= 1
            self._last_left = time.monotonic()
            self._wakers.discard(waker)

    def since(self, index: int) -> tuple[list[str], bool]:
        """The messages from ``index`` on, and whether the channel is closed (no more will come)."""
        with self._guard:
            return self.messages[index:], self.closed_at is not None

    async def stream(self, start: int = 0, is_disconnected=None) -> AsyncIterator[str]:  # noqa: ANN001
        """Server-sent events from message ``start`` on: ``id``/``data`` per message, a keep-alive
        comment when idle, an ``end`` event once the channel is closed and everything is sent."""
        loop = asyncio.get_running_loop()
        waker = (loop, asyncio.Event())
        self.attach(waker)
        try:
            sent = start
            while True:
                waker[1].clear()
                new, closed = self.since(sent)
                for offset, message in enumerate(new):
                    yield f"id: {sent + offset}\ndata: {message}\n\n"
                sent += len(new)
                if closed:
                    yield "event: end\ndata: {}\n\n"
                    return
                if is_disconnected is not None and await is_disconnected():
                    return
                try:
                    await asyncio.wait_for(waker[1].wait(), KEEPALIVE_S)
                except (TimeoutError, asyncio.TimeoutError):
                    yield ": keep-alive\n\n"
        finally:
            self.detach(waker)


class Channels:
    """The process's open channels, by key; closed ones are dropped ``CLOSED_KEPT_S`` later."""

    def __init__(self) -> None:
        self._channels: dict[str, Channel] = {}
        self._guard = threading.Lock()

    def open(self, grace_s: float = 2.0) -> Channel:
        channel = Channel(secrets.token_urlsafe(16), grace_s)
        now = time.monotonic()
        with self._guard:
            for key, old in list(self._channels.items()):
                if old.closed_at is not None and now - old.closed_at > CLOSED_KEPT_S:
                    del self._channels[key]
            self._channels[channel.key] = channel
        return channel

    def get(self, key: str) -> Channel | None:
        with self._guard:
            return self._channels.get(key)

    def __len__(self) -> int:
        with self._guard:
            return len(self._channels)


CHANNELS = Channels()


def build_router(channels: Channels = CHANNELS) -> APIRouter:
    """``GET /dfs/live/{key}``: a channel as a ``text/event-stream``; 404 for an unknown key."""
    router = APIRouter()

    @router.get(PATH + "{key}", include_in_schema=False)
    async def live(key: str, request: Request) -> StreamingResponse:
        channel = channels.get(key)
        if channel is None:
            raise HTTPException(status_code=404, detail="no such live run (it ended more than a minute ago, "
                                                        "or the key is wrong)")
        try:
            start = int(request.headers.get("last-event-id", "-1")) + 1
        except ValueError:
            start = 0
        return StreamingResponse(channel.stream(max(0, start), request.is_disconnected),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router
