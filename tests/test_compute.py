"""Model work runs on the one compute thread (dflash_core.compute), whoever asks for it."""

from __future__ import annotations

import threading

import pytest

from app.live import BackgroundRun, batches
from dflash_core import compute


def compute_ident() -> int:
    return compute.call(threading.get_ident)


def test_calls_from_any_thread_run_on_one_compute_thread_and_raise_there_errors_here():
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(compute.call(threading.get_ident))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(seen) == {compute_ident()} and compute_ident() != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        compute.call(lambda: 1 / 0)
    # A call made from the compute thread runs inline (no deadlock waiting for itself).
    assert compute.call(lambda: compute.call(threading.get_ident)) == compute_ident()


class RecordingEngine:
    """What BackgroundRun asks of an engine, recording the thread each cycle is computed on."""

    def __init__(self, cycles: int) -> None:
        self.cycles, self.threads = cycles, []

    def stream_ids(self, prompt_ids, config, should_stop=None):  # noqa: ANN001, ANN201
        for i in range(self.cycles):
            self.threads.append(threading.get_ident())
            yield i


def test_a_background_run_computes_its_cycles_on_the_compute_thread():
    engine = RecordingEngine(cycles=6)
    run = BackgroundRun(engine, [1, 2, 3], config=None)
    events = [event for batch in batches(run, per_s=100) for _, event in batch]
    assert events == list(range(6))
    assert set(engine.threads) == {compute_ident()}
