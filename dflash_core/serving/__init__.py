"""An OpenAI-compatible API on the engine: ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models`` (one model per registry pair).

``protocol`` checks requests and shapes answers, ``generation`` runs one request on an engine,
``stops`` cuts streamed text at stop strings, ``routes`` is the HTTP side (queueing, streaming,
disconnects, the API key).
"""

from .routes import build_app, build_router

__all__ = ["build_app", "build_router"]
