"""Engines for the studio: one per pair, loaded once (in the background for the default pair),
with the loading progress kept for the UI to show."""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from dflash_core import compute
from dflash_core.engine import Engine
from dflash_core.errors import DFlashError, DeviceUnavailableError, ModelLoadError
from dflash_core.loading import device_problem, load_pair
from dflash_core.registry import Registry, load_registry

DEFAULT_BLOCK_SIZE = 16  # z-lab's published drafters and ours; a loaded engine knows its own


def on_gpu_space() -> bool:
    """A Hugging Face Space with ZeroGPU: CUDA appears inside ``spaces.GPU`` functions."""
    try:
        import spaces  # noqa: F401
    except ImportError:
        return False
    return bool(os.environ.get("SPACES_ZERO_GPU") or os.environ.get("SPACE_ID"))


class StudioService:
    def __init__(self, registry_path: str | None = None, warm_up: bool = True) -> None:
        self.registry: Registry = load_registry(registry_path)
        # Warm each engine up as it loads, so that no one's first run is the slow one.
        self.warm_up = warm_up
        self._engines: dict[str, Engine] = {}
        self._errors: dict[str, str] = {}
        self._loading: dict[str, threading.Event] = {}
        self._guard = threading.Lock()
        self.status: dict[str, str] = {}

    # ---------------------------------------------------------------------------------- pairs
    def unavailable_reason(self, name: str) -> str | None:
        pair = self.registry.pairs[name]
        if pair.needs_cuda and on_gpu_space():
            return None
        return device_problem(pair)

    def pair_choices(self) -> list[tuple[str, str]]:
        """(label, value) for a dropdown; pairs that cannot run here say why in their label."""
        choices = []
        for name, pair in self.registry.pairs.items():
            reason = self.unavailable_reason(name)
            label = name if reason is None else f"{name} — unavailable here: {reason}"
            choices.append((label, name))
        return choices

    def max_block_size(self, name: str) -> int:
        """The largest block size the pair's drafter takes (for the UI's slider)."""
        engine = self._engines.get(name)
        if engine is not None:
            return engine.max_block_size
        return self.registry.pairs[name].block_size or DEFAULT_BLOCK_SIZE

    def engines_status(self) -> dict[str, dict]:
        """Per pair: {status (loading), busy (generating now), last_run: {run, cycles, tokens,
        finish_reason}} (the studio's ``/status`` endpoint)."""
        out = {}
        for name in self.registry.pairs:
            engine = self._engines.get(name)
            out[name] = {"status": self.status.get(name, "not loaded"),
                         "busy": engine.busy if engine else False,
                         "last_run": dict(engine.last_run) if engine and engine.last_run else None}
        return out

    # -------------------------------------------------------------------------------- engines
    def preload(self, name: str | None = None) -> None:
        """Start loading a pair in a background thread (the default pair at startup)."""
        name = name or self.registry.default
        threading.Thread(target=self._load_quietly, args=(name,), daemon=True, name=f"load-{name}").start()

    def _load_quietly(self, name: str) -> None:
        try:
            self.engine(name)
        except DFlashError:
            pass  # kept in self._errors; shown when the pair is used

    def engine(self, name: str | None, progress: Callable[[str], None] | None = None) -> Engine:
        """The pair's engine, loading it on first use (other callers wait for that load)."""
        name = name or self.registry.default
        pair = self.registry.get(name)
        reason = self.unavailable_reason(name)
        if reason:
            raise DeviceUnavailableError(f"pair {name!r} cannot run on this machine: {reason}")
        with self._guard:
            if name in self._engines:
                return self._engines[name]
            waiter = self._loading.get(name)
            owner = waiter is None
            if owner:
                waiter = self._loading[name] = threading.Event()
                self._errors.pop(name, None)
        if not owner:
            while not waiter.wait(0.5):
                if progress:
                    progress(self.status.get(name, "loading…"))
            if name in self._errors:
                raise DFlashError(self._errors[name])
            return self._engines[name]

        def report(message: str) -> None:
            self.status[name] = message
            if progress:
                progress(message)

        started = time.time()
        try:
            engine = compute.call(lambda: Engine(load_pair(pair, report)))
            loaded = time.time() - started
            if self.warm_up:
                report("warming up (the first runs of a fresh process are slower; calibrating adaptive verification)")
                compute.call(engine.warm_up)
            self.status[name] = f"ready (loaded in {loaded:.1f} s, warmed up in {time.time() - started - loaded:.1f} s)"
            with self._guard:
                self._engines[name] = engine
            return engine
        except Exception as exc:
            # Whatever went wrong, the callers waiting for this load get a DFlashError that says
            # so (not a KeyError for the engine that never arrived).
            error = exc if isinstance(exc, DFlashError) else ModelLoadError(
                f"loading pair {name!r} failed: {type(exc).__name__}: {exc}; check the pair in models.toml")
            self._errors[name] = str(error)
            self.status[name] = f"failed: {error}"
            if error is exc:
                raise
            raise error from exc
        finally:
            with self._guard:
                self._loading.pop(name, None)
            waiter.set()
