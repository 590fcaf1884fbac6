"""The Chat tab: a conversation through the target's chat template (system prompt, history,
Regenerate, Clear), each assistant turn streamed cycle by cycle with the Live tab's machinery
(``BackgroundRun``, live updates appended in the browser, the same colours, counters and cycle
log), the autoregressive baseline for any answer on request, and Stop within a cycle.

Long conversations: the oldest exchanges are left out of the prompt until it fits the target's
context (the turn says so); a last message that does not fit on its own gets the engine's own
context error.

A turn that ends early keeps the conversation well formed (user, assistant, user, …): an answer
stopped or broken off by an engine error after it began is kept, marked as such; one that had not
said a token leaves the conversation as it was, the message back in its box.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Iterator

import gradio as gr

from dflash_core.errors import DFlashError, PromptError
from dflash_core.messages import encode_messages
from dflash_core.prompting import check_fits_context
from dflash_core.request import Variant
from dflash_core.speculative import GenerationConfig

from . import render
from .channel import CHANNELS
from .live import published_runs, subscribe
from .recording import RunRecord

# Where the Chat tab's live updates go (APPLY_LIVE_UPDATE_JS reads them from each update): the
# answer being written is the conversation's one pane tagged with a run.
CHAT_PANES = {"dflash": "#dfs-chat-conv .dfs-text[data-run]", "ar": "#dfs-chat-ar .dfs-text",
              "log": "#dfs-chat-log .dfs-log", "dflash_counters": "#dfs-chat-counters .dfs-counters",
              "ar_counters": "#dfs-chat-ar-counters .dfs-counters"}
AR_PLACEHOLDER = ("Tick “Also run the autoregressive baseline” to time each answer against the target alone, "
                  "or pick an earlier answer below and press “Run the baseline for this answer”.")


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


def lossless(config: GenerationConfig, dflash: RunRecord, ar: RunRecord | None) -> bool | None:
    """Whether greedy DFlash said exactly what the target alone said; None where it cannot be
    told (sampling, or a baseline that did not finish)."""
    if ar is None or ar.finish_reason in (None, "cancelled") or config.temperature != 0:
        return None
    return dflash.token_ids == ar.token_ids


def speedup_sentence(dflash: RunRecord | None, ar: RunRecord | None, same: bool | None = None) -> str:
    """The speedup as one plain sentence (for the answer's note), or "" until both runs have a
    rate; with the lossless check when there is one."""
    if dflash is None or ar is None or dflash.tokens_per_s is None or ar.tokens_per_s is None:
        return ""
    sentence = " ".join(render.speedup_parts(dflash.tokens_per_s, ar.tokens_per_s))
    if same is not None:
        sentence += " · identical output ✓" if same else " · outputs differ"
    return sentence


def answer_note(dflash_note: str, dflash: RunRecord, ar: RunRecord | None, same: bool | None) -> str:
    """An answer's note: its own figures, then the speedup once a baseline has timed it."""
    return " · ".join(part for part in (dflash_note, speedup_sentence(dflash, ar, same)) if part)


def answer_choices(history: list[dict]) -> list[tuple[str, int]]:
    """The answers a baseline can time, as (label, index in ``history``), oldest first."""
    choices, asked = [], ""
    for index, turn in enumerate(history):
        if turn["role"] == "user":
            asked = " ".join(turn["content"].split())
        elif "prompt_ids" in turn:
            short = asked if len(asked) <= 48 else asked[:47] + "…"
            choices.append((f"Answer {len(choices) + 1}: {short}", index))
    return choices


def answer_picker(history: list[dict]) -> Any:
    """The answer dropdown for ``history``: its answers, the newest picked."""
    choices = answer_choices(history)
    return gr.Dropdown(choices=choices, value=choices[-1][1] if choices else None)


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
    # gr.State: the turns, each {role, content}; an answer also has html, note, token_ids and what
    # its baseline needs: pair, config, ar_config, prompt_ids, record (its DFlash run), dflash_note.
    history: Any
    message: Any
    status: Any
    counters: Any
    ar_counters: Any
    ar_text: Any
    speedup: Any
    log: Any
    live_update: Any  # a hidden textbox naming the event stream of the answer's updates, as in the Live tab
    answer: Any  # the dropdown of answers a baseline can time

    def all(self) -> list[Any]:
        return [getattr(self, f.name) for f in fields(self)]


class Chat:
    """The Chat tab's handlers. Shares the studio's engines, run ids and per-session Stop events."""

    def __init__(self, studio: Any, variants: dict[str, Variant],
                 variant_name: Callable[[GenerationConfig], str]) -> None:
        self.studio = studio
        self.variants = variants  # the Live tab's switch: its choices' names -> variants
        self.variant_name = variant_name
        self.views: ChatViews | None = None  # set by build_studio

    # ------------------------------------------------------------------------------ handlers
    def send(self, pair, message, history, system, block, temperature, max_new, seed, baseline, variant,  # noqa: ANN001
             thinking, request: gr.Request) -> Iterator[dict]:
        """Add the user's message and stream the answer."""
        if not (message or "").strip():
            yield {self.views.status: "Type a message first."}
            return
        before = list(history or [])
        turns = before + [{"role": "user", "content": message}]
        settings = (pair, system, block, temperature, max_new, seed, baseline, variant, thinking)
        yield from self._session(request, lambda stop: self._run(stop, before, turns, message, *settings))

    def regenerate(self, pair, history, system, block, temperature, max_new, seed, baseline, variant,  # noqa: ANN001
                   thinking, request: gr.Request) -> Iterator[dict]:
        """Answer the last user turn again (its previous answer is replaced)."""
        before = list(history or [])
        turns = list(before)
        while turns and turns[-1]["role"] == "assistant":
            turns.pop()
        if not turns:
            yield {self.views.status: "Nothing to regenerate: send a message first."}
            return
        settings = (pair, system, block, temperature, max_new, seed, baseline, variant, thinking)
        yield from self._session(request, lambda stop: self._run(stop, before, turns, None, *settings))

    def time_answer(self, index: int | None, history: list[dict] | None, request: gr.Request) -> Iterator[dict]:
        """Run the autoregressive baseline on an answer's exact prompt (the conversation up to its
        message, as that answer saw it) and show it beside that answer's DFlash run; the
        conversation's words stay as they are, the answer's note gains the speedup."""
        turns = list(history or [])
        if index is None or not 0 <= int(index) < len(turns) or "prompt_ids" not in turns[int(index)]:
            yield {self.views.status: "No answer to time yet: send a message, then pick its answer."}
            return
        yield from self._session(request, lambda stop: self._time(stop, turns, int(index)))

    def clear(self, request: gr.Request) -> dict:
        """Start a new conversation (not while an answer is being written: Stop it first)."""
        v = self.views
        if not self.studio.sessions.settled(request):
            return {v.status: "An answer is being written: press Stop first, then Clear."}
        return {v.history: [], v.conversation: render.chat_html([]), v.status: "New conversation.",
                v.counters: render.counters_html(None, "DFlash"), v.ar_counters: render.counters_html(None, "Autoregressive"),
                v.ar_text: render.tokens_html(None, AR_PLACEHOLDER), v.speedup: render.speedup_html(None, None, None),
                v.log: render.cycle_log_html(None), v.answer: answer_picker([])}

    # ------------------------------------------------------------------------------ one turn
    def _session(self, request: Any, work: Callable[[threading.Event], Iterator[dict]]) -> Iterator[dict]:
        # The same per-session run as the Live tab: the Stop buttons of both tabs reach it.
        with self.studio.sessions.run(request) as stop:
            yield from work(stop)

    def _engine(self, pair: str | None) -> Iterator[dict | Any]:
        """Status updates while the pair loads, then its engine (``DFlashError`` if it cannot)."""
        for item in self.studio.wait_for_engine(pair):
            yield {self.views.status: item} if isinstance(item, str) else item

    def _run(self, stop: threading.Event, before: list[dict], turns: list[dict], message: str | None,  # noqa: ANN001
             pair, system, block, temperature, max_new, seed, baseline, variant, thinking) -> Iterator[dict]:
        """Answer ``turns``' last user message. ``before``: the conversation to go back to if no
        answer comes; ``message``: what Send took from the message box (None for Regenerate)."""
        v = self.views
        try:
            engine = None
            for item in self._engine(pair):
                if isinstance(item, dict):
                    yield item
                else:
                    engine = item
            # The box is only enabled where the template has the switch; elsewhere the pair decides.
            choice = bool(thinking) if engine.thinking_switch else None
            chosen = self.variants.get(variant, self.variants["fastest"]).name
            # Engine.resolve checks the settings and the last message as for any prompt (the
            # engine's own messages); the conversation's ids come from the chat template below.
            last_user = next(t["content"] for t in reversed(turns) if t["role"] == "user")
            request = self.studio.request(last_user, block, temperature, max_new, seed, chosen, choice)
            cfg = engine.resolve(request).config
            ar_cfg = engine.resolve(replace(request, variant="ar")).config
            ids, dropped = fit_conversation(engine, turns, system, engine.thinking(choice), cfg.max_new_tokens)
        except DFlashError as exc:
            yield {v.status: f"⚠️ {exc}"}  # nothing changed: the message is still in its box
            return

        run_id = next(self.studio._run_ids)
        name = self.variant_name(cfg)
        notes = []
        if dropped:
            notes.append(f"{dropped} oldest exchange(s) left out of the prompt: the whole conversation would not fit "
                         f"the target's context of {engine.context_length:,} tokens with {cfg.max_new_tokens:,} new tokens")
        started = {
            v.conversation: render.chat_html(turns, run_id),
            v.ar_text: render.tokens_html(None, "The autoregressive baseline runs after DFlash." if baseline
                                          else AR_PLACEHOLDER, run_id),
            v.log: render.cycle_log_html(None, run_id=run_id),
            v.counters: render.counters_html(None, "DFlash", run_id),
            v.ar_counters: render.counters_html(None, "Autoregressive", run_id),
            v.speedup: render.speedup_html(None, None, None),
        }
        if message is not None:
            started[v.message] = ""
        records: dict[str, RunRecord] = {}
        runs = [("dflash", cfg)] + ([("ar", ar_cfg)] if baseline else [])
        error: DFlashError | None = None
        channel = CHANNELS.open()  # the updates go there, not through Gradio (app/channel.py)
        try:
            yield {**started, v.live_update: subscribe(channel, run_id)}
            for mode in published_runs(engine, ids, runs, stop, run_id, records, channel, CHAT_PANES):
                yield {v.status: f"▶ answering with DFlash ({name})…" if mode == "dflash"
                       else "▶ running the autoregressive baseline on the same prompt…"}
        except DFlashError as exc:
            error = exc  # handled below like a Stop: what was said is kept
        finally:
            channel.close()

        d, a = records.get("dflash"), records.get("ar")
        if d is None or not d.token_ids:
            # Not a token said: the conversation goes back to what it was, the message to its box.
            said = f"⚠️ {error}" if error else "⏹ stopped before the answer began"
            back = {v.status: f"{said} · the conversation is as it was", v.history: before,
                    v.conversation: render.chat_html(before), v.log: render.cycle_log_html(None),
                    v.counters: render.counters_html(None, "DFlash"), v.ar_text: render.tokens_html(None, AR_PLACEHOLDER),
                    v.ar_counters: render.counters_html(None, "Autoregressive"),
                    v.speedup: render.speedup_html(None, None, None), v.answer: answer_picker(before)}
            if message is not None:
                back[v.message] = message
            yield back
            return
        # An error in the baseline leaves the answer whole; one in DFlash breaks the answer off.
        broke_answer = error is not None and "ar" not in records
        if broke_answer:
            notes.append(f"interrupted: {error}")
        elif d.finish_reason == "cancelled":
            notes.append("stopped")
        figures = f"{d.num_tokens} tokens"
        if d.tau is not None:
            figures += f" · τ {d.tau:.2f}"
        if d.tokens_per_s is not None:
            figures += f" · {d.tokens_per_s:.1f} tok/s"
        notes.append(figures)
        same = lossless(cfg, d, a)
        record = replace(d, _detokenizer=None)  # kept for a later baseline; the tokenizer is not
        answer = {"role": "assistant", "content": engine.decode(d.token_ids), "html": render.token_spans(d.tokens, "dflash"),
                  "dflash_note": " · ".join(notes), "note": answer_note(" · ".join(notes), d, a, same),
                  "token_ids": list(d.token_ids), "prompt_ids": ids, "pair": pair, "config": cfg, "ar_config": ar_cfg,
                  "record": record}
        history = turns + [answer]
        if error is not None:
            status = f"⚠️ {error} · " + ("the answer so far is kept; Regenerate answers again" if broke_answer
                                         else "the baseline did not finish; the answer is kept")
        else:
            stopped = stop.is_set() or any(r.finish_reason == "cancelled" for r in records.values())
            status = ("⏹ stopped" if stopped else "✓ done") + f" · variant: {name}"
        ar_placeholder = (AR_PLACEHOLDER if not baseline else
                          f"The baseline failed: {error}" if error is not None else "Stopped before the baseline ran.")
        yield {
            v.status: status,
            v.history: history,
            v.conversation: render.chat_html(history),
            v.log: render.cycle_log_html(d),
            v.counters: render.counters_html(d, "DFlash"),
            v.ar_text: render.tokens_html(a, ar_placeholder),
            v.ar_counters: render.counters_html(a, "Autoregressive"),
            v.speedup: render.speedup_html(d, a, same, name) if a is not None else
            f'<div class="dfs-speedup">{AR_PLACEHOLDER}</div>',
            v.answer: answer_picker(history),
        }

    def _time(self, stop: threading.Event, turns: list[dict], index: int) -> Iterator[dict]:
        """The baseline for ``turns[index]``, an answer (see ``time_answer``)."""
        v = self.views
        turn = turns[index]
        d: RunRecord = turn["record"]
        number = next(n for n, (_, at) in enumerate(answer_choices(turns), 1) if at == index)
        label = f"DFlash · answer {number}"
        try:
            engine = None
            for item in self._engine(turn["pair"]):
                if isinstance(item, dict):
                    yield item
                else:
                    engine = item
        except DFlashError as exc:
            yield {v.status: f"⚠️ {exc}"}
            return
        # The baseline the answer would have had, for as many tokens as it has: greedy, the target
        # alone must say exactly those (a stopped answer is compared on what it said), and both
        # rates are over the same length.
        config = replace(turn["ar_config"], max_new_tokens=len(turn["token_ids"]))
        run_id = next(self.studio._run_ids)
        records: dict[str, RunRecord] = {}
        channel = CHANNELS.open()
        try:
            yield {
                v.ar_text: render.tokens_html(None, f"The target alone, on answer {number}'s prompt.", run_id),
                v.ar_counters: render.counters_html(None, "Autoregressive", run_id),
                v.counters: render.counters_html(d, label), v.log: render.cycle_log_html(d),
                v.speedup: render.speedup_html(None, None, None),
                v.status: f"▶ running the autoregressive baseline on answer {number}'s prompt…",
                v.live_update: subscribe(channel, run_id),
            }
            for _ in published_runs(engine, turn["prompt_ids"], [("ar", config)], stop, run_id, records, channel,
                                    CHAT_PANES):
                pass
        except DFlashError as exc:
            yield {v.status: f"⚠️ {exc} · the conversation is unchanged",
                   v.ar_text: render.tokens_html(records.get("ar"), f"The baseline failed: {exc}")}
            return
        finally:
            channel.close()
        a = records.get("ar")
        shown = {v.ar_text: render.tokens_html(a, "Stopped before the baseline ran."),
                 v.ar_counters: render.counters_html(a, "Autoregressive")}
        if a is None or a.finish_reason == "cancelled":
            yield {**shown, v.status: "⏹ stopped · the answer's note is unchanged"}
            return
        same = lossless(turn["config"], d, a)
        timed = {**turn, "note": answer_note(turn["dflash_note"], d, a, same)}
        history = turns[:index] + [timed] + turns[index + 1:]
        yield {
            **shown,
            v.status: f"✓ baseline for answer {number}: {speedup_sentence(d, a, same) or 'too short to time'}",
            v.history: history,
            v.conversation: render.chat_html(history),
            v.speedup: render.speedup_html(d, a, same, self.variant_name(turn["config"])),
        }
