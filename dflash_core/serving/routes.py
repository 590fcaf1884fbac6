"""The HTTP side: OpenAI's routes on a FastAPI ``APIRouter``, mountable on the studio's Gradio app
or served alone (``build_app``).

* Requests take turns on each pair's engine (the engine runs one generation at a time): an
  ``asyncio.Lock`` per pair orders them without holding a worker thread per waiting request, and
  the engine's own lock orders them against the studio's UI. At most ``DFLASH_QUEUE_SIZE``
  (default 64) wait; more are answered 429.
* A client that goes away frees the engine within one cycle: a stream's task is cancelled by
  Starlette when the client disconnects (the cycle in progress finishes in its thread, then the
  engine's generator is closed); a non-streamed request polls for the disconnect and asks the
  engine to stop at its next cycle.
* ``DFLASH_API_KEY``, when set, must come as ``Authorization: Bearer <key>`` (401 otherwise).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import sys
import time
import traceback
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

import anyio
from fastapi import APIRouter, FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import compute
from ..engine import Engine
from ..errors import DFlashError
from ..loading import device_problem
from ..prompting import env_int
from ..registry import Registry
from ..request import Resolved
from . import protocol
from .generation import Generation
from .protocol import ApiError

DISCONNECT_POLL_S = 0.2  # how often a non-streamed request checks that its client is still there


class EngineSource(Protocol):
    """Where engines come from: the studio's ``StudioService`` (loads each pair once, shared with
    the UI)."""

    registry: Registry

    def engine(self, name: str | None, progress: Callable[[str], None] | None = None) -> Engine: ...


class _Turns:
    """Per-pair turns on the engine, with a bound on how many requests may wait."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.waiting = 0
        self._locks: dict[str, asyncio.Lock] = {}

    def reserve(self, name: str) -> Callable[[], Any]:
        """A place in the queue (refused at once when the queue is full); enter the returned
        context manager to wait for the turn. A place is counted only while it is waited in, so a
        response that never starts (its client gone) holds none."""
        if self.waiting >= self.size:
            raise ApiError(429, f"{self.waiting} requests are already waiting for the engine (DFLASH_QUEUE_SIZE = "
                                f"{self.size}); retry later", code="queue_full", kind="rate_limit_error")
        lock = self._locks.setdefault(name, asyncio.Lock())

        @asynccontextmanager
        async def turn() -> AsyncIterator[None]:
            self.waiting += 1
            try:
                await lock.acquire()
            finally:
                self.waiting -= 1
            try:
                yield
            finally:
                lock.release()

        return turn


