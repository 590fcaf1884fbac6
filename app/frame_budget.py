"""Animation frames for a page nobody is touching: a few a second, not sixty.

Why: Gradio 6's page keeps ``requestAnimationFrame`` loops running for as long as it is open, even
with nothing on it moving (the loading screen's status-tracker timer and spinner outlive the
loading screen). Each frame they ask for is work for the browser, and on a 2-core machine that
browser shares the cores the engine is timed on: the studio's page, idle, cost Chromium a tenth of
a core (``scripts/studio_bench.py``, "browser idle"; docs/BENCHMARKS.md).

The script below hands frame callbacks over at most ``IDLE_FRAMES_PER_S`` times a second, all at
once, while the user is not interacting; for ``ACTIVE_S`` after any pointer, key, wheel, touch or
text input it gets out of the way, so dragging a slider or hovering a chart runs at the display's rate.
Gradio's status-tracker timers stay on the budget even then: clicking Generate (or moving the
mouse during a run) would otherwise run them every frame beside the engine.
Live updates do not use frames (app/live.py's script appends as messages arrive), so a run shows
the same tokens, counters and log at the same moments.

It must run before Gradio's modules load, which keep their own reference to
``requestAnimationFrame``; Gradio adds ``launch(head=...)`` only after the app has loaded, so the
script is put at the top of the page's ``<head>`` as the page is served (``serve_page_with_frame_budget``).
"""

from __future__ import annotations

import os
from typing import Any, Awaitable, Callable

# A few a second, as the live updates (app/live.py); what the page costs idle at this rate, and
# unbudgeted, is in docs/BENCHMARKS.md. DFLASH_UI_IDLE_FRAMES_PER_S=0 leaves the frames unbudgeted.
IDLE_FRAMES_PER_S = float(os.environ.get("DFLASH_UI_IDLE_FRAMES_PER_S", "4"))
ACTIVE_S = 2.0

FRAME_BUDGET_JS = """
(() => {
  const nativeFrame = window.requestAnimationFrame.bind(window);
  const nativeCancel = window.cancelAnimationFrame.bind(window);
  const idleInterval = 1000 / %(fps)s, activeMs = %(active_ms)s;
  let lastInput = -Infinity, waiting = new Map(), nextId = -1, timer = null;
  const touched = () => { lastInput = performance.now(); };
  // Not 'scroll': the live updates scroll the panes themselves; a user scrolls with these.
  for (const kind of ['pointerdown', 'pointermove', 'keydown', 'wheel', 'touchstart', 'input'])
    window.addEventListener(kind, touched, {capture: true, passive: true});
  const throttled = () => performance.now() - lastInput >= activeMs;
  // Gradio's status trackers count a run's seconds in a frame loop, one per tracked output and one
  // left over from the loading screen that never ends: a tenth of a second's precision needs no
  // sixty frames a second, input or not (each of their frames is a Svelte flush of milliseconds).
  const trackerTimer = () => (new Error().stack || '').includes('statustracker');
  const release = () => {
    timer = null;
    const due = waiting; waiting = new Map();
    // Each callback on its own, as the browser's own frames run them: one that throws stops no other.
    nativeFrame((time) => due.forEach((callback) => {
      try { callback(time); } catch (error) { setTimeout(() => { throw error; }); }
    }));
  };
  window.requestAnimationFrame = (callback) => {
    if (!throttled() && !trackerTimer()) return nativeFrame(callback);
    const id = nextId--;  // negative: never one of the browser's own ids
    waiting.set(id, callback);
    if (timer === null) timer = setTimeout(release, idleInterval);
    return id;
  };
  window.cancelAnimationFrame = (id) => { if (id < 0) waiting.delete(id); else nativeCancel(id); };
  window.dfsFrameBudget = {throttled, framesPerS: %(fps)s};
})();
"""


def frame_budget_script() -> str:
    """The ``<script>`` element that budgets the page's animation frames."""
    body = FRAME_BUDGET_JS % {"fps": IDLE_FRAMES_PER_S, "active_ms": int(ACTIVE_S * 1000)}
    return f"<script>{body}</script>"


ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class _HeadFirst:
    """An ASGI app that serves ``inner``'s HTML with ``snippet`` first in its ``<head>``."""

    def __init__(self, inner: ASGIApp, snippet: bytes) -> None:
        self.inner = inner
        self.snippet = snippet

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "GET":
            await self.inner(scope, receive, send)
            return
        start: dict | None = None
        chunks: list[bytes] = []

        async def patched(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            if message["type"] != "http.response.body" or start is None:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = b"".join(chunks)
            headers = list(start.get("headers", []))
            is_html = any(k.lower() == b"content-type" and v.startswith(b"text/html") for k, v in headers)
            if is_html and b"<head>" in body:
                body = body.replace(b"<head>", b"<head>" + self.snippet, 1)
                headers = [(k, str(len(body)).encode() if k.lower() == b"content-length" else v) for k, v in headers]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.inner(scope, receive, patched)


def serve_page_with_frame_budget(server_app: Any, path: str = "/") -> bool:
    """Serve the page at ``path`` of ``server_app`` (Gradio's FastAPI app) with the frame budget's
    script first in its ``<head>``; whether that page's route was found (a Gradio that serves its
    page elsewhere is left as it is)."""
    snippet = frame_budget_script().encode()
    for route in getattr(server_app.router, "routes", []):
        if getattr(route, "path", None) == path and "GET" in (getattr(route, "methods", None) or ()):
            if not isinstance(route.app, _HeadFirst):
                route.app = _HeadFirst(route.app, snippet)
            return True
    return False
