"""One thread for all model work in a multi-threaded process (the studio, the API server).

PyTorch's CPU kernels run on OpenMP, and libgomp keeps a pool of worker threads for every thread
that has run a parallel region, for as long as that thread lives. Once it manages more threads
than the machine has cores, it stops spinning between parallel regions and puts its workers to
sleep instead, so every small op of a decoding step waits for them to wake. A server's handler
threads live long: the first model call from each would add a pool and slow every later step,
whichever thread runs it (docs/BENCHMARKS.md has the measurement). Running every model call here
keeps one pool, as a command-line run in its main thread has.

``call`` runs a function on the compute thread and returns its result; ``iterate`` drives a
generator there one item at a time. Both run inline when already on the compute thread, so code
that calls the engine needs no care about where it is called from.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")

_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-compute")
_ident: list[int] = []


def _remember_thread() -> None:
    _ident.append(threading.get_ident())


_executor.submit(_remember_thread).result()


def on_compute_thread() -> bool:
    return threading.get_ident() == _ident[0]


def submit(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future:
    """Queue ``fn(*args, **kwargs)`` on the compute thread; its ``Future``."""
    return _executor.submit(fn, *args, **kwargs)


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the compute thread (after what is queued there): its result,
    or its exception raised here."""
    if on_compute_thread():
        return fn(*args, **kwargs)
    return _executor.submit(fn, *args, **kwargs).result()


_DONE = object()


def iterate(items: Iterator[T]) -> Iterator[T]:
    """``items``, each ``next`` computed on the compute thread; closing this closes ``items``
    there (a generator's cleanup may free the engine)."""
    try:
        while True:
            item = call(next, items, _DONE)
            if item is _DONE:
                return
            yield item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            call(close)
