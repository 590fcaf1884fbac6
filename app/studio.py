"""DFlash Studio: the Gradio app.

* Live view: the engine runs in its own thread at full speed; the page gets what is new (tokens
  coloured by origin, cycle-log rows, counters) at most four times a second on an event stream of
  its own (app/channel.py), appended in the browser, so what it shows costs the engine little
  and does not grow with the output.
* An honest autoregressive baseline on the same engine, run after DFlash (never at the same time)
  with its own timer (the engine's timestamps), and the speedup.
* Plotly charts, a Stop button that ends the engine within one cycle, a teaching mode that steps
  through recorded cycles, and a named streaming API endpoint ``/generate``.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterator

import gradio as gr

from dflash_core import compute
from dflash_core.errors import DFlashError
from dflash_core.prompting import max_new_tokens_limit
from dflash_core.request import Request, dflash_variant
from dflash_core.speculative import GenerationConfig

from . import charts, render
from .chat import AR_PLACEHOLDER, Chat, ChatViews, thinking_box
from .channel import CHANNELS
from .live import BackgroundRun, batches, published_runs, subscribe
from .recording import IncrementalDetokenizer, RunRecord
from .service import StudioService
from .sessions import Sessions
from .teaching import TeachingState, explanation_md, formula_md, step_html

try:  # ZeroGPU on Hugging Face Spaces: functions that may use CUDA are wrapped; a no-op elsewhere.
    import spaces

    gpu = spaces.GPU
except ImportError:  # pragma: no cover - only on Spaces

    def gpu(fn):  # type: ignore[no-redef]
        return fn


STATIC = Path(__file__).parent / "static"
EXAMPLES = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain how photosynthesis works in simple terms.",
    "from typing import List\n\n\ndef running_max(numbers: List[int]) -> List[int]:\n    \"\"\"Return the running maximum of the list.\n    >>> running_max([1, 3, 2, 5])\n    [1, 3, 3, 5]\n    \"\"\"\n",
    "Give me three tips for a productive morning.",
    "What is the difference between a list and a tuple in Python?",
]


# Applies live updates (see Studio.compare) in the browser: the box's value {"subscribe": url}
# opens the run's event stream (app/channel.py), whose every message is an update; an update appends
# the new tokens to the text panes, puts the new cycles on top of the log and replaces the
# counters, in arrival order, in the panes of the run it belongs to (a pane is emptied, and tagged
# with its run, at the start of every run). An update may name its panes ({key: CSS selector}, as
# the Chat tab's do); else the Live tab's.
APPLY_LIVE_UPDATE_JS = """
(payload) => {
  const live = window.dfsLive || (window.dfsLive = {queue: [], drain: null});
  live.drain = live.drain || (() => {
    const livePanes = {dflash: '#dfs-dflash .dfs-text', ar: '#dfs-ar .dfs-text', log: '#dfs-log .dfs-log',
                       dflash_counters: '#dfs-dflash-counters .dfs-counters', ar_counters: '#dfs-ar-counters .dfs-counters'};
    while (live.queue.length) {
      const update = live.queue[0];
      const panes = update.panes || livePanes;  // the Chat tab names its own panes
      const parts = Object.keys(panes).filter((key) => update[key]);
      const boxes = parts.map((key) => document.querySelector(panes[key]));
      if (boxes.some((box) => box && Number(box.dataset.run) > update.run)) { live.queue.shift(); continue; }
      if (boxes.some((box) => !box || Number(box.dataset.run) !== update.run)) {
        update.tries = (update.tries || 0) + 1;
        if (update.tries > 200) { live.queue.shift(); continue; }  // its run's panes are gone
        setTimeout(live.drain, 25);
        return;
      }
      parts.forEach((key, i) => {
        const box = boxes[i];
        if (key === 'log') {
          box.insertAdjacentHTML('afterbegin', update[key]);
          while (box.children.length > Number(box.dataset.keep)) box.lastElementChild.remove();
        } else if (key.endsWith('counters')) {
          box.innerHTML = update[key];
        } else {
          const following = box.scrollTop + box.clientHeight >= box.scrollHeight - 8;
          box.insertAdjacentHTML('beforeend', update[key]);
          if (following) box.scrollTop = box.scrollHeight;
        }
      });
      live.queue.shift();
    }
  });
  if (payload) {
    const base = ((window.gradio_config && window.gradio_config.root) || window.location.origin).replace(/\\/$/, '');
    const source = new EventSource(base + JSON.parse(payload).subscribe);
    source.onmessage = (event) => { live.queue.push(JSON.parse(event.data)); live.drain(); };
    source.addEventListener('end', () => source.close());
  }
  return [];
}
"""
THINKING_UNTIL_LOADED = "Thinking mode: available once the pair has loaded, if its chat template has the switch."
VARIANTS = {  # the Live tab's variant switch: its choices' names -> variants of dflash_core.request
    "fastest": dflash_variant(tree=True, lookup=True, adaptive=True),
    "plain": dflash_variant(),
}


# The variant switch sets the verification boxes: name -> [adaptive, tree, lookup].
VARIANT_OPTIONS_JS = "(name) => (%s)[name]" % json.dumps(
    {name: [v.adaptive, v.tree, v.lookup] for name, v in VARIANTS.items()})


def variant_name(config: GenerationConfig) -> str:
    """How a run verified its drafts, in the words the page uses."""
    if config.block_size == 1:
        return "autoregressive"
    parts = [name for name, on in (("tree", config.tree), ("prompt lookup", config.lookup),
                                   ("adaptive", config.adaptive)) if on]
    return " + ".join(parts) if parts else "plain DFlash"


@dataclass
class LiveViews:
    """The Live tab's output components, so handlers update them by name (a dict of
    component -> value; components left out keep what they show)."""

    status: Any
    dflash_text: Any
    dflash_counters: Any
    ar_text: Any
    ar_counters: Any
    speedup: Any
    log: Any
    live_update: Any  # a hidden textbox: each value names a run's event stream (APPLY_LIVE_UPDATE_JS)
    plots: dict[str, Any]  # charts.CHARTS' name -> its gr.Plot

    def all(self) -> list[Any]:
        single = [getattr(self, f.name) for f in fields(self) if f.name != "plots"]
        return single + list(self.plots.values())


class Studio:
    def __init__(self, service: StudioService) -> None:
        self.service = service
        self.sessions = Sessions()  # each session's run in progress and its Stop
        self._run_ids = itertools.count(1)
        self.views: LiveViews | None = None  # set by build_app
        self.chat: Chat | None = None  # the Chat tab's handlers, set by build_studio

    # ------------------------------------------------------------------------------ helpers
    def wait_for_engine(self, pair: str) -> Iterator[str | Any]:
        """Yield loading messages until the pair's engine is ready, then yield the engine."""
        box: dict[str, Any] = {}

        def load() -> None:
            try:
                box["engine"] = self.service.engine(pair)
            except DFlashError as exc:
                box["error"] = exc

        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.5)
            if worker.is_alive():
                yield f"⋯ {self.service.status.get(pair, 'loading models…')} (the first load takes up to a minute)"
        if "error" in box:
            raise box["error"]
        yield box["engine"]

    @staticmethod
    def request(prompt: Any, block: Any, temperature: Any, max_new: Any, seed: Any, chosen: str = "dflash",
                thinking: bool | None = None) -> Request:
        """The request the page's widgets make (``Engine.resolve`` checks it)."""
        def as_int(v: Any) -> Any:
            return int(v) if isinstance(v, float) and v.is_integer() else v

        seed_value = None if seed in (None, "", -1) else as_int(seed)
        return Request(prompt, thinking=thinking, variant=chosen, max_new_tokens=as_int(max_new),
                       block_size=as_int(block), temperature=float(temperature) if temperature is not None else 0.0,
                       seed=seed_value)

    # ------------------------------------------------------------------- the compare handler
    def compare(self, pair, prompt, block, temperature, max_new, seed, baseline, adaptive, tree, lookup,
                request: gr.Request, thinking=None):  # noqa: ANN001
        """Generator for the Live tab: DFlash, then the baseline, each run by the engine in its
        own thread while the page gets what is new at most ``UPDATES_PER_S`` times a second.
        ``thinking``: the thinking-mode box (None: the pair's setting; Gradio passes the inputs
        other than ``request`` in order, so it comes after ``lookup``)."""
        with self.sessions.run(request) as stop:
            yield from self._compare(stop, pair, prompt, block, temperature, max_new, seed, baseline,
                                     adaptive, tree, lookup, thinking)

    def _compare(self, stop: threading.Event, pair, prompt, block, temperature, max_new, seed, baseline,  # noqa: ANN001
                 adaptive, tree, lookup, thinking=None):
        v = self.views
        try:
            engine = None
            for item in self.wait_for_engine(pair):
                if isinstance(item, str):
                    yield {v.status: item}
                else:
                    engine = item
            # The box is only enabled where the template has the switch; elsewhere the pair decides.
            choice = bool(thinking) if thinking is not None and engine.thinking_switch else None
            chosen = dflash_variant(bool(tree), bool(lookup), bool(adaptive)).name
            request = self.request(prompt, block, temperature, max_new, seed, chosen, choice)
            resolved = engine.resolve(request)
            ids, cfg = resolved.prompt_ids, resolved.config
            ar_cfg = engine.resolve(replace(request, variant="ar")).config
        except DFlashError as exc:
            yield {v.status: f"⚠️ {exc}"}
            return

        run_id = next(self._run_ids)
        variant = variant_name(cfg)
        channel = CHANNELS.open()
        records: dict[str, RunRecord] = {}
        runs = [("dflash", cfg)] + ([("ar", ar_cfg)] if baseline else [])
        try:
            # Empty panes tagged with this run, and the page told where this run's updates stream
            # (app/channel.py): they come there, not through Gradio, while the engine is timed.
            yield {
                v.dflash_text: render.tokens_html(None, "DFlash output appears here, one cycle at a time.", run_id),
                v.ar_text: render.tokens_html(None, "The autoregressive baseline runs after DFlash." if baseline
                                              else "Baseline off.", run_id),
                v.log: render.cycle_log_html(None, run_id=run_id),
                v.dflash_counters: render.counters_html(None, "DFlash", run_id),
                v.ar_counters: render.counters_html(None, "Autoregressive", run_id),
                v.speedup: render.speedup_html(None, None, None),
                v.live_update: subscribe(channel, run_id),
                **{plot: None for plot in v.plots.values()},
            }
            for mode in published_runs(engine, ids, runs, stop, run_id, records, channel):
                label = f"DFlash ({variant})" if mode == "dflash" else "the autoregressive baseline"
                yield {v.status: f"▶ running {label}…"}
        except DFlashError as exc:
            yield {v.status: f"⚠️ {exc}"}
            return
        finally:
            channel.close()  # also when Gradio closes this generator (the page went away)
        d, a = records.get("dflash"), records.get("ar")
        same = None
        if d is not None and a is not None and a.finish_reason not in (None, "cancelled"):
            same = d.token_ids == a.token_ids if cfg.temperature == 0 else None
        cancelled = any(r.finish_reason == "cancelled" for r in records.values()) or stop.is_set()
        # Once both runs are over (nothing timed is running), the panes are drawn whole from the
        # records: what the page ends with is exactly what was recorded, however the live
        # updates fared.
        yield {
            v.status: ("⏹ stopped" if cancelled else "✓ done") + f" · variant: {variant}",
            v.dflash_text: render.tokens_html(d, "DFlash output appears here, one cycle at a time."),
            v.ar_text: render.tokens_html(a, "The autoregressive baseline runs after DFlash." if baseline else "Baseline off."),
            v.log: render.cycle_log_html(d),
            v.dflash_counters: render.counters_html(d, "DFlash"),
            v.ar_counters: render.counters_html(a, "Autoregressive"),
            v.speedup: render.speedup_html(d, a, same, variant),
            # The plots once, at the end: they are the heaviest thing to build and to draw, and a
            # browser drawing them beside a timed run would slow it.
            **{v.plots[chart.name]: chart.draw(d, a, cfg.block_size or 1) for chart in charts.CHARTS},
        }

    def model_status(self) -> tuple[str, Any]:
        """Loading progress of the default pair, polled by a timer until the models are ready."""
        name = self.service.registry.default
        status = self.service.status.get(name, "starting…")
        done = status.startswith(("ready", "failed"))
        icon = "✓" if status.startswith("ready") else ("⚠" if status.startswith("failed") else "⋯")
        return f"{icon} **{name}**: {status}", gr.Timer(active=not done)

    def stop(self, request: gr.Request) -> Any:
        """Both tabs' Stop: the run ends within its cycle and its own last update says "stopped";
        Stop adds nothing then, so that its answer cannot land after that update and cover it."""
        ended = self.sessions.stop(request)
        if ended is None:
            return "Nothing is running."
        return gr.skip() if ended else "⏹ stopping after the current cycle…"

    # ------------------------------------------------------------------------- teaching mode
    def teach_start(self, pair, prompt, block, max_new):  # noqa: ANN001
        try:
            engine = None
            for item in self.wait_for_engine(pair):
                if not isinstance(item, str):
                    engine = item
            resolved = engine.resolve(self.request(prompt, block, 0.0, max_new, None))
            ids, cfg = resolved.prompt_ids, resolved.config
            # A short autoregressive run measures t_AR, the cost of one plain decoding step.
            ar_cfg = engine.resolve(Request(prompt, variant="ar", max_new_tokens=min(32, cfg.max_new_tokens))).config
            dflash, ar = RunRecord("dflash"), RunRecord("ar")

            def record_runs() -> None:
                for record, config in ((dflash, cfg), (ar, ar_cfg)):
                    for event in engine.stream_ids(ids, config):
                        record.add(event, engine.tokenizer)

            compute.call(record_runs)
        except DFlashError as exc:
            return None, f"⚠️ {exc}", "", ""
        # The mask slots are shown as MASK: the id is a token the drafter's training reserved,
        # whose own text (for SmolLM2, ``<gh_stars>``) means nothing here.
        state = TeachingState(dflash, ar, cfg.block_size, "MASK")
        return state, step_html(state), formula_md(state), render.tokens_html(dflash)

    @staticmethod
    def teach_move(state: TeachingState | None, delta: int):  # noqa: ANN205
        if state is None:
            return None, "Press “Start” first.", "", ""
        state.position = max(0, min(len(state.dflash.cycles) - 1, state.position + delta))
        return state, step_html(state), formula_md(state), render.tokens_html(state.dflash)

    # ------------------------------------------------------------------------ the named API
    def api_generate(self, prompt: str, max_new_tokens: int = 128, block_size: int = 16,
                     temperature: float = 0.0, pair: str = "") -> Iterator[dict]:
        """Stream the generation, at most ``UPDATES_PER_S`` updates a second; the last update
        carries the full text and the token ids.

        Each update: {cycle, drafted, num_accepted, bonus (of the latest cycle), cycles (the
        indices of the cycles since the previous update), accepted and lengths (per such cycle:
        drafts kept, tokens committed), committed (the token ids since the previous update, the
        cycles' in order), text, tokens, tau, finish_reason, token_ids, prefill_s, decode_s}. The
        last two, like token_ids, come in the last update only: the engine's own wall time to the
        first token and after it, as ``generate --json`` reports them, so that a client can tell
        the engine's time from the transport's. Every list is flat:
        Gradio streams each update as a diff against the previous one, and its diff mangles
        deletions inside nested lists. Its inputs stay these five (raw HTTP clients send every
        input), so the Live tab's verification options are not among them.
        """
        try:
            engine = None
            for item in self.wait_for_engine(pair or self.service.registry.default):
                if not isinstance(item, str):
                    engine = item
            resolved = engine.resolve(self.request(prompt, block_size, temperature, max_new_tokens, None))
            ids, cfg = resolved.prompt_ids, resolved.config
        except DFlashError as exc:
            raise gr.Error(str(exc)) from None
        token_ids: list[int] = []
        text = IncrementalDetokenizer(engine.tokenizer, skip_special_tokens=True)
        lengths: list[int] = []
        first_at: float | None = None
        try:
            run = BackgroundRun(engine, ids, cfg)
            for batch in batches(run):
                if not batch:
                    continue
                committed: list[int] = []
                first_at = batch[0][0] if first_at is None else first_at
                for _, event in batch:
                    for token in event.committed:
                        text.push(token)
                    committed += event.committed
                    if event.drafted:
                        lengths.append(event.num_accepted + 1)
                token_ids += committed
                events = [event for _, event in batch]
                last = events[-1]
                final = last.finish_reason is not None
                yield {
                    "cycle": last.index, "drafted": last.drafted, "num_accepted": last.num_accepted, "bonus": last.bonus,
                    "cycles": [e.index for e in events], "accepted": [e.num_accepted for e in events],
                    "lengths": [len(e.committed) for e in events], "committed": committed,
                    "text": engine.decode(token_ids) if final else text.text, "tokens": len(token_ids),
                    "tau": sum(lengths) / len(lengths) if lengths else None,
                    "finish_reason": last.finish_reason, "token_ids": token_ids if final else None,
                    "prefill_s": round(first_at - run.started, 6) if final else None,
                    "decode_s": round(batch[-1][0] - first_at, 6) if final else None,
                }
        except DFlashError as exc:
            raise gr.Error(str(exc)) from None


