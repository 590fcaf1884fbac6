"""A generation running beside the page: the engine on the compute thread at full speed, its
events timestamped as they come, and the page fed at a bounded rate with only what is new.

Why a thread: rendering, serialising and sending updates (and the browser laying them out) share
the CPU with the engine. When the engine waited for every update to be rendered, the studio
showed a fraction of the engine's speed, and a different fraction for DFlash (one update per
cycle) than for the baseline (one per token). Here the engine never waits for the page: the page
takes whatever has accumulated, at most ``UPDATES_PER_S`` times a second, and each run's timer is
the engine's own (event timestamps taken in the engine's thread). The pages' updates travel on a
channel of their own (``published_runs``, app/channel.py), not as Gradio messages.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable

from dflash_core import compute
from dflash_core.speculative import CycleEvent, GenerationConfig

# Page updates while a run is going (each may carry several cycles). Every update costs the
# browser, on the same cores as the engine, more than its few bytes suggest: 4 a second cost the
# engine less than 10 did, and 2 less than 4 (scripts/studio_bench.py, docs/BENCHMARKS.md), while
# tokens still arrive every half second. DFLASH_UI_UPDATES_PER_S changes it.
UPDATES_PER_S = float(os.environ.get("DFLASH_UI_UPDATES_PER_S", "2"))


class BackgroundRun:
    """``engine.stream_ids`` driven in a daemon thread; ``take()`` returns the events produced
    since the last call, each with the ``time.perf_counter()`` at which the engine yielded it."""

    def __init__(self, engine: Any, prompt_ids: list[int], config: GenerationConfig,
                 should_stop: Callable[[], bool] | None = None, abandoned: Callable[[], bool] | None = None) -> None:
        self._events: list[tuple[float, CycleEvent]] = []
        self._taken = 0
        self._guard = threading.Lock()
        self._abandoned = threading.Event()
        self._began = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.started = 0.0
        self._gone = abandoned  # asked after every cycle: the page that watched has gone
        self._stream = engine.stream_ids(prompt_ids, config, should_stop=should_stop)
        # On the process's one compute thread (dflash_core.compute), where the CLI's speed is;
        # the run's clock starts when it starts there, not while it waits for its turn.
        compute.submit(self._run)
        self._began.wait()

    def _run(self) -> None:
        self.started = time.perf_counter()
        self._began.set()
        try:
            for event in self._stream:
                with self._guard:
                    self._events.append((time.perf_counter(), event))
                if self._abandoned.is_set() or (self._gone is not None and self._gone()):
                    break  # nobody is watching: stop before computing another cycle
        except BaseException as exc:  # handed to the consumer, which raises it where it can be shown
            self.error = exc
        finally:
            self._stream.close()  # a run left early is recorded as abandoned and frees the engine
            self.done.set()

    def take(self) -> list[tuple[float, CycleEvent]]:
        with self._guard:
            new = self._events[self._taken:]
            self._taken = len(self._events)
        return new

    def wait(self, timeout: float) -> bool:
        """Wait until the run ends or ``timeout`` passes; whether it has ended."""
        return self.done.wait(timeout)

    def abandon(self, timeout: float = 30.0) -> None:
        """The consumer went away (a closed tab, a dropped client): end after the current cycle."""
        self._abandoned.set()
        self.done.wait(timeout)


def batches(run: BackgroundRun, per_s: float = UPDATES_PER_S):
    """Yield lists of ``(time, event)``: everything new, at most ``per_s`` times a second, until
    the run ends (the last batch holds the final event). Closing the generator abandons the run."""
    interval = 1.0 / per_s
    try:
        while True:
            ended = run.wait(interval)
            new = run.take()
            if new or ended:
                yield new
            if ended:
                if run.error is not None:
                    raise run.error
                return
    finally:
        if not run.done.is_set():
            run.abandon()


def recorded_batches(run: BackgroundRun, record: Any, tokenizer: Any):
    """``batches(run)`` recorded into ``record`` (a ``RunRecord``) as they come; yields what each
    batch added: (new ``TokenView``s, new ``CycleRecord``s), the pieces a live update sends."""
    for batch in batches(run):
        shown_tokens, shown_cycles = len(record.tokens), len(record.cycles)
        for at, event in batch:
            record.add(event, tokenizer, at=at)
        yield record.tokens[shown_tokens:], record.cycles[shown_cycles:]


COUNTER_LABELS = {"dflash": "DFlash", "ar": "Autoregressive"}


def live_runs(engine: Any, prompt_ids: list[int], runs: list[tuple[str, GenerationConfig]], stop: threading.Event,
              run_id: int, records: dict[str, Any], panes: dict[str, str] | None = None,
              abandoned: Callable[[], bool] | None = None):
    """Each ``(mode, config)`` of ``runs`` in turn ("dflash", then the "ar" baseline), each in
    its own ``BackgroundRun`` recorded into ``records[mode]`` (a ``RunRecord``); yields
    ``(mode, None)`` as a run starts, then ``(mode, update)`` per batch: the JSON of one live
    update (the new token spans, the new cycle-log rows, the run's counters) for the page's
    APPLY_LIVE_UPDATE_JS. Ends early once ``stop`` is set or ``abandoned()`` is true."""
    from . import render
    from .recording import RunRecord

    for mode, config in runs:
        if stop.is_set() or (abandoned is not None and abandoned()):
            return
        yield mode, None
        run = BackgroundRun(engine, prompt_ids, config, should_stop=stop.is_set, abandoned=abandoned)
        record = records[mode] = RunRecord(mode, started=run.started)
        for tokens, cycles in recorded_batches(run, record, engine.tokenizer):
            update = {"run": run_id, mode: render.token_spans(tokens, mode),
                      f"{mode}_counters": render.counters_inner(record, COUNTER_LABELS[mode])}
            if panes:
                update["panes"] = panes
            if mode == "dflash" and cycles:
                update["log"] = render.cycle_rows(cycles)
            yield mode, json.dumps(update)


def subscribe(channel: Any, run_id: int) -> str:
    """The value of a live-update box that has the page open ``channel``'s event stream."""
    return json.dumps({"run": run_id, "subscribe": channel.url})


def published_runs(engine: Any, prompt_ids: list[int], runs: list[tuple[str, GenerationConfig]],
                   stop: threading.Event, run_id: int, records: dict[str, Any], channel: Any,
                   panes: dict[str, str] | None = None):
    """``live_runs`` with its updates published to ``channel`` (an ``app.channel.Channel``)
    rather than handed to Gradio; yields each run's mode as it starts. A page that has gone
    (``channel.abandoned()``) ends the run within a cycle. The channel is closed at the end."""
    try:
        for mode, update in live_runs(engine, prompt_ids, runs, stop, run_id, records, panes, channel.abandoned):
            if update is None:
                yield mode
            else:
                channel.publish(update)
    finally:
        channel.close()
