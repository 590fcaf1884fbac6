"""The Chat tab: a conversation through the target's chat template (system prompt, history,
Regenerate, Clear), each assistant turn streamed cycle by cycle with the Live tab's machinery
(``BackgroundRun``, live updates appended in the browser, the same colours, counters and cycle
log), the autoregressive baseline for a turn on request, and Stop within a cycle.

Long conversations: the oldest exchanges are left out of the prompt until it fits the target's
context (the turn says so); a last message that does not fit on its own gets the engine's own
context error.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Iterator

import gradio as gr

from dflash_core.errors import DFlashError, PromptError
from dflash_core.messages import encode_messages
from dflash_core.prompting import check_fits_context
from dflash_core.speculative import GenerationConfig

from . import render
from .live import live_runs
from .recording import RunRecord

# Where the Chat tab's live updates go (APPLY_LIVE_UPDATE_JS reads them from each update): the
# answer being written is the conversation's one pane tagged with a run.
CHAT_PANES = {"dflash": "#dfs-chat-conv .dfs-text[data-run]", "ar": "#dfs-chat-ar .dfs-text",
              "log": "#dfs-chat-log .dfs-log"}
AR_PLACEHOLDER = "Tick “Also run the autoregressive baseline” to time a turn against the target alone."


def conversation(history: list[dict], system: str | None) -> list[dict[str, str]]:
    """The messages the chat template gets: the system prompt (if any), then the turns."""
    messages = [{"role": "system", "content": system.strip()}] if system and system.strip() else []
    return messages + [{"role": t["role"], "content": t["content"]} for t in history]


def fit_conversation(engine: Any, history: list[dict], system: str | None, thinking: bool | None,
                     max_new_tokens: int) -> tuple[list[int], int]:
    """Prompt ids for the answer to ``history``'s last user turn, and how many of the oldest
    exchanges (a user turn and its answer) had to be left out for prompt + answer to fit the
    target's context. The system prompt always stays; when even the last user turn alone does
    not fit, the engine's context error (``PromptError``) says by how much."""
    starts = [i for i, turn in enumerate(history) if turn["role"] == "user"]
    if not starts:
        raise PromptError("the conversation has no user message to answer: type one")
    for dropped, start in enumerate(starts):
        ids = encode_messages(engine.tokenizer, conversation(history[start:], system), thinking)
        try:
            check_fits_context(len(ids), max_new_tokens, engine.context_length)
            return ids, dropped
        except PromptError:
            if start == starts[-1]:
                raise
    raise AssertionError("unreachable: the last start either fits or raises")


def speedup_sentence(dflash: RunRecord | None, ar: RunRecord | None) -> str:
    """The speedup as one plain sentence (the turn's note), or "" until both runs have a rate."""
    if dflash is None or ar is None or dflash.tokens_per_s is None or ar.tokens_per_s is None:
        return ""
    return (f"{dflash.tokens_per_s / ar.tokens_per_s:.2f}× faster than the target alone "
            f"({dflash.tokens_per_s:.1f} vs {ar.tokens_per_s:.1f} tok/s)")


def thinking_box(service: Any, pair: str | None, load: bool = False) -> Any:
    """The thinking-mode checkbox for a pair: enabled only when its chat template has the switch,
    ticked as the pair's own setting. ``load``: load the pair first (a pair chosen in a dropdown)."""
    name = pair or service.registry.default
    if load:
        try:
            service.engine(name)
        except DFlashError as exc:
            return gr.Checkbox(value=False, interactive=False, info=f"Thinking mode unavailable: {exc}")
    if not service.status.get(name, "").startswith("ready"):
        return gr.Checkbox(value=False, interactive=False,
                           info="Thinking mode: available once the pair has loaded, if its chat template has the switch.")
    engine = service.engine(name)
    if not engine.thinking_switch:
        return gr.Checkbox(value=False, interactive=False,
                           info="This pair's chat template has no thinking switch (enable_thinking).")
    default = engine.pair.enable_thinking
    # No setting in models.toml: Qwen3-style templates think unless told not to.
    said = "not set, so the template's default (on)" if default is None else (
        ("on" if default else "off") + ", what its drafter was trained with")
    return gr.Checkbox(value=True if default is None else default, interactive=True,
                       info=f"The pair's setting: {said}. Acceptance drops when it differs from the drafter's training.")


