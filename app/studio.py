"""DFlash Studio: the Gradio app.

* Live view: one update per speculative cycle — coloured tokens, the cycle log, counters.
* An honest autoregressive baseline on the same engine, run after DFlash (never at the same time)
  with its own timer, and the speedup.
* Plotly charts, a Stop button that ends the engine within one cycle, a teaching mode that steps
  through recorded cycles, and a named streaming API endpoint ``/generate``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import gradio as gr

from dflash_core.errors import DFlashError
from dflash_core.prompting import max_new_tokens_limit
from dflash_core.speculative import GenerationConfig

from . import charts, render
from .recording import RunRecord
from .service import StudioService
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
UPDATE_PLOTS_EVERY_S = 1.0  # plots are heavier than text: redraw them about once a second


class Studio:
    def __init__(self, service: StudioService) -> None:
        self.service = service
        self._stops: dict[str, threading.Event] = {}

    # ------------------------------------------------------------------------------ helpers
    def stop_event(self, session: str) -> threading.Event:
        return self._stops.setdefault(session, threading.Event())

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
    def config(block: Any, temperature: Any, max_new: Any, seed: Any) -> GenerationConfig:
        def as_int(v: Any) -> Any:
            return int(v) if isinstance(v, float) and v.is_integer() else v

        seed_value = None if seed in (None, "", -1) else as_int(seed)
        return GenerationConfig(max_new_tokens=as_int(max_new), block_size=as_int(block),
                                temperature=float(temperature) if temperature is not None else 0.0, seed=seed_value)

    # ------------------------------------------------------------------- the compare handler
    def compare(self, pair, prompt, block, temperature, max_new, seed, baseline, adaptive, tree, lookup,
                request: gr.Request):  # noqa: ANN001
        """Generator for the main view; yields a full set of outputs once per cycle."""
        session = getattr(request, "session_hash", None) or "default"
        stop = self.stop_event(session)
        stop.clear()
        state = {"status": "", "dflash": None, "ar": None, "same": None, "plots_at": 0.0}

        def outputs(final: bool = False) -> tuple:
            d, a = state["dflash"], state["ar"]
            now = time.perf_counter()
            redraw = final or now - state["plots_at"] >= UPDATE_PLOTS_EVERY_S
            if redraw:
                state["plots_at"] = now
            plots = (
                (charts.acceptance_per_cycle(d), charts.acceptance_histogram(d, int(block or 16)),
                 charts.phase_times(d), charts.race(d, a))
                if redraw else (gr.skip(),) * 4
            )
            return (
                state["status"],
                render.tokens_html(d, "DFlash output appears here, one cycle at a time."),
                render.counters_html(d, "DFlash"),
                render.tokens_html(a, "The autoregressive baseline runs after DFlash." if baseline else "Baseline off."),
                render.counters_html(a, "Autoregressive"),
                render.speedup_html(d, a, state["same"]),
                render.cycle_log_html(d),
                *plots,
            )

        try:
            engine = None
            for item in self.wait_for_engine(pair):
                if isinstance(item, str):
                    state["status"] = item
                    yield outputs()
                else:
                    engine = item
            cfg = replace(self.config(block, temperature, max_new, seed), adaptive=bool(adaptive), tree=bool(tree),
                          lookup=bool(lookup))
            ids, cfg = engine.prepare(prompt, cfg, "dflash")
            ar_cfg = engine.prepare(prompt, cfg, "ar")[1]
        except DFlashError as exc:
            state["status"] = f"⚠️ {exc}"
            yield outputs(final=True)
            return

        runs = [("dflash", cfg)] + ([("ar", ar_cfg)] if baseline else [])
        for mode, run_cfg in runs:
            if stop.is_set():
                break
            record = RunRecord(mode)
            state[mode] = record
            state["status"] = f"▶ running {'DFlash' if mode == 'dflash' else 'the autoregressive baseline'}…"
            events = engine.stream_ids(ids, run_cfg, should_stop=stop.is_set)
            try:
                for event in events:
                    record.add(event, engine.tokenizer)
                    yield outputs()
            finally:
                events.close()  # releases the engine even if the client went away mid-run
        d, a = state["dflash"], state["ar"]
        if d is not None and a is not None and a.finish_reason not in (None, "cancelled"):
            state["same"] = d.token_ids == a.token_ids if cfg.temperature == 0 else None
        cancelled = any(r is not None and r.finish_reason == "cancelled" for r in (d, a)) or stop.is_set()
        state["status"] = "⏹ stopped" if cancelled else "✓ done"
        yield outputs(final=True)

    def model_status(self) -> tuple[str, Any]:
        """Loading progress of the default pair, polled by a timer until the models are ready."""
        name = self.service.registry.default
        status = self.service.status.get(name, "starting…")
        done = status.startswith(("ready", "failed"))
        icon = "✓" if status.startswith("ready") else ("⚠" if status.startswith("failed") else "⋯")
        return f"{icon} **{name}**: {status}", gr.Timer(active=not done)

    def stop(self, request: gr.Request) -> str:
        self.stop_event(getattr(request, "session_hash", None) or "default").set()
        return "⏹ stopping after the current cycle…"

    # ------------------------------------------------------------------------- teaching mode
    def teach_start(self, pair, prompt, block, max_new):  # noqa: ANN001
        try:
            engine = None
            for item in self.wait_for_engine(pair):
                if not isinstance(item, str):
                    engine = item
            cfg = self.config(block, 0.0, max_new, None)
            ids, cfg = engine.prepare(prompt, cfg, "dflash")
            dflash = RunRecord("dflash")
            for event in engine.stream_ids(ids, cfg):
                dflash.add(event, engine.tokenizer)
            # A short autoregressive run measures t_AR, the cost of one plain decoding step.
            ar_cfg = engine.prepare(prompt, GenerationConfig(max_new_tokens=min(32, cfg.max_new_tokens)), "ar")[1]
            ar = RunRecord("ar")
            for event in engine.stream_ids(ids, ar_cfg):
                ar.add(event, engine.tokenizer)
        except DFlashError as exc:
            return None, f"⚠️ {exc}", "", ""
        state = TeachingState(dflash, ar, cfg.block_size, engine.tokenizer.decode([engine.drafter.mask_token_id]))
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
        """Stream one update per speculative cycle; the last update carries the full text.

        Each update: {cycle, committed (token ids), drafted, num_accepted, bonus, text,
        tokens, tau, finish_reason}. Its inputs stay these five (raw HTTP clients send every
        input), so the Live tab's verification options are not among them.
        """
        try:
            engine = None
            for item in self.wait_for_engine(pair or self.service.registry.default):
                if not isinstance(item, str):
                    engine = item
            cfg = self.config(block_size, temperature, max_new_tokens, None)
            ids, cfg = engine.prepare(prompt, cfg, "dflash")
        except DFlashError as exc:
            raise gr.Error(str(exc)) from None
        record = RunRecord("dflash")
        events = engine.stream_ids(ids, cfg)
        try:
            for event in events:
                record.add(event, engine.tokenizer)
                yield {
                    "cycle": event.index, "committed": event.committed, "drafted": event.drafted,
                    "num_accepted": event.num_accepted, "bonus": event.bonus,
                    "text": engine.decode(record.token_ids), "tokens": record.num_tokens,
                    "tau": record.tau, "finish_reason": event.finish_reason,
                    "token_ids": record.token_ids if event.finish_reason else None,
                }
        finally:
            events.close()


def build_app(service: StudioService | None = None) -> gr.Blocks:
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
                    block = gr.Slider(1, 16, value=16, step=1, label="Block size (1 = autoregressive)")
                    temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)")
                    max_new = gr.Slider(1, limit, value=min(256, limit), step=1, label="Max new tokens", elem_id="dfs-max-new")
                    seed = gr.Number(value=0, precision=0, label="Seed (sampling)")
                    baseline = gr.Checkbox(value=True, label="Also run the autoregressive baseline")
                    adaptive = gr.Checkbox(value=False, label="Adaptive verification: verify only the drafts worth "
                                           "their cost (drafter confidence vs measured verify time)")
                    tree = gr.Checkbox(value=False, label="Tree verification: check the drafter's likeliest "
                                       "continuations as a tree in one target pass (same output)", elem_id="dfs-tree")
                    lookup = gr.Checkbox(value=False, label="Prompt lookup: also check, in the same pass, what followed "
                                         "the last tokens where they occurred before (same output)", elem_id="dfs-lookup")
                    with gr.Row():
                        go_btn = gr.Button("Generate", variant="primary", elem_id="dfs-generate")
                        stop_btn = gr.Button("Stop", variant="stop", elem_id="dfs-stop")
                    status = gr.Markdown(elem_id="dfs-status")
                    gr.Markdown(render.TIMING_NOTE, elem_classes="dfs-note")
                with gr.Column(scale=2):
                    gr.HTML(render.LEGEND)
                    with gr.Row():
                        with gr.Column():
                            d_counters = gr.HTML(render.counters_html(None, "DFlash"))
                            d_text = gr.HTML(render.tokens_html(None, "DFlash output appears here."), elem_id="dfs-dflash")
                        with gr.Column():
                            a_counters = gr.HTML(render.counters_html(None, "Autoregressive"))
                            a_text = gr.HTML(render.tokens_html(None, "Baseline output appears here."), elem_id="dfs-ar")
                    speedup = gr.HTML(render.speedup_html(None, None, None), elem_id="dfs-speedup")
                    log = gr.HTML(render.cycle_log_html(None), elem_id="dfs-log")
            with gr.Row():
                p_accept = gr.Plot(label="Acceptance length per cycle", elem_id="dfs-plot-accept")
                p_hist = gr.Plot(label="Histogram", elem_id="dfs-plot-hist")
            with gr.Row():
                p_phase = gr.Plot(label="Drafter vs verifier time", elem_id="dfs-plot-phase")
                p_race = gr.Plot(label="The race", elem_id="dfs-plot-race")

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

        status_timer.tick(studio.model_status, None, [model_status, status_timer], queue=False, api_visibility="private")
        outputs = [status, d_text, d_counters, a_text, a_counters, speedup, log, p_accept, p_hist, p_phase, p_race]
        go_btn.click(gpu(studio.compare), [pair, prompt, block, temperature, max_new, seed, baseline, adaptive, tree, lookup],
                     outputs,
                     concurrency_id="engine", concurrency_limit=1, api_visibility="private")
        stop_btn.click(studio.stop, None, status, queue=False, api_visibility="private")
        t_start.click(gpu(studio.teach_start), [t_pair, t_prompt, t_block, t_max], [t_state, t_step, t_formula, t_text],
                      concurrency_id="engine", concurrency_limit=1, api_visibility="private")
        t_next.click(lambda s: studio.teach_move(s, 1), t_state, [t_state, t_step, t_formula, t_text],
                     api_visibility="private")
        t_prev.click(lambda s: studio.teach_move(s, -1), t_state, [t_state, t_step, t_formula, t_text],
                     api_visibility="private")
        gr.api(gpu(studio.api_generate), api_name="generate", concurrency_id="engine", concurrency_limit=1)
        gr.api(service.engines_status, api_name="status", queue=False)
    return demo


def css() -> str:
    return (STATIC / "studio.css").read_text(encoding="utf-8")
