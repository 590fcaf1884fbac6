"""The studio, really launched (``python -m app``) and driven by gradio_client and a browser."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dflash_core import cli

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Name three colours of the rainbow."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url():
    port = _free_port()
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    env.pop("GRADIO_SERVER_NAME", None)
    proc = subprocess.Popen([sys.executable, "-m", "app"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"app exited early:\n{proc.stdout.read()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("app did not start in 180 s")
    yield url
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def client(app_url):
    from gradio_client import Client

    return Client(app_url, verbose=False)


def default_pair() -> str:
    from dflash_core.registry import load_registry

    return load_registry().default


def test_binds_loopback_only(app_url):
    assert app_url.startswith("http://127.0.0.1:")


def test_updates_arrive_once_per_cycle_and_final_text_equals_the_cli(client, capsys):
    job = client.submit(PROMPT, 48, 16, 0.0, default_pair(), api_name="/generate")
    updates = list(job)
    cycles = [u["cycle"] for u in updates]
    assert cycles == list(range(len(cycles))), cycles  # one update per cycle, none skipped or doubled
    final = updates[-1]
    assert final["finish_reason"] in ("stop", "length")
    assert sum(len(u["committed"]) for u in updates) == final["tokens"] == len(final["token_ids"])
    for u in updates[1:]:
        assert len(u["committed"]) == min(u["num_accepted"] + 1, len(u["committed"]))
    assert cli.main(["generate", "--json", "--prompt", PROMPT, "--max-new-tokens", "48", "--pair", default_pair()]) == 0
    out = json.loads(capsys.readouterr().out)
    assert final["token_ids"] == out["token_ids"]
    assert final["text"] == out["text"]


def test_cancelling_stops_the_run_and_the_next_request_works(client):
    job = client.submit("Write a long story about a dragon.", 1500, 16, 0.0, default_pair(), api_name="/generate")
    seen = 0
    for _ in job:
        seen += 1
        if seen >= 3:
            job.cancel()
            break
    time.sleep(1.0)
    started = time.time()
    result = client.predict("Say hi.", 8, 16, 0.0, default_pair(), api_name="/generate")
    assert result["finish_reason"] in ("stop", "length")
    assert time.time() - started < 60  # not stuck behind the cancelled 1500-token run


def test_bad_input_is_refused_and_the_app_keeps_serving(client):
    from gradio_client.exceptions import AppError

    for args, message in [(("", 8, 16, 0.0, ""), "the prompt is empty"),
                          (("hi", 0, 16, 0.0, ""), "max_new_tokens = 0"),
                          (("hi", 8, 99, 0.0, ""), "block_size = 99"),
                          (("hi", 8, 16, -2.0, ""), "temperature = -2.0"),
                          (("hi", 8, 16, 0.0, "nope"), "unknown pair 'nope'"),
                          (("hi", 8, 16, 0.0, "qwen3-8b"), "needs CUDA")]:
        with pytest.raises(AppError, match=message):
            client.predict(*args, api_name="/generate")
    assert client.predict("Say hi.", 4, 16, 0.0, "", api_name="/generate")["tokens"] >= 1


@pytest.mark.browser
def test_real_browser_runs_a_generation_and_shows_coloured_tokens_and_plots(app_url, tmp_path):
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.fail("Debian's chromium is not installed: run `make browser`")
    shot = Path(os.environ.get("DFLASH_SCREENSHOT", tmp_path / "studio.png"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"])
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        page.goto(app_url, wait_until="load")
        page.wait_for_selector("#dfs-generate", timeout=60_000)
        page.locator("#dfs-prompt textarea").fill("Write a Python function that adds two numbers.")
        page.locator("#dfs-generate").click()
        page.wait_for_function(
            "() => (document.querySelector('#dfs-status')?.innerText || '').includes('done')", timeout=240_000)
        assert page.locator("#dfs-dflash .tok-target").count() >= 1
        assert page.locator("#dfs-dflash .tok").count() >= 5
        assert page.locator("#dfs-ar .tok-ar").count() >= 5
        assert page.locator("#dfs-plot-race .js-plotly-plot, #dfs-plot-race .plotly").count() >= 1
        assert "faster" in page.locator("#dfs-speedup").inner_text()
        title = page.locator("#dfs-dflash .tok").first.get_attribute("title")
        assert "cycle" in title
        shot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shot), full_page=True)
        # Stop really stops: a long run, Stop, then the status says so.
        page.locator("#dfs-prompt textarea").fill("Tell me a very long story about the sea.")
        page.locator("#dfs-generate").click()
        page.wait_for_function("() => (document.querySelector('#dfs-status')?.innerText || '').includes('running')",
                               timeout=120_000)
        page.locator("#dfs-stop").click()
        page.wait_for_function("() => (document.querySelector('#dfs-status')?.innerText || '').includes('stopped')",
                               timeout=60_000)
        # A tab closed in the middle of a run frees the engine: a new tab is served normally.
        page.locator("#dfs-prompt textarea").fill("Tell me a very long story about mountains.")
        page.locator("#dfs-generate").click()
        page.wait_for_function("() => (document.querySelector('#dfs-status')?.innerText || '').includes('running')",
                               timeout=120_000)
        page.close()
        fresh = browser.new_page(viewport={"width": 1400, "height": 1800})
        fresh.goto(app_url, wait_until="load")
        fresh.wait_for_selector("#dfs-generate", timeout=60_000)
        fresh.locator("#dfs-prompt textarea").fill("Say hi.")
        fresh.locator("#dfs-generate").click()
        fresh.wait_for_function(
            "() => (document.querySelector('#dfs-status')?.innerText || '').includes('done')", timeout=240_000)
        browser.close()
    assert shot.stat().st_size > 10_000