@dataclass
class ChatViews:
    """The Chat tab's output components (handlers yield {component: value})."""

    conversation: Any
    history: Any  # gr.State: the turns, each {role, content, html, note, token_ids?, prompt_tokens?}
    message: Any
    status: Any
    counters: Any
    ar_counters: Any
    ar_text: Any
    speedup: Any
    log: Any
    live_update: Any  # a hidden textbox, applied by APPLY_LIVE_UPDATE_JS like the Live tab's

    def all(self) -> list[Any]:
        return [getattr(self, f.name) for f in fields(self)]


class Chat:
    """The Chat tab's handlers. Shares the studio's engines, run ids and per-session Stop events."""

    def __init__(self, studio: Any, variants: dict[str, tuple[bool, bool, bool]],
                 variant_name: Callable[[GenerationConfig], str]) -> None:
        self.studio = studio
        self.variants = variants  # name -> (adaptive, tree, lookup), as the Live tab's switch
        self.variant_name = variant_name
        self.views: ChatViews | None = None  # set by build_studio

    # ------------------------------------------------------------------------------ handlers
    def send(self, pair, message, history, system, block, temperature, max_new, seed, baseline, variant,  # noqa: ANN001
             thinking, request: gr.Request) -> Iterator[dict]:
        """Add the user's message and stream the answer."""
        if not (message or "").strip():
            yield {self.views.status: "Type a message first."}
            return
        turns = list(history or []) + [{"role": "user", "content": message}]
        yield from self._answer(request, turns, pair, system, block, temperature, max_new, seed, baseline, variant,
                                thinking)

    def regenerate(self, pair, history, system, block, temperature, max_new, seed, baseline, variant,  # noqa: ANN001
                   thinking, request: gr.Request) -> Iterator[dict]:
        """Answer the last user turn again (its previous answer is replaced)."""
        turns = list(history or [])
        while turns and turns[-1]["role"] == "assistant":
            turns.pop()
        if not turns:
            yield {self.views.status: "Nothing to regenerate: send a message first."}
            return
        yield from self._answer(request, turns, pair, system, block, temperature, max_new, seed, baseline, variant,
                                thinking)

    def clear(self, request: gr.Request) -> dict:
        """Start a new conversation (not while an answer is being written: Stop it first)."""
        v = self.views
        if (getattr(request, "session_hash", None) or "default") in self.studio._stops:
            return {v.status: "An answer is being written: press Stop first, then Clear."}
        return {v.history: [], v.conversation: render.chat_html([]), v.status: "New conversation.",
                v.counters: render.counters_html(None, "DFlash"), v.ar_counters: render.counters_html(None, "Autoregressive"),
                v.ar_text: render.tokens_html(None, AR_PLACEHOLDER), v.speedup: render.speedup_html(None, None, None),
                v.log: render.cycle_log_html(None)}

    # ------------------------------------------------------------------------------ one turn
    def _answer(self, request: Any, turns: list[dict], *settings: Any) -> Iterator[dict]:
        # The same per-session Stop event as the Live tab: the Stop buttons of both tabs reach it.
        session = getattr(request, "session_hash", None) or "default"
        stop = threading.Event()
        self.studio._stops[session] = stop
        try:
            yield from self._run(stop, turns, *settings)
        finally:
            if self.studio._stops.get(session) is stop:
                del self.studio._stops[session]

    def _run(self, stop: threading.Event, turns: list[dict], pair, system, block, temperature, max_new, seed,  # noqa: ANN001
             baseline, variant, thinking) -> Iterator[dict]:
        v = self.views
        try:
            engine = None
            for item in self.studio.wait_for_engine(pair):
                if isinstance(item, str):
                    yield {v.status: item}
                else:
                    engine = item
            # The box is only enabled where the template has the switch; elsewhere the pair decides.
            choice = bool(thinking) if engine.thinking_switch else None
            adaptive, tree, lookup = self.variants.get(variant, self.variants["fastest"])
            cfg = replace(self.studio.config(block, temperature, max_new, seed), adaptive=adaptive, tree=tree,
                          lookup=lookup)
            # Engine.prepare checks the settings and the last message as for any prompt (the
            # engine's own messages); the conversation's ids come from the chat template below.
            last_user = next(t["content"] for t in reversed(turns) if t["role"] == "user")
            cfg = engine.prepare(last_user, cfg, "dflash", enable_thinking=choice)[1]
            ar_cfg = engine.prepare(last_user, cfg, "ar", enable_thinking=choice)[1]
            ids, dropped = fit_conversation(engine, turns, system, engine.thinking(choice), cfg.max_new_tokens)
        except DFlashError as exc:
            yield {v.status: f"⚠️ {exc}"}
            return

        run_id = next(self.studio._run_ids)
        name = self.variant_name(cfg)
        notes = []
        if dropped:
            notes.append(f"{dropped} oldest exchange(s) left out of the prompt: the whole conversation would not fit "
                         f"the target's context of {engine.context_length:,} tokens with {cfg.max_new_tokens:,} new tokens")
        yield {
            v.message: "",
            v.conversation: render.chat_html(turns, run_id),
            v.ar_text: render.tokens_html(None, "The autoregressive baseline runs after DFlash." if baseline
                                          else AR_PLACEHOLDER, run_id),
            v.log: render.cycle_log_html(None, run_id=run_id),
            v.counters: render.counters_html(None, "DFlash"),
            v.ar_counters: render.counters_html(None, "Autoregressive"),
            v.speedup: render.speedup_html(None, None, None),
        }
        records: dict[str, RunRecord] = {}
        runs = [("dflash", cfg)] + ([("ar", ar_cfg)] if baseline else [])
        try:
            for mode, update in live_runs(engine, ids, runs, stop, run_id, records, CHAT_PANES):
                if update is None:
                    yield {v.status: f"▶ answering with DFlash ({name})…" if mode == "dflash"
                           else "▶ running the autoregressive baseline on the same prompt…"}
                    continue
                label = "DFlash" if mode == "dflash" else "Autoregressive"
                counters = v.counters if mode == "dflash" else v.ar_counters
                yield {v.live_update: update, counters: render.counters_html(records[mode], label)}
        except DFlashError as exc:
            # The user's message stays (Regenerate answers it again); no half answer is kept.
            yield {v.status: f"⚠️ {exc}", v.history: turns, v.conversation: render.chat_html(turns)}
            return

        d, a = records.get("dflash"), records.get("ar")
        if d is None:  # stopped before the answer started
            yield {v.status: "⏹ stopped", v.history: turns, v.conversation: render.chat_html(turns)}
            return
        cancelled = stop.is_set() or any(r.finish_reason == "cancelled" for r in records.values())
        same = None
        if a is not None and a.finish_reason not in (None, "cancelled") and cfg.temperature == 0:
            same = d.token_ids == a.token_ids
        if d.finish_reason == "cancelled":
            notes.append("stopped")
        figures = f"{d.num_tokens} tokens"
        if d.tau is not None:
            figures += f" · τ {d.tau:.2f}"
        if d.tokens_per_s is not None:
            figures += f" · {d.tokens_per_s:.1f} tok/s"
        notes.append(figures)
        if speedup_sentence(d, a):
            notes.append(speedup_sentence(d, a))
        answer = {"role": "assistant", "content": engine.decode(d.token_ids), "html": render.token_spans(d.tokens, "dflash"),
                  "note": " · ".join(notes), "token_ids": list(d.token_ids), "prompt_tokens": len(ids)}
        history = turns + [answer]
        yield {
            v.status: ("⏹ stopped" if cancelled else "✓ done") + f" · variant: {name}",
            v.history: history,
            v.conversation: render.chat_html(history),
            v.log: render.cycle_log_html(d),
            v.counters: render.counters_html(d, "DFlash"),
            v.ar_text: render.tokens_html(a, AR_PLACEHOLDER if not baseline else "Stopped before the baseline ran."),
            v.ar_counters: render.counters_html(a, "Autoregressive"),
            v.speedup: render.speedup_html(d, a, same, name) if a is not None else
            f'<div class="dfs-speedup">{AR_PLACEHOLDER}</div>',
        }
