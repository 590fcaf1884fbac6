"""The studio, really launched (``python -m app``) and driven by gradio_client and a browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from app.charts import CHARTS
from dflash_core import cli
from dflash_core.testing import RUNS_TO_BUDGET, generate_in_page, open_studio, wait_for_status

pytestmark = pytest.mark.slow
PROMPT = "Name three colours of the rainbow."


def default_pair() -> str:
    from dflash_core.registry import load_registry

    return load_registry().default


def test_the_queue_looks_for_work_every_20_ms_not_every_millisecond():
    """Gradio polls its queue every 1 ms on Linux, in a thread that shares Python's lock with the
    engine's; the studio slows that down (a Gradio that renames the setting fails here)."""
    from app.service import StudioService
    from app.studio import QUEUE_POLL_S, build_app, queue_app

    demo = build_app(StudioService(warm_up=False))
    assert queue_app(demo, max_size=8)
    assert demo._queue.sleep_when_free == QUEUE_POLL_S == 0.02
    assert demo._queue.max_size == 8


def test_the_speedup_says_slower_when_dflash_was_slower():
    # A verify pass dearer than the drafts it keeps (a CPU's plain DFlash with a weak drafter):
    # the page and the chat must not say "0.48× faster".
    from app import chat, render
    from app.recording import RunRecord

    assert render.speedup_parts(163.79, 84.95) == ("1.93×", "faster than the target alone (163.8 vs 85.0 tok/s)")
    assert render.speedup_parts(40.62, 92.63) == ("0.44×", "the speed of the target alone (40.6 vs 92.6 tok/s): slower here")
    assert render.speedup_parts(99.8, 100.0)[1].startswith("faster")  # 1.00× when rounded: not "slower"
    # 41 tokens: 40 after the first, decoded in 40 / 40.62 s (DFlash) and 40 / 92.63 s (AR)
    dflash, ar = (RunRecord(mode, token_ids=list(range(41)), first_token_s=0.0, elapsed_s=40 / rate)
                  for mode, rate in (("dflash", 40.62), ("ar", 92.63)))
    assert "<b>0.44×</b> the speed of the target alone (40.6 vs 92.6 tok/s): slower here · identical output ✓" in \
        render.speedup_html(dflash, ar, True)
    assert chat.speedup_sentence(dflash, ar, True) == \
        "0.44× the speed of the target alone (40.6 vs 92.6 tok/s): slower here · identical output ✓"


def test_the_cycle_log_names_where_each_cycles_guesses_came_from():
    from app.recording import CycleRecord
    from app.render import cycle_html

    def cycle(**lookups: int) -> str:
        return cycle_html(CycleRecord(index=3, drafted=["a", "b", "c"], confidence=[0.9, 0.8, 0.7], num_accepted=2,
                                      bonus="d", target_choices=["a", "b", "x", "d"], committed=3, draft_s=0.001,
                                      verify_s=0.005, at_s=0.1, tokens_so_far=9, **lookups))

    both = cycle(lookup_nodes=2, answer_nodes=3, lookup_drafted=3, lookup_only=True)
    assert "2 from prompt lookup" in both and "3 from earlier answers" in both and "drafter skipped" in both
    assert both.count("tok-lookup") == 3  # every shown draft a guess's
    drafter_only = cycle()
    assert "from prompt lookup" not in drafter_only and "from earlier answers" not in drafter_only
    assert "tok-lookup" not in drafter_only


