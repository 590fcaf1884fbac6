"""What the studio shows against what the CLI measures, on the same prompt and settings.

Launches the studio (``python -m app``), opens it in Debian's Chromium through Playwright, runs the
default example with the default settings (and, with ``--variants fastest,plain``, each variant
the page offers), reads the speedup sentence and counters the page shows, runs ``python -m dflash_core generate``
for the same prompt and settings (AR, and each variant), times ``/generate`` through gradio_client
with the browser closed, and prints both side by side. After each Generate it waits
until the browser has drawn the results and is idle again, as a user reading them would; it also
reports the browser's CPU idle and during each run, and the page's renderer time by kind. Within
one studio's lifetime a Generate on the page and the CLI right after it alternate ``--repeats``
times (the page open and idle while the CLI runs), so the shared machine's drift falls on both
sides of each pair alike; it prints every pair and the median (range) of their ratios.

    python scripts/studio_bench.py [--rounds 1] [--repeats 3] [--variants fastest,plain] [--out runs/studio_bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEEDUP = re.compile(r"([\d.]+)×\s*(?:faster than|the speed of) the target alone \(([\d.]+) vs ([\d.]+) tok/s\)")
CLI_FLAGS = {"fastest": ["--tree", "--lookup", "--adaptive"], "plain": []}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_studio(port: int) -> subprocess.Popen:
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False"}
    proc = subprocess.Popen([sys.executable, "-m", "app"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the studio did not start in 240 s")


def browser_cpu_s(executable: str) -> float:
    """CPU seconds used so far by every running process of the browser (user + system)."""
    import psutil

    total = 0.0
    for proc in psutil.process_iter(["exe", "cpu_times"]):
        exe, times = proc.info.get("exe"), proc.info.get("cpu_times")
        if exe and times and Path(exe).name.startswith(Path(executable).name):
            total += times.user + times.system
    return total


# The page's renderer main thread, from Chrome's Performance domain: seconds spent in all tasks,
# in scripts, in layout and in style recalculation (where the browser's share of the cores goes).
RENDERER_METRICS = {"TaskDuration": "task_s", "ScriptDuration": "script_s", "LayoutDuration": "layout_s",
                    "RecalcStyleDuration": "style_s", "LayoutCount": "layouts"}


def renderer_metrics(cdp) -> dict[str, float]:  # noqa: ANN001
    metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
    return {key: metrics.get(name, 0.0) for name, key in RENDERER_METRICS.items()}


def idle_browser_core(browser_exe: str, seconds: float = 5.0) -> float:
    """The share of a core the browser uses with the page open and nothing running."""
    cpu_before, wall_before = browser_cpu_s(browser_exe), time.perf_counter()
    time.sleep(seconds)
    return (browser_cpu_s(browser_exe) - cpu_before) / (time.perf_counter() - wall_before)


def settle(browser_exe: str, below: float = 0.05, window_s: float = 0.5, limit_s: float = 15.0) -> None:
    """Wait until the browser has drawn what the last run ended with (the plots come after the
    status says done) and is idle again, as a user reading the result gives it time to."""
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline and idle_browser_core(browser_exe, window_s) >= below:
        pass


def page_run(page, cdp, variant: str, max_new_tokens: int, browser_exe: str) -> dict:  # noqa: ANN001
    """One Generate on the open page with the default example; what the page then shows, the
    share of a core the browser used while it ran (rendering competes with the engine), and the
    renderer main thread's time by kind."""
    page.locator(f"#dfs-variant input[value={variant}]").check()
    page.locator("#dfs-max-new input[type=number]").fill(str(max_new_tokens))
    page.locator("#dfs-max-new input[type=number]").press("Enter")
    metrics_before = renderer_metrics(cdp)
    cpu_before, wall_before = browser_cpu_s(browser_exe), time.perf_counter()
    page.locator("#dfs-generate").click()
    page.wait_for_function("() => (document.querySelector('#dfs-status')?.innerText || '').includes('running')",
                           timeout=240_000)
    # Polled twice a second, not every frame: reading innerText each frame is work for the browser
    # on the cores the engine is being timed on.
    page.wait_for_function("() => (document.querySelector('#dfs-status')?.innerText || '').includes('done')",
                           timeout=600_000, polling=500)
    wall = time.perf_counter() - wall_before
    browser_core = (browser_cpu_s(browser_exe) - cpu_before) / wall
    renderer = {key: round((value - metrics_before[key]) / (1 if key == "layouts" else wall), 4)
                for key, value in renderer_metrics(cdp).items()}
    settle(browser_exe)
    text = page.locator("#dfs-speedup").inner_text()
    match = SPEEDUP.search(text)
    if not match:
        raise RuntimeError(f"no speedup sentence on the page: {text!r}")
    return {"speedup": float(match.group(1)), "dflash_tok_s": float(match.group(2)),
            "ar_tok_s": float(match.group(3)), "sentence": text.strip(), "browser_core": browser_core,
            "renderer": renderer,
            "dflash_text": page.evaluate("() => Array.from(document.querySelectorAll("
                                         "'#dfs-dflash .tok:not(.tok-special)')).map(e => e.textContent).join('')")}


