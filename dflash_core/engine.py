"""The engine: a loaded target/drafter pair plus the checks between a request and the loop.

``Engine.resolve`` is what every front end calls first: it turns a ``request.Request`` into the
prompt ids and the one validated config the loop runs (settings, thinking, context length), and
``Engine.stream_ids`` then yields the loop's ``CycleEvent``s (``stream`` does both). A target
keeps per-sequence state (its KV cache), so one engine serves one generation at a time;
``Engine.lock`` makes that explicit for multi-threaded callers such as the UI.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Callable, Iterator

from . import calibration
from .errors import SettingsError
from .loading import LoadedPair, Progress, load_pair
from .corpus import AnswerCorpus, load_corpus
from .lookup import LookupStats
from .messages import encode_messages
from .proposers import DraftingMeter
from .prompting import check_fits_context, encode_prompt, has_thinking_switch, max_new_tokens_limit, stop_token_ids
from .registry import load_registry
from .request import AR, VARIANTS, Request, Resolved, variant
from .speculative import CycleEvent, GenerationConfig, GenerationResult, collect, measure_tree_costs, measure_verify_costs, stream

WARM_UP_PROMPT = "Write a Python function that returns the largest of three numbers, with a docstring."
LOOKUP_MEMORY = 50  # observations per estimate of prompt lookup's chances that still count fully


class Engine:
    def __init__(self, loaded: LoadedPair) -> None:
        self.loaded = loaded
        self.pair = loaded.pair
        self.target = loaded.target
        self.drafter = loaded.drafter
        self.tokenizer = loaded.target.tokenizer
        self.stop_ids = stop_token_ids(self.tokenizer, getattr(loaded.target.model, "generation_config", None))
        self.lock = threading.Lock()
        self._verify_costs: list[float] | None = None
        self._tree_costs: tuple[float, float] | None = None
        # Prompt lookup's chances, carried from one generation to the next (recent ones weigh most).
        self.lookup_stats = LookupStats(memory=LOOKUP_MEMORY)
        # The same for guesses from the target's own earlier answers (the pair's lookup_answers).
        self.answers_stats = LookupStats(memory=LOOKUP_MEMORY)
        # Whether drafting has been paying, per kind of adaptive generation (``drafting_meter``).
        self.drafting_meters: dict[GenerationConfig, DraftingMeter] = {}
        # What the latest run did, kept so front ends can show (and tests can check) that a run
        # whose consumer went away really stopped: cycles, tokens, and how it ended.
        self.last_run: dict[str, Any] | None = None
        self.runs = 0

    @classmethod
    def from_registry(
        cls, pair: str | None = None, registry: str | None = None, progress: Progress | None = None
    ) -> "Engine":
        return cls(load_pair(load_registry(registry).get(pair), progress))

    @property
    def max_block_size(self) -> int:
        return self.pair.block_size or self.drafter.block_size

    @property
    def context_length(self) -> int:
        return self.target.runner.max_positions

    @property
    def thinking_switch(self) -> bool:
        """Whether this target's chat template has a thinking switch (``enable_thinking``)."""
        return has_thinking_switch(self.tokenizer)

    def thinking(self, enable_thinking: bool | None = None, raw: bool = False) -> bool | None:
        """The thinking choice a request gets: its own ``enable_thinking`` when given, else the
        pair's (``models.toml``; what the drafter was trained with), else None (the template's
        default). A raw prompt has no template, so the pair's choice does not apply to it."""
        if enable_thinking is not None or raw:
            return enable_thinking
        if self.pair.enable_thinking is not None and not self.thinking_switch:
            raise SettingsError(f"pair {self.pair.name!r} sets enable_thinking, but its target's chat template has "
                                "no thinking switch: remove enable_thinking from the pair in models.toml")
        return self.pair.enable_thinking

    def resolve(self, request: Request) -> Resolved:
        """The one place a request becomes what the loop runs: its settings checked against this
        pair, its prompt encoded (with the thinking choice), and prompt + answer checked against
        the context; or a ``DFlashError`` that says what to change. Asking for "ar" or for block
        size 1 both resolve to block size 1, variant "ar"."""
        chosen = variant(request.variant)
        config = request.generation_config(self.max_block_size).validated(self.drafter.block_size, max_new_tokens_limit())
        if chosen.autoregressive or config.block_size == 1:
            chosen = VARIANTS[AR]
            config = replace(config, block_size=1, tree=False, lookup=False, adaptive=False)
        elif (config.tree or config.lookup) and not hasattr(self.target.runner, "forward_tree"):
            raise SettingsError(f"variant {chosen.name!r} (tree or prompt lookup) needs the fast target runner; this "
                                f"target runs on {type(self.target.runner).__name__}: use variant 'dflash' (no tree, "
                                f"no lookup) or 'ar'")
        thinking = self.thinking(request.thinking, request.raw)
        ids = self._encode(request, thinking)
        if request.max_new_tokens is None:
            config = replace(config, max_new_tokens=max(1, min(max_new_tokens_limit(), self.context_length - len(ids))))
        check_fits_context(len(ids), config.max_new_tokens, self.context_length)
        return Resolved(ids, config, chosen, thinking)

    def _encode(self, request: Request, thinking: bool | None) -> list[int]:
        if request.messages is None:
            return encode_prompt(self.tokenizer, request.prompt, raw=request.raw, enable_thinking=thinking)
        if request.prompt is not None or request.raw:
            raise SettingsError("a request takes a prompt (raw or chat-templated) or a conversation (messages, "
                                "always chat-templated), not both: drop one")
        return encode_messages(self.tokenizer, list(request.messages), thinking)

    def prepare(self, prompt: str, config: GenerationConfig, mode: str = "dflash", raw: bool = False,
                enable_thinking: bool | None = None) -> tuple[list[int], GenerationConfig]:
        """``resolve`` in the Python API's spelling: prompt ids and the validated config.
        ``enable_thinking``: True/False turns the chat template's thinking mode on/off for this
        request; None uses the pair's setting (see ``thinking``)."""
        resolved = self.resolve(Request.of(prompt, config, mode, raw, enable_thinking))
        return resolved.prompt_ids, resolved.config

    def stream(
        self,
        prompt: str,
        config: GenerationConfig,
        mode: str = "dflash",
        raw: bool = False,
        should_stop: Callable[[], bool] | None = None,
        enable_thinking: bool | None = None,
    ) -> Iterator[CycleEvent]:
        ids, config = self.prepare(prompt, config, mode, raw, enable_thinking)
        return self.stream_ids(ids, config, should_stop)

    def stream_ids(
        self, prompt_ids: list[int], config: GenerationConfig, should_stop: Callable[[], bool] | None = None
    ) -> Iterator[CycleEvent]:
        """The loop on already-encoded ids (``config`` validated); holds ``lock`` while running."""
        drafter = self.drafter if (config.block_size or 1) > 1 else None

        def locked() -> Iterator[CycleEvent]:
            with self.lock:
                self.runs += 1
                run: dict[str, Any] = {"run": self.runs, "cycles": 0, "tokens": 0, "finish_reason": None}
                self.last_run = run
                try:
                    costs = self.verify_costs() if config.adaptive and drafter is not None else None
                    shaped = config.adaptive and (config.tree or config.lookup) and drafter is not None
                    tree_costs = self.tree_costs() if shaped else (0.0, 0.0)
                    answers = self.answers() if config.lookup and drafter is not None else None
                    meter = self.drafting_meter(config, costs) if costs else None
                    for event in stream(self.target.runner, drafter, prompt_ids, config, self.stop_ids, should_stop,
                                        costs, tree_costs, self.lookup_stats, answers, meter):
                        run["cycles"] += 1
                        run["tokens"] += len(event.committed)
                        run["finish_reason"] = event.finish_reason
                        yield event
                finally:
                    # The loop only computes a cycle when asked for the next event, so a consumer
                    # that stops asking (a closed tab, a dropped client) stops it at once.
                    if run["finish_reason"] is None:
                        run["finish_reason"] = "abandoned"

        return locked()

    def warm_up(self, max_new_tokens: int = 24) -> None:
        """Measure what adaptive verification needs and run each kind of generation once, so
        that a fresh process's first timed run is not the one paying for first calls (kernel
        setup for each pass size, allocations, calibration). Leaves no trace in ``last_run``,
        ``runs``, prompt lookup's learnt chances or the drafting meters."""
        with self.lock:
            if self.drafter is not None:
                self.verify_costs()
                if hasattr(self.target.runner, "forward_tree"):
                    self.tree_costs()
        names = ["ar", "dflash"] + (["dflash_tree_lookup_adaptive"] if hasattr(self.target.runner, "forward_tree") else [])
        for name in names:
            resolved = self.resolve(Request(WARM_UP_PROMPT, variant=name, max_new_tokens=max_new_tokens))
            collect(self.stream_ids(resolved.prompt_ids, resolved.config))
        self.last_run, self.runs = None, 0
        self.lookup_stats = LookupStats(memory=LOOKUP_MEMORY)
        self.answers_stats = LookupStats(memory=LOOKUP_MEMORY)
        self.drafting_meters = {}

    def drafting_meter(self, config: GenerationConfig, verify_costs: list[float]) -> DraftingMeter:
        """The meter of whether drafting pays for generations like ``config`` (the same block,
        shape and sampling; any length and seed), carried from one to the next: a machine and
        pair where the drafter does not pay against the target alone learn it once, instead of
        paying a drafting cycle over the whole prompt at every generation's start."""
        kind = replace(config, max_new_tokens=1, seed=None)
        if kind not in self.drafting_meters:
            self.drafting_meters[kind] = DraftingMeter(verify_costs)
        return self.drafting_meters[kind]

    def answers(self) -> tuple[AnswerCorpus, LookupStats] | None:
        """The target's own answers, indexed on first need (a few seconds; ``load_corpus`` keeps
        one per process), with their chances: a second source of lookup guesses. None where the
        pair names none (``lookup_answers`` in models.toml)."""
        if self.pair.lookup_answers is None:
            return None
        return load_corpus(self.pair.lookup_answers), self.answers_stats

    @property
    def busy(self) -> bool:
        return self.lock.locked()

    def verify_costs(self) -> list[float]:
        """Measured cost of verifying 1..B tokens on this machine (for adaptive drafting);
        measured on first need, or taken from the on-disk cache after a spot check (calibration.py; call with the lock held)."""
        if self._verify_costs is None:
            runner, block = self.target.runner, self.drafter.block_size
            self._verify_costs = list(calibration.cached_costs(
                self._calibration_key(), "verify", runner, lambda: measure_verify_costs(runner, block)))
        return self._verify_costs

    def _calibration_key(self) -> str:
        return calibration.machine_key(self.target.runner, self.pair.name, self.drafter.block_size)

    def tree_costs(self) -> tuple[float, float]:
        """Measured extra cost of a verified tree over a chain (branching, per further path), for
        adaptive trees; measured on first need or taken from the on-disk cache (calibration.py; lock held)."""
        if self._tree_costs is None:
            runner, block = self.target.runner, self.drafter.block_size
            self._tree_costs = tuple(calibration.cached_costs(
                self._calibration_key(), "tree", runner, lambda: list(measure_tree_costs(runner, block))))
        return self._tree_costs

    def generate(self, prompt: str, config: GenerationConfig, mode: str = "dflash", raw: bool = False,
                 enable_thinking: bool | None = None) -> GenerationResult:
        return collect(self.stream(prompt, config, mode, raw, enable_thinking=enable_thinking))

    def decode(self, token_ids: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special)

    def describe(self) -> dict[str, Any]:
        return {
            "pair": self.pair.name,
            "target": self.target.name,
            "drafter_layers": len(self.drafter.layers),
            "block_size": self.max_block_size,
            "dtype": self.pair.dtype,
            "runner": type(self.target.runner).__name__,
            "kernels": getattr(self.target.runner, "kernels", None),  # FastTarget's: onednn | aoti
            "enable_thinking": self.pair.enable_thinking,
            "thinking_switch": self.thinking_switch,
            "lookup_answers": self.pair.lookup_answers,  # the target's own answers lookup also guesses from
        }