def test_binds_loopback_only(app_server):
    import psutil

    url, proc = app_server
    port = int(url.rstrip("/").rsplit(":", 1)[1])
    listening = [c.laddr for c in psutil.Process(proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert listening and all(addr.ip in ("127.0.0.1", "::1") for addr in listening), listening


def test_updates_carry_every_cycle_once_and_final_text_equals_the_cli(client, capsys):
    submitted = time.perf_counter()
    job = client.submit(PROMPT, 48, 16, 0.0, default_pair(), api_name="/generate")
    updates = list(job)
    wall_s = time.perf_counter() - submitted
    cycles = [c for u in updates for c in u["cycles"]]
    assert cycles == list(range(len(cycles))), cycles  # every cycle once, in order, in batches
    final = updates[-1]
    assert final["finish_reason"] in ("stop", "length")
    assert all(u["finish_reason"] is None and u["token_ids"] is None for u in updates[:-1])
    assert all(u["prefill_s"] is None and u["decode_s"] is None for u in updates[:-1])
    # The engine's own times, inside the client's: the rest is the transport's.
    assert final["prefill_s"] > 0 and final["decode_s"] > 0
    assert final["prefill_s"] + final["decode_s"] < wall_s
    assert sum(len(u["committed"]) for u in updates) == final["tokens"] == len(final["token_ids"])
    assert [t for u in updates for t in u["committed"]] == final["token_ids"]
    for u in updates:
        assert u["cycle"] == u["cycles"][-1] and u["num_accepted"] == u["accepted"][-1]
        assert len(u["cycles"]) == len(u["accepted"]) == len(u["lengths"]) and sum(u["lengths"]) == len(u["committed"])
        for cycle, accepted, length in zip(u["cycles"], u["accepted"], u["lengths"]):
            assert length == 1 if cycle == 0 else 1 <= length <= accepted + 1
    assert cli.main(["generate", "--json", "--prompt", PROMPT, "--max-new-tokens", "48", "--pair", default_pair()]) == 0
    out = json.loads(capsys.readouterr().out)
    assert final["token_ids"] == out["token_ids"]
    assert final["text"] == out["text"]


def wait_until_idle(client, pair: str, timeout: float = 30.0) -> dict:
    """The pair's engine status once it is no longer generating."""
    deadline = time.time() + timeout
    while True:
        status = client.predict(api_name="/status")[pair]
        if not status["busy"] or time.time() > deadline:
            return status
        time.sleep(0.2)


def test_cancelling_stops_the_run_and_the_next_request_works(client):
    pair = default_pair()
    job = client.submit(RUNS_TO_BUDGET, 1500, 16, 0.0, pair, api_name="/generate")
    seen = 0
    for _ in job:
        seen += 1
        if seen >= 3:
            job.cancel()  # what a dropped client amounts to: nobody pulls the stream any more
            break
    status = wait_until_idle(client, pair)
    assert not status["busy"], status
    run = status["last_run"]
    assert run["finish_reason"] in ("abandoned", "cancelled"), run
    # The engine runs ahead of the stream by up to one update's worth of cycles; the cancel
    # reaches it at the handler's next update, and it stops after the cycle under way.
    assert run["tokens"] < 1500, run
    result = client.predict("Say hi.", 8, 16, 0.0, pair, api_name="/generate")
    assert result["finish_reason"] in ("stop", "length")
    assert client.predict(api_name="/status")[pair]["last_run"]["finish_reason"] == result["finish_reason"]


def _json_safe(args: tuple) -> bool:
    try:
        json.dumps(args, allow_nan=False).encode("utf-8")
        json.dumps(args, ensure_ascii=False).encode("utf-8")
        return True
    except (ValueError, UnicodeEncodeError):
        return False


def raw_call(url: str, args: tuple) -> str:
    """Call /generate over gradio's plain HTTP API with hand-written JSON; the event stream's text."""
    body = json.dumps({"data": list(args)}).encode("ascii")  # \ud800 escaped, NaN written as NaN
    base = url.rstrip("/") + "/gradio_api/call/generate"
    request = urllib.request.Request(base, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        event_id = json.loads(r.read())["event_id"]
    with urllib.request.urlopen(f"{base}/{event_id}", timeout=120) as r:
        return r.read().decode("utf-8", "replace")


def test_bad_input_is_refused_and_the_app_keeps_serving(client):
    """Every row of the bad-input table (dflash_core.testing.BAD_INPUT_ROWS), through the running app."""
    from gradio_client.exceptions import AppError

    from dflash_core.testing import BAD_INPUT_ROWS

    for name, prompt, settings, message in BAD_INPUT_ROWS:
        s = {"max_new_tokens": 8, "block_size": 16, "temperature": 0.0, **settings}
        args = (prompt, s["max_new_tokens"], s["block_size"], s["temperature"], "")
        if not _json_safe(args):
            # gradio_client cannot even send a lone surrogate or a NaN; a browser can (JSON.stringify
            # escapes the one, hand-made requests the other), so send the raw request ourselves.
            assert message.split(";")[0] in raw_call(client.src, args), name
            continue
        if message is None:
            assert client.predict(*args, api_name="/generate")["tokens"] >= 1, name
        else:
            with pytest.raises(AppError, match=re.escape(message.split(";")[0])):
                client.predict(*args, api_name="/generate")
    for pair, message in (("nope", "unknown pair 'nope'"), ("qwen3-8b", "needs CUDA")):
        with pytest.raises(AppError, match=message):
            client.predict("hi", 8, 16, 0.0, pair, api_name="/generate")
    assert client.predict("Say hi.", 4, 16, 0.0, "", api_name="/generate")["tokens"] >= 1


@pytest.mark.browser
def test_real_browser_runs_a_generation_and_shows_coloured_tokens_and_plots(app_url, tmp_path, capsys):
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.fail("Debian's chromium is not installed: run `make browser`")
    shot = Path(os.environ.get("DFLASH_SCREENSHOT", tmp_path / "studio.png"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"])
        page = open_studio(browser, app_url)
        # The defaults: the fastest variant (tree + prompt lookup + adaptive), named on the page.
        prompt = "Write a Python class Point with x and y, and methods add and sub."
        generate_in_page(page, prompt, until="done", max_new_tokens=96)
        assert "tree + prompt lookup + adaptive" in page.locator("#dfs-status").inner_text()
        assert page.locator("#dfs-dflash .tok-target").count() >= 1
        assert page.locator("#dfs-dflash .tok").count() >= 5
        assert page.locator("#dfs-ar .tok-ar").count() >= 5
        # Every declared chart comes with the last update, with the run's data in it (the page opens
        # with them drawn empty, traceless); plotly draws them after the status says done.
        for chart in CHARTS:
            page.wait_for_selector(f"#dfs-plot-{chart.name} .js-plotly-plot g.trace", timeout=30_000)
        speedup = page.locator("#dfs-speedup").inner_text()
        assert re.search(r"[\d.]+× (?:faster than|the speed of) the target alone \([\d.]+ vs [\d.]+ tok/s\)(?:: slower here)?", speedup), speedup
        assert "identical output" in speedup
        # Each cycle in the log with its tokens and times (whether the adaptive variant verified trees
        # or skipped the drafter is the costs it measured on this machine: the tree-alone run below
        # shows a tree's row).
        assert re.search(r"#\d+ \d+ token\(s\) · draft \d+ ms · verify \d+ ms", page.locator("#dfs-log").inner_text())
        title = page.locator("#dfs-dflash .tok").first.get_attribute("title")
        assert "cycle" in title
        # What the page shows is the CLI's greedy text, for the same prompt and settings.
        shown = page.evaluate("() => Array.from(document.querySelectorAll('#dfs-dflash .tok:not(.tok-special)'))"
                              ".map(e => e.textContent).join('')")
        assert cli.main(["generate", "--json", "--prompt", prompt, "--max-new-tokens", "96", "--tree", "--lookup",
                         "--adaptive"]) == 0
        assert shown == json.loads(capsys.readouterr().out)["text"]
        shot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shot), full_page=True)
        # Stop really stops: a long run, Stop, then the status says so.
        generate_in_page(page, RUNS_TO_BUDGET, until="running", max_new_tokens=1500)
        # While it runs, the page's own event stream brings the tokens and the counters live.
        page.wait_for_function("() => document.querySelectorAll('#dfs-dflash .tok').length >= 3"
                               " && (document.querySelector('#dfs-dflash-counters')?.innerText || '').includes('running')"
                               " && (document.querySelector('#dfs-status')?.innerText || '').includes('running')",
                               timeout=60_000)
        page.locator("#dfs-stop").click()
        wait_for_status(page, "stopped", 60_000)
        # A tab closed in the middle of a run frees the engine: a new tab is served normally.
        generate_in_page(page, RUNS_TO_BUDGET, until="running", max_new_tokens=1500)
        page.close()
        from gradio_client import Client

        status = wait_until_idle(Client(app_url, verbose=False), default_pair(), timeout=60)
        assert not status["busy"] and status["last_run"]["finish_reason"] == "abandoned", status
        assert status["last_run"]["tokens"] < 1500
        page = open_studio(browser, app_url)
        # Plain DFlash, as published, is one click away; prompt lookup's drafts show in the log
        # when it is on. The switch sets the verification boxes in the browser, asking the server
        # nothing: a Generate clicked right after it once raced that round trip on a busy machine.
        page.get_by_text("Verification options").click()
        page.wait_for_selector("#dfs-lookup input:checked", timeout=10_000)
        # The switch's own events (by the page's config), so that a late call of another event on
        # a busy machine (seen once in a full suite: one run/predict) does not count as the switch's.
        switch_events = page.evaluate("""() => {
            const config = window.gradio_config;
            const id = config.components.find((c) => c.props && c.props.elem_id === 'dfs-variant').id;
            return config.dependencies.filter((d) => d.targets.some((t) => t[0] === id)).map((d) => d.id);
        }""")
        assert switch_events, "the variant switch has no event in the page's config"
        calls: list[tuple[str, dict]] = []
        page.on("request", lambda request: calls.append((request.url, json.loads(request.post_data or "{}")))
                if "/run/" in request.url or "/queue/join" in request.url else None)
        page.locator("#dfs-variant input[value=plain]").check()
        page.wait_for_function("() => ['adaptive', 'tree', 'lookup'].every("
                               "(box) => document.querySelector(`#dfs-${box} input`).checked === false)", timeout=10_000)
        assert not [call for call in calls if call[1].get("fn_index") in switch_events], (switch_events, calls)
        generate_in_page(page, "Say hi.", until="done")
        assert "plain DFlash" in page.locator("#dfs-status").inner_text()
        assert "tree of" not in page.locator("#dfs-log").inner_text()
        page.locator("#dfs-tree input").check()  # a tree alone: every cycle verifies a tree of drafts
        generate_in_page(page, prompt, until="running", max_new_tokens=48)
        wait_for_status(page, "done", 240_000)
        assert "tree of" in page.locator("#dfs-log").inner_text()
        # Prompt lookup's guesses grafted into every tree (not adaptive: whether the adaptive
        # variant verifies a guess is the costs and chances it measured, which a busy machine
        # moves; a full suite once ran the fastest variant's 64 tokens here without one).
        page.locator("#dfs-lookup input").check()
        generate_in_page(page, prompt, until="running", max_new_tokens=48)
        wait_for_status(page, "done", 240_000)  # "done" of this run, not of the one before
        variant_shown = page.locator("#dfs-status").inner_text()
        assert "tree + prompt lookup" in variant_shown and "adaptive" not in variant_shown, variant_shown
        assert "from prompt lookup" in page.locator("#dfs-log").inner_text()
        assert page.locator("#dfs-log .tok-lookup").count() >= 1
        # The fastest variant is one click back: every box checked again.
        page.locator("#dfs-variant input[value=fastest]").check()
        page.wait_for_function("() => ['adaptive', 'tree', 'lookup'].every("
                               "(box) => document.querySelector(`#dfs-${box} input`).checked === true)", timeout=10_000)
        browser.close()
    assert shot.stat().st_size > 10_000


FRAMES_IN = """(ms) => new Promise((done) => {
  let frames = 0;
  const began = performance.now();
  const loop = () => { frames++; if (performance.now() - began < ms) requestAnimationFrame(loop); else done(frames); };
  requestAnimationFrame(loop);
})"""


def test_runs_track_their_progress_on_nothing_drawn(app_url):
    """Each output a running event tracks gets a status tracker whose timer loop runs every frame
    of the run, shown or not; the timed runs track theirs on a State, which draws nothing."""
    with urllib.request.urlopen(app_url + "config", timeout=30) as r:
        config = json.loads(r.read())
    kinds = {c["id"]: c["type"] for c in config["components"]}
    elem = {c.get("props", {}).get("elem_id"): c["id"] for c in config["components"]}
    for button in ("dfs-generate", "dfs-chat-send", "dfs-chat-regenerate", "dfs-chat-time"):
        runs = [d for d in config["dependencies"] if any(t[0] == elem[button] for t in d["targets"])]
        assert len(runs) == 1 and len(runs[0]["outputs"]) > 5, button
        assert runs[0]["show_progress"] == "hidden"
        assert [kinds[i] for i in runs[0]["show_progress_on"]] == ["state"], button


def test_an_untouched_page_asks_for_few_animation_frames_and_input_lifts_the_budget(app_url):
    """Gradio's page keeps animation-frame loops running for as long as it is open (60 a second,
    on the cores the engine is timed on); the studio's page hands frames over a few times a second
    while nobody touches it, and at the display's rate for a while after any input."""
    from playwright.sync_api import sync_playwright

    from app.frame_budget import ACTIVE_S, IDLE_FRAMES_PER_S

    # The script comes before Gradio's modules, which keep their own requestAnimationFrame.
    with urllib.request.urlopen(app_url, timeout=30) as r:
        html = r.read().decode()
    assert html.index("dfsFrameBudget") < html.index('type="module"') < html.index("</head>")
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = open_studio(browser, app_url)
        # The charts are drawn, empty, before any run (plotly.js loads with the page).
        for chart in CHARTS:
            page.wait_for_selector(f"#dfs-plot-{chart.name} .js-plotly-plot", timeout=30_000)
            assert page.locator(f"#dfs-plot-{chart.name} g.trace").count() == 0
        time.sleep(ACTIVE_S + 0.5)  # no input since the page opened
        assert page.evaluate("() => window.dfsFrameBudget.throttled()")
        # Unbudgeted, a frame loop runs ~60 times a second; a busy machine only lowers the count.
        assert page.evaluate(FRAMES_IN, 2000) <= 2 * IDLE_FRAMES_PER_S + 3
        # A cancelled frame callback is never called, budgeted or not.
        assert page.evaluate("""() => new Promise((done) => {
          let called = false;
          cancelAnimationFrame(requestAnimationFrame(() => { called = true; }));
          setTimeout(() => done(called), 600);
        })""") is False
        page.mouse.move(50, 50)
        page.mouse.move(300, 200)
        assert not page.evaluate("() => window.dfsFrameBudget.throttled()")
        # Input lifts the budget, but not for Gradio's status-tracker timers (told apart by the
        # script they come from): the same loop from a script of that name stays on the budget.
        ordinary, tracker = page.evaluate(f"""(ms) => Promise.all([({FRAMES_IN})(ms),
          (0, eval)('(' + ({FRAMES_IN}).toString() + ')\\n//# sourceURL=statustracker-probe.js')(ms)])""", 1000)
        assert tracker <= IDLE_FRAMES_PER_S + 3 < ordinary
        # The page still works: a Generate after the idle spell shows its tokens and plots.
        generate_in_page(page, PROMPT, until="done", max_new_tokens=16)
        assert page.locator("#dfs-dflash .tok").count() >= 3
        page.wait_for_selector(f"#dfs-plot-{CHARTS[0].name} .js-plotly-plot g.trace", timeout=30_000)
        browser.close()