def api_run(port: int, prompt: str, max_new_tokens: int) -> dict:
    """/generate through gradio_client (plain DFlash: its five inputs have no variant), timed
    end to end: from submitting to the last update."""
    from gradio_client import Client

    client = Client(f"http://127.0.0.1:{port}/", verbose=False)
    started = time.perf_counter()
    final = client.predict(prompt, max_new_tokens, 16, 0.0, "", api_name="/generate")
    wall_s = time.perf_counter() - started
    engine_s = final["prefill_s"] + final["decode_s"]  # the engine's own, inside the studio
    return {"tok_s": final["tokens"] / wall_s, "engine_tok_s": final["tokens"] / engine_s,
            "transport_s": wall_s - engine_s, "text": final["text"]}


def cli_run(prompt: str, mode: str, flags: list[str], max_new_tokens: int) -> dict:
    cmd = [sys.executable, "-m", "dflash_core", "generate", "--json", "--prompt", prompt, "--mode", mode,
           "--max-new-tokens", str(max_new_tokens), *flags]
    out = json.loads(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    # The page's definition: tokens after the first over the time after the first.
    return {"tok_s": (out["num_tokens"] - 1) / out["decode_s"], "tau": out["tau"], "text": out["text"],
            "end_to_end_tok_s": out["num_tokens"] / (out["prefill_s"] + out["decode_s"])}


def spread(values: list[float]) -> str:
    """A median with its range, as percentages: "97% (88-104%)"."""
    return f"{statistics.median(values):.0%} ({min(values):.0%}-{max(values):.0%})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="studio processes, one after another")
    parser.add_argument("--repeats", type=int, default=3,
                        help="within each studio's lifetime: a Generate on the page, then the CLI, this many times")
    parser.add_argument("--variants", default="fastest,plain")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(ROOT))
    from app.studio import EXAMPLES

    prompt = EXAMPLES[0]
    variants = args.variants.split(",")
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    rows: list[dict] = []
    api_rows: list[dict] = []
    for round_index in range(args.rounds):
        port = free_port()
        studio = start_studio(port)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1400, "height": 1800})
                page.goto(f"http://127.0.0.1:{port}/", wait_until="load")
                page.wait_for_function("() => (document.querySelector('#dfs-model-status')?.innerText || '')"
                                       ".includes('ready')", timeout=300_000)
                cdp = page.context.new_cdp_session(page)
                cdp.send("Performance.enable")
                idle_core = idle_browser_core(chromium)
                # Page, then CLI, then page again, in one studio's lifetime: the machine's drift
                # falls on both sides of each pair alike, and the CLI runs while the page is open
                # and idle, as "the CLI right after" does for a user.
                for repeat in range(args.repeats):
                    shown = {variant: page_run(page, cdp, variant, args.max_new_tokens, chromium) for variant in variants}
                    cli_ar = cli_run(prompt, "ar", [], args.max_new_tokens)
                    for variant in variants:
                        cli = cli_run(prompt, "dflash", CLI_FLAGS[variant], args.max_new_tokens)
                        page_row = shown[variant]
                        rows.append({
                            "round": round_index, "repeat": repeat, "variant": variant,
                            "page_ar_tok_s": page_row["ar_tok_s"], "cli_ar_tok_s": round(cli_ar["tok_s"], 2),
                            "page_dflash_tok_s": page_row["dflash_tok_s"], "cli_dflash_tok_s": round(cli["tok_s"], 2),
                            "page_speedup": page_row["speedup"], "cli_speedup": round(cli["tok_s"] / cli_ar["tok_s"], 3),
                            "cli_tau": cli["tau"], "same_text": page_row["dflash_text"] == cli["text"],
                            "browser_core": round(page_row["browser_core"], 3), "browser_idle_core": round(idle_core, 3),
                            "renderer_per_s": page_row["renderer"],
                        })
                browser.close()
            # /generate with no browser open (a Space's browser is remote), each call paired with
            # the CLI right after it.
            for repeat in range(args.repeats):
                api = api_run(port, prompt, args.max_new_tokens)
                cli_plain = cli_run(prompt, "dflash", [], args.max_new_tokens)
                api_rows.append({"round": round_index, "repeat": repeat, "api_tok_s": round(api["tok_s"], 2),
                                 "api_engine_tok_s": round(api["engine_tok_s"], 2),
                                 "transport_s": round(api["transport_s"], 3),
                                 "cli_tok_s": round(cli_plain["end_to_end_tok_s"], 2),
                                 "same_text": api["text"] == cli_plain["text"]})
        finally:
            studio.terminate()
            studio.wait(30)
    print("| round.repeat | variant | AR page / CLI tok/s | DFlash page / CLI tok/s | speedup page / CLI | page/CLI speedup "
          "| browser CPU while running (share of a core) | same text |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']}.{r['repeat']} | {r['variant']} | {r['page_ar_tok_s']:.1f} / {r['cli_ar_tok_s']:.1f} "
              f"({r['page_ar_tok_s'] / r['cli_ar_tok_s']:.0%}) | {r['page_dflash_tok_s']:.1f} / {r['cli_dflash_tok_s']:.1f} "
              f"({r['page_dflash_tok_s'] / r['cli_dflash_tok_s']:.0%}) | {r['page_speedup']:.2f}x / "
              f"{r['cli_speedup']:.2f}x | {r['page_speedup'] / r['cli_speedup']:.0%} | {r['browser_core']:.0%} | {r['same_text']} |")
    print("\nThe browser: share of a core idle (page open) and while each Generate ran; the renderer main "
          "thread's seconds per second of the run in tasks / scripts / layout / style, and its layouts:")
    for r in rows:
        m = r["renderer_per_s"]
        print(f"{r['round']}.{r['repeat']} {r['variant']}: idle {r['browser_idle_core']:.0%}, running {r['browser_core']:.0%}; "
              f"renderer {m['task_s']:.3f} / {m['script_s']:.3f} / {m['layout_s']:.3f} / {m['style_s']:.3f}, "
              f"{m['layouts']:.0f} layouts")
    print("\nPage against the CLI run right after it, median (range) over every pair:")
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant]
        print(f"{variant}: AR {spread([r['page_ar_tok_s'] / r['cli_ar_tok_s'] for r in mine])}, "
              f"DFlash {spread([r['page_dflash_tok_s'] / r['cli_dflash_tok_s'] for r in mine])}, "
              f"speedup {spread([r['page_speedup'] / r['cli_speedup'] for r in mine])}; "
              f"same text in {sum(r['same_text'] for r in mine)} of {len(mine)}")
    print("\n/generate end to end (plain DFlash, submit to last update) against the CLI (prefill + decode); "
          "the engine's own time inside the studio (the final update's prefill_s + decode_s) and the rest, "
          "the transport's:")
    for r in api_rows:
        print(f"{r['round']}.{r['repeat']}: /generate {r['api_tok_s']:.1f} tok/s, CLI {r['cli_tok_s']:.1f} tok/s "
              f"({r['api_tok_s'] / r['cli_tok_s']:.0%}); engine in the studio {r['api_engine_tok_s']:.1f} tok/s "
              f"({r['api_engine_tok_s'] / r['cli_tok_s']:.0%}), transport {r['transport_s']:.2f} s; "
              f"same text: {r['same_text']}")
    print(f"median (range): /generate {spread([r['api_tok_s'] / r['cli_tok_s'] for r in api_rows])}, "
          f"engine in the studio {spread([r['api_engine_tok_s'] / r['cli_tok_s'] for r in api_rows])}; "
          f"transport {statistics.median(r['transport_s'] for r in api_rows):.2f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"page": rows, "api": api_rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
