"""OpenAI's request and response shapes, checked by hand so that every mistake in a request gets
OpenAI's error shape and the engine's own message (the one the CLI prints).

Supported: ``model`` (a registry pair), ``messages`` / ``prompt``, ``max_tokens`` (or
``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``, ``n`` = 1. DFlash extras, sent as extra body fields:
``block_size``, ``variant`` (a name in ``request.VARIANTS``; the "dflash_" prefix may be left
out), ``rule``, ``top_k`` and ``thinking``. Parameters that would change the output distribution
in ways the engine cannot honour (penalties, logit bias, several choices, log-probabilities,
tools) are refused rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..errors import DFlashError
from ..request import Request as GenerationRequest
from ..request import variant as named_variant

# OpenAI's own default when a request names no temperature (the CLI's default is greedy).
DEFAULT_TEMPERATURE = 1.0
MAX_STOPS = 4  # as OpenAI
ROLES = ("system", "developer", "user", "assistant")


class ApiError(Exception):
    """An error answered in OpenAI's shape ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    @classmethod
    def from_dflash(cls, exc: DFlashError, param: str | None = None) -> "ApiError":
        return cls(400, str(exc), param=param or _param_of(str(exc)))


def _param_of(message: str) -> str | None:
    """The request field a ``SettingsError`` message is about ("top_p = 2.0; allowed: ...")."""
    names = {"max_new_tokens": "max_tokens", "block_size": "block_size", "temperature": "temperature",
             "top_p": "top_p", "top_k": "top_k", "seed": "seed", "rule": "rule", "tree": "variant",
             "lookup": "variant", "adaptive": "variant", "variant": "variant"}
    head = message.split(" ", 1)[0]
    return names.get(head)


@dataclass
class Request:
    """A checked request: what to generate (``generation``, resolved by ``Engine.resolve``) and
    how to answer."""

    kind: str  # "chat" | "completion"
    model: str
    generation: GenerationRequest
    stops: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{name} = {value!r}; allowed: a number", param=name)
    return value


def _integer(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} = {value!r}; allowed: an integer", param=name)
    return value


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if body.get("n", 1) != 1:
        raise ApiError(400, f"n = {body['n']!r}; allowed: 1 (the engine generates one answer at a time)", param="n")
    if body.get("best_of", 1) not in (1, None):
        raise ApiError(400, f"best_of = {body['best_of']!r}; allowed: 1", param="best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} = {body[name]!r}; allowed: 0 (penalties would change the target's "
                                f"distribution, which DFlash reproduces exactly)", param=name)
    if body.get("logit_bias"):
        raise ApiError(400, "logit_bias is not supported; leave it out", param="logit_bias")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs"):
        raise ApiError(400, "logprobs are not supported; leave them out", param="logprobs")
    if body.get("tools") or body.get("functions"):
        raise ApiError(400, "tools and functions are not supported; leave them out", param="tools")
    if body.get("echo"):
        raise ApiError(400, "echo is not supported; leave it out", param="echo")
    if body.get("suffix"):
        raise ApiError(400, "suffix is not supported; leave it out", param="suffix")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported", param="response_format")


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop = {value!r}; allowed: a non-empty string or a list of up to {MAX_STOPS} of them",
                       param="stop")
    return list(stops)


def _content(message: Any, index: int) -> tuple[str, str]:
    """(role, text) of one chat message; text parts of a content list are joined."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ApiError(400, f"{where} must be an object with 'role' and 'content'", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role = {role!r}; allowed: {', '.join(ROLES)}", param=f"{where}.role")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(400, f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                    f"supported", param=f"{where}.content")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    # "developer" is OpenAI's newer name for the system message; chat templates know "system".
    return ("system" if role == "developer" else role), content


def parse(body: Any, kind: str) -> Request:
    """A ``Request`` from a decoded JSON body, or an ``ApiError`` naming the faulty field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: the name of a registry pair (GET /v1/models lists them)", param="model")
    _refuse_unsupported(body)
    messages, prompt = None, None
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
        messages = [dict(zip(("role", "content"), _content(m, i))) for i, m in enumerate(messages)]
        if not any(m["role"] == "user" for m in messages):
            raise ApiError(400, "messages hold no user message", param="messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # clients may send a batch of one
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string (one prompt per request)", param="prompt")
    max_tokens = _integer(body, "max_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_completion_tokens")
    try:
        variant = named_variant(body.get("variant", "dflash")).name
    except DFlashError as exc:
        raise ApiError.from_dflash(exc, "variant") from None
    thinking = body.get("thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise ApiError(400, f"thinking = {thinking!r}; allowed: true, false or leave it out", param="thinking")
    if thinking is not None and kind != "chat":
        raise ApiError(400, "thinking applies to chat messages only; leave it out of /v1/completions", param="thinking")
    generation = GenerationRequest(
        prompt=prompt, messages=messages, raw=kind != "chat", thinking=thinking, variant=variant,
        max_new_tokens=max_tokens,  # None: as many as the context leaves (OpenAI's meaning)
        block_size=_integer(body, "block_size"),
        temperature=_number(body, "temperature", DEFAULT_TEMPERATURE),
        top_p=_number(body, "top_p", 1.0),
        top_k=_integer(body, "top_k") or 0,
        seed=_integer(body, "seed"),
        rule=body.get("rule", "match"),
    )
    stops = _stops(body.get("stop"))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream = {stream!r}; allowed: true or false", param="stream")
    options = body.get("stream_options") or {}
    return Request(kind=kind, model=model, generation=generation, stops=stops, stream=stream,
                   include_usage=bool(isinstance(options, dict) and options.get("include_usage")))


# ------------------------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def _envelope(request: Request, rid: str, created: int, chunk: bool) -> dict[str, Any]:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if request.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": request.model, "system_fingerprint": None}


def response(request: Request, rid: str, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
    """The whole answer (``stream`` false)."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if request.kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {**_envelope(request, rid, int(time.time()), chunk=False), "choices": [choice], "usage": usage}


def chunk(request: Request, rid: str, created: int, text: str | None, finish_reason: str | None = None,
          first: bool = False) -> dict[str, Any]:
    """One streamed piece: new text, or (``text`` None) the closing piece with the finish reason."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if request.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {**_envelope(request, rid, created, chunk=True), "choices": [choice]}


def usage_chunk(request: Request, rid: str, created: int, usage: dict[str, Any]) -> dict[str, Any]:
    """The last streamed piece when ``stream_options.include_usage`` is set (no choices, as OpenAI)."""
    return {**_envelope(request, rid, created, chunk=True), "choices": [], "usage": usage}