# Gradio's queue looks for work every ``sleep_when_free`` seconds, 1 ms on Linux (50 ms on
# Windows), in the server's event-loop thread, all the time, runs in progress included. That thread
# shares the studio's process, and Python's lock, with the engine's: a thousand wake-ups a second
# are taken from the run being timed (docs/BENCHMARKS.md). Polling every 20 ms delays the start of a
# queued event by at most that.
QUEUE_POLL_S = float(os.environ.get("DFLASH_QUEUE_POLL_S", "0.02"))


def queue_app(demo: gr.Blocks, max_size: int | None = None) -> bool:
    """``demo.queue`` as the studio runs it (one event at a time per engine), polling for work
    every ``QUEUE_POLL_S``; whether this Gradio had the setting to change."""
    demo.queue(default_concurrency_limit=1, max_size=max_size)
    queue = getattr(demo, "_queue", None)
    if queue is None or not hasattr(queue, "sleep_when_free"):
        return False
    queue.sleep_when_free = max(float(queue.sleep_when_free), QUEUE_POLL_S)
    return True


def build_app(service: StudioService | None = None) -> gr.Blocks:
    return build_studio(service)[1]


def build_studio(service: StudioService | None = None) -> tuple[Studio, gr.Blocks]:
    """The studio's handlers and the page wired to them."""
    service = service or StudioService()
    studio = Studio(service)
    choices = service.pair_choices()
    default = service.registry.default
    limit = max_new_tokens_limit()

    with gr.Blocks(title="DFlash Studio") as demo:
        gr.Markdown(
            "# DFlash Studio\n"
            "A small **block-diffusion drafter** proposes a whole block of tokens in one pass; the target "
            "model checks the block in one pass and keeps the longest prefix it agrees with, plus one token of "
            "its own. The output is exactly the target's — only the speed changes."
        )
        model_status = gr.Markdown("⋯ loading models…", elem_id="dfs-model-status")
        status_timer = gr.Timer(1.0)
        with gr.Tab("Live"):
            with gr.Row():
                with gr.Column(scale=1, min_width=300):
                    pair = gr.Dropdown(choices=choices, value=default, label="Target / drafter pair")
                    prompt = gr.Textbox(label="Prompt", lines=5, value=EXAMPLES[0], elem_id="dfs-prompt")
                    gr.Examples(EXAMPLES, inputs=prompt, label="Example prompts")
                    block = gr.Slider(1, service.max_block_size(default), value=service.max_block_size(default),
                                      step=1, label="Block size (1 = autoregressive)")
                    temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)")
                    max_new = gr.Slider(1, limit, value=min(256, limit), step=1, label="Max new tokens", elem_id="dfs-max-new")
                    seed = gr.Number(value=0, precision=0, label="Seed (sampling)")
                    baseline = gr.Checkbox(value=True, label="Also run the autoregressive baseline")
                    variant = gr.Radio(
                        [("Fastest here: tree + prompt lookup + adaptive (same output)", "fastest"),
                         ("Plain DFlash, as published", "plain")],
                        value="fastest", label="Variant", elem_id="dfs-variant")
                    with gr.Accordion("Verification options", open=False):
                        adaptive = gr.Checkbox(value=True, label="Adaptive verification: verify only the drafts worth "
                                               "their cost (drafter confidence vs measured verify time)", elem_id="dfs-adaptive")
                        tree = gr.Checkbox(value=True, label="Tree verification: check the drafter's likeliest "
                                           "continuations as a tree in one target pass (same output)", elem_id="dfs-tree")
                        lookup = gr.Checkbox(value=True, label="Prompt lookup: also check, in the same pass, what followed "
                                             "the last tokens where they occurred before, in this text or in the model's own "
                                             "earlier answers (same output)", elem_id="dfs-lookup")
                    thinking = gr.Checkbox(value=False, interactive=False, label="Thinking mode", elem_id="dfs-thinking",
                                           info=THINKING_UNTIL_LOADED)
                    with gr.Row():
                        go_btn = gr.Button("Generate", variant="primary", elem_id="dfs-generate")
                        stop_btn = gr.Button("Stop", variant="stop", elem_id="dfs-stop")
                    status = gr.Markdown(elem_id="dfs-status")
                    gr.Markdown(render.TIMING_NOTE, elem_classes="dfs-note")
                with gr.Column(scale=2):
                    gr.HTML(render.LEGEND)
                    with gr.Row():
                        with gr.Column():
                            d_counters = gr.HTML(render.counters_html(None, "DFlash"), elem_id="dfs-dflash-counters")
                            d_text = gr.HTML(render.tokens_html(None, "DFlash output appears here."), elem_id="dfs-dflash")
                        with gr.Column():
                            a_counters = gr.HTML(render.counters_html(None, "Autoregressive"), elem_id="dfs-ar-counters")
                            a_text = gr.HTML(render.tokens_html(None, "Baseline output appears here."), elem_id="dfs-ar")
                    speedup = gr.HTML(render.speedup_html(None, None, None), elem_id="dfs-speedup")
                    log = gr.HTML(render.cycle_log_html(None), elem_id="dfs-log")
                    live_update = gr.Textbox(visible="hidden", elem_id="dfs-live-update")
                    # Where the runs' progress is "shown" (see go_btn.click): nothing is drawn for it.
                    untracked = gr.State(None)
            plots = {}
            for first in range(0, len(charts.CHARTS), charts.CHARTS_PER_ROW):
                with gr.Row():
                    for chart in charts.CHARTS[first:first + charts.CHARTS_PER_ROW]:
                        # Empty but drawn: the browser loads and compiles plotly.js with the page,
                        # not after the first run, just as a second Generate starts
                        # (scripts/studio_bench.py, docs/BENCHMARKS.md).
                        plots[chart.name] = gr.Plot(chart.draw(None, None, service.max_block_size(default)),
                                                    label=chart.label, elem_id=f"dfs-plot-{chart.name}")

        with gr.Tab("Chat"):
            with gr.Row():
                with gr.Column(scale=1, min_width=300):
                    c_pair = gr.Dropdown(choices=choices, value=default, label="Target / drafter pair")
                    c_system = gr.Textbox(label="System prompt", lines=3, elem_id="dfs-chat-system",
                                          placeholder="Empty: the chat template's own default")
                    c_block = gr.Slider(1, service.max_block_size(default), value=service.max_block_size(default),
                                        step=1, label="Block size (1 = autoregressive)")
                    c_temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)")
                    c_max = gr.Slider(1, limit, value=min(256, limit), step=1, label="Max new tokens per answer",
                                      elem_id="dfs-chat-max-new")
                    c_seed = gr.Number(value=0, precision=0, label="Seed (sampling)")
                    c_variant = gr.Radio(
                        [("Fastest here: tree + prompt lookup + adaptive (same output)", "fastest"),
                         ("Plain DFlash, as published", "plain")],
                        value="fastest", label="Variant", elem_id="dfs-chat-variant")
                    c_baseline = gr.Checkbox(value=False, elem_id="dfs-chat-baseline",
                                             label="Also run the autoregressive baseline for each answer (after it) "
                                                   "and show the speedup")
                    c_thinking = gr.Checkbox(value=False, interactive=False, label="Thinking mode",
                                             elem_id="dfs-chat-thinking", info=THINKING_UNTIL_LOADED)
                    c_status = gr.Markdown(elem_id="dfs-chat-status")
                with gr.Column(scale=2):
                    gr.HTML(render.LEGEND)
                    c_conv = gr.HTML(render.chat_html([]), elem_id="dfs-chat-conv")
                    c_message = gr.Textbox(label="Message", lines=2, elem_id="dfs-chat-message",
                                           placeholder="Type a message, then press Send")
                    with gr.Row():
                        c_send = gr.Button("Send", variant="primary", elem_id="dfs-chat-send")
                        c_stop = gr.Button("Stop", variant="stop", elem_id="dfs-chat-stop")
                        c_regen = gr.Button("Regenerate", elem_id="dfs-chat-regenerate")
                        c_clear = gr.Button("Clear", elem_id="dfs-chat-clear")
                    with gr.Row(equal_height=True):
                        c_answer = gr.Dropdown([], value=None, label="Time an answer against the target alone",
                                               elem_id="dfs-chat-answer", scale=3)
                        c_time = gr.Button("Run the baseline for this answer", elem_id="dfs-chat-time", scale=1)
                    c_counters = gr.HTML(render.counters_html(None, "DFlash"), elem_id="dfs-chat-counters")
                    c_speedup = gr.HTML(render.speedup_html(None, None, None), elem_id="dfs-chat-speedup")
                    with gr.Row():
                        with gr.Column():
                            c_log = gr.HTML(render.cycle_log_html(None), elem_id="dfs-chat-log")
                        with gr.Column():
                            c_ar_counters = gr.HTML(render.counters_html(None, "Autoregressive"), elem_id="dfs-chat-ar-counters")
                            c_ar_text = gr.HTML(render.tokens_html(None, AR_PLACEHOLDER), elem_id="dfs-chat-ar")
                    c_live = gr.Textbox(visible="hidden", elem_id="dfs-chat-live-update")
                    c_history = gr.State([])

        with gr.Tab("Teaching mode"):
            gr.Markdown(explanation_md())
            with gr.Row():
                t_pair = gr.Dropdown(choices=choices, value=default, label="Pair")
                t_block = gr.Slider(2, 16, value=16, step=1, label="Block size")
                t_max = gr.Slider(8, min(256, limit), value=min(64, limit), step=1, label="Max new tokens")
            t_prompt = gr.Textbox(label="Prompt", value=EXAMPLES[1], lines=2)
            with gr.Row():
                t_start = gr.Button("Start", variant="primary", elem_id="dfs-teach-start")
                t_prev = gr.Button("◀ Previous cycle")
                t_next = gr.Button("Next cycle ▶", elem_id="dfs-teach-next")
            t_state = gr.State(None)
            t_step = gr.HTML(elem_id="dfs-teach-step")
            t_formula = gr.Markdown()
            t_text = gr.HTML()

        def tick(live_pair: str, chat_pair: str) -> tuple:
            # The thinking boxes follow the default pair's loading (each tick until it is ready).
            return (*studio.model_status(), thinking_box(service, live_pair), thinking_box(service, chat_pair))

        status_timer.tick(tick, [pair, c_pair], [model_status, status_timer, thinking, c_thinking], queue=False,
                          api_visibility="private")
        pair.change(lambda p: thinking_box(service, p, load=True), pair, thinking, api_visibility="private")
        c_pair.change(lambda p: thinking_box(service, p, load=True), c_pair, c_thinking, api_visibility="private")
        studio.views = LiveViews(status=status, dflash_text=d_text, dflash_counters=d_counters, ar_text=a_text,
                                 ar_counters=a_counters, speedup=speedup, log=log, live_update=live_update,
                                 plots=plots)
        # No progress overlays on the outputs: the status line says what runs, and the browser
        # keeps its time for the live updates. Progress is tracked on a State, which draws nothing:
        # each output tracked would run its own timer loop, visible or not, every frame of the run.
        go_btn.click(gpu(studio.compare), [pair, prompt, block, temperature, max_new, seed, baseline, adaptive, tree, lookup,
                                           thinking],
                     studio.views.all(), show_progress="hidden", show_progress_on=untracked,
                     concurrency_id="engine", concurrency_limit=1, api_visibility="private")
        live_update.change(None, live_update, None, js=APPLY_LIVE_UPDATE_JS, queue=False, api_visibility="private")
        # In the browser, not on the server: the boxes are Generate's inputs, and a round trip lost
        # the race with a Generate clicked right after the switch on a busy machine (the run then
        # used the variant before).
        variant.change(None, variant, [adaptive, tree, lookup], js=VARIANT_OPTIONS_JS, queue=False,
                       api_visibility="private")
        stop_btn.click(studio.stop, None, status, queue=False, api_visibility="private")
        t_start.click(gpu(studio.teach_start), [t_pair, t_prompt, t_block, t_max], [t_state, t_step, t_formula, t_text],
                      concurrency_id="engine", concurrency_limit=1, api_visibility="private")
        t_next.click(lambda s: studio.teach_move(s, 1), t_state, [t_state, t_step, t_formula, t_text],
                     api_visibility="private")
        t_prev.click(lambda s: studio.teach_move(s, -1), t_state, [t_state, t_step, t_formula, t_text],
                     api_visibility="private")
        chat = studio.chat = Chat(studio, VARIANTS, variant_name)
        chat.views = ChatViews(conversation=c_conv, history=c_history, message=c_message, status=c_status,
                               counters=c_counters, ar_counters=c_ar_counters, ar_text=c_ar_text, speedup=c_speedup,
                               log=c_log, live_update=c_live, answer=c_answer)
        chat_settings = [c_system, c_block, c_temperature, c_max, c_seed, c_baseline, c_variant, c_thinking]
        for trigger in (c_send.click, c_message.submit):
            trigger(gpu(chat.send), [c_pair, c_message, c_history, *chat_settings], chat.views.all(), show_progress="hidden",
                    show_progress_on=untracked, concurrency_id="engine", concurrency_limit=1, api_visibility="private")
        c_regen.click(gpu(chat.regenerate), [c_pair, c_history, *chat_settings], chat.views.all(), show_progress="hidden",
                      show_progress_on=untracked, concurrency_id="engine", concurrency_limit=1, api_visibility="private")
        c_time.click(gpu(chat.time_answer), [c_answer, c_history], chat.views.all(), show_progress="hidden",
                     show_progress_on=untracked, concurrency_id="engine", concurrency_limit=1, api_visibility="private")
        c_clear.click(chat.clear, None, chat.views.all(), queue=False, api_visibility="private")
        c_stop.click(studio.stop, None, c_status, queue=False, api_visibility="private")
        c_live.change(None, c_live, None, js=APPLY_LIVE_UPDATE_JS, queue=False, api_visibility="private")
        gr.api(gpu(studio.api_generate), api_name="generate", concurrency_id="engine", concurrency_limit=1)
        gr.api(service.engines_status, api_name="status", queue=False)
    return studio, demo


def css() -> str:
    return (STATIC / "studio.css").read_text(encoding="utf-8")