class _ClosingStream(StreamingResponse):
    """Closes its body generator once the response ends, however it ends: a client that went away
    while the generator sat at a ``yield`` would otherwise leave it (and the engine it holds)
    waiting for the garbage collector."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _server_error(exc: BaseException) -> ApiError:
    traceback.print_exception(exc, file=sys.stderr)
    return ApiError(500, f"the server failed while generating: {type(exc).__name__}: {exc}", kind="server_error")


def build_router(service: EngineSource, api_key: str | None = None, queue_size: int | None = None) -> APIRouter:
    """OpenAI's routes under ``/v1``. ``api_key`` None reads ``DFLASH_API_KEY`` ("" turns the check off)."""
    key = os.environ.get("DFLASH_API_KEY", "") if api_key is None else api_key
    turns = _Turns(queue_size if queue_size is not None else env_int("DFLASH_QUEUE_SIZE", 64))
    started = int(time.time())
    router = APIRouter(prefix="/v1")

    def authorize(http: HttpRequest) -> None:
        if not key:
            return
        sent = http.headers.get("authorization", "")
        scheme, _, token = sent.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send the key set in DFLASH_API_KEY as "
                                "'Authorization: Bearer <key>'", code="invalid_api_key")

    def model_card(name: str) -> dict[str, Any]:
        pair = service.registry.pairs[name]
        problem = device_problem(pair)
        return {"id": name, "object": "model", "created": started, "owned_by": "dflash-studio",
                "description": pair.description, "target": pair.target.describe(), "drafter": pair.drafter.describe(),
                "available": problem is None, "unavailable_reason": problem,
                # the studio's loading progress ("not loaded", "ready (loaded in 6.1 s)", ...)
                "status": getattr(service, "status", {}).get(name, "not loaded")}

    def check_model(name: str) -> None:
        if name not in service.registry.pairs:
            raise ApiError(404, f"unknown pair {name!r}; known pairs: {', '.join(sorted(service.registry.pairs))}",
                           param="model", code="model_not_found")

    async def answer(http: HttpRequest, handler: Callable[[], Awaitable[Response]]) -> Response:
        try:
            authorize(http)
            return await handler()
        except ApiError as exc:
            return _error(exc)
        except DFlashError as exc:
            return _error(ApiError.from_dflash(exc))
        except Exception as exc:  # the server keeps serving; the client learns what failed
            return _error(_server_error(exc))

    @router.get("/models")
    async def list_models(http: HttpRequest) -> Response:
        async def handler() -> Response:
            return JSONResponse({"object": "list", "data": [model_card(n) for n in service.registry.pairs]})

        return await answer(http, handler)

    @router.get("/models/{name:path}")
    async def get_model(http: HttpRequest, name: str) -> Response:
        async def handler() -> Response:
            check_model(name)
            return JSONResponse(model_card(name))

        return await answer(http, handler)

    async def completion(http: HttpRequest, kind: str) -> Response:
        async def handler() -> Response:
            try:
                body = await http.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
            request = protocol.parse(body, kind)
            check_model(request.model)
            # Loading a pair the first time takes seconds; tokenising is quick but blocking too.
            engine = await anyio.to_thread.run_sync(service.engine, request.model)
            resolved = await anyio.to_thread.run_sync(engine.resolve, request.generation)
            turn = turns.reserve(request.model)
            if request.stream:
                return _ClosingStream(_stream(engine, resolved, request, turn), media_type="text/event-stream",
                                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return await _whole(http, engine, resolved, request, turn)

        return await answer(http, handler)

    @router.post("/chat/completions")
    async def chat_completions(http: HttpRequest) -> Response:
        return await completion(http, "chat")

    @router.post("/completions")
    async def completions(http: HttpRequest) -> Response:
        return await completion(http, "completion")

    return router


async def _whole(http: HttpRequest, engine: Engine, resolved: Resolved, request: protocol.Request,
                 turn: Callable[[], Any]) -> Response:
    """A non-streamed answer: all cycles in a worker thread, stopped early if the client leaves."""
    async with turn():
        generation = Generation(engine, resolved, request)

        async def watch() -> None:
            while not await http.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            generation.cancel.set()

        watcher = asyncio.create_task(watch())
        try:
            text = await anyio.to_thread.run_sync(compute.call, generation.run)
        finally:
            watcher.cancel()
            generation.close()
    rid = protocol.new_id(request.kind)
    return JSONResponse(protocol.response(request, rid, text, generation.finish_reason or "stop", generation.usage()))


async def _stream(engine: Engine, resolved: Resolved, request: protocol.Request,
                  turn: Callable[[], Any]) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk shape, ending with ``data: [DONE]``. An error after
    the response has begun goes out as one ``data: {"error": ...}`` event (the client raises it)."""
    rid, created = protocol.new_id(request.kind), int(time.time())
    generation: Generation | None = None
    try:
        async with turn():
            generation = Generation(engine, resolved, request)
            first = request.kind == "chat"
            if first:
                yield _sse(protocol.chunk(request, rid, created, "", first=True))
            while generation.finish_reason is None:
                # A cancellation (the client left) waits for this cycle to finish in its thread,
                # then lands here: the ``finally`` below frees the engine.
                delta = await anyio.to_thread.run_sync(compute.call, generation.step)
                if delta:
                    yield _sse(protocol.chunk(request, rid, created, delta))
            yield _sse(protocol.chunk(request, rid, created, None, generation.finish_reason))
            if request.include_usage:
                yield _sse(protocol.usage_chunk(request, rid, created, generation.usage()))
    except DFlashError as exc:
        yield _sse(ApiError.from_dflash(exc).body())
    except Exception as exc:
        yield _sse(_server_error(exc).body())
    finally:
        if generation is not None:
            generation.close()
    yield "data: [DONE]\n\n"


def build_app(service: EngineSource, api_key: str | None = None) -> FastAPI:
    """The API alone (``python -m dflash_core serve``): the routes plus OpenAI-shaped answers for
    unknown paths and methods."""
    app = FastAPI(title="DFlash OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(build_router(service, api_key))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        return _error(ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code)))

    return app
