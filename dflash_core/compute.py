"""One thread for all model work in a multi-threaded process (the studio, the API server).

PyTorch's CPU kernels run on OpenMP, and libgomp keeps a pool of worker threads for every thread
that has run a parallel region, for as long as that thread lives. Once it manages more threads
than the machine has cores, it stops spinning between parallel regions and puts its workers to
sleep instead, so every small op of a decoding step waits for them to wake. A server's handler
threads live long: the first model call from each would add a pool and slow every later step,
whichever thread runs it (docs/BENCHMARKS.md has the measurement). Running every model call here
keeps one pool, as a command-line run in its main thread has.

``call`` runs a function on the compute thread and returns its result (inline when already
there); ``submit`` queues one without waiting.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-compute")
_compute_thread = _executor.submit(threading.get_ident).result()


def on_compute_thread() -> bool:
    return threading.get_ident() == _compute_thread


def submit(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future:
    """Queue ``fn(*args, **kwargs)`` on the compute thread; its ``Future``."""
    return _executor.submit(fn, *args, **kwargs)


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the compute thread (after what is queued there): its result,
    or its exception raised here."""
    if on_compute_thread():
        return fn(*args, **kwargs)
    return _executor.submit(fn, *args, **kwargs).result()

