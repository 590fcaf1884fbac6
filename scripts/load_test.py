"""Bounded load test of the launched studio (loopback only).

    python scripts/load_test.py --users 8 --requests 3 --max-new-tokens 48

Starts ``python -m app`` on a free loopback port (or uses ``--url``), then runs ``--users``
concurrent gradio_client users, each sending ``--requests`` greedy requests through the named
``/generate`` endpoint. Every result is compared with the engine's own greedy output for that
prompt (the CLI's answer); queue positions reported by the server are recorded. Prints a
Markdown table and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

PROMPTS = [
    "Name three colours of the rainbow.",
    "Write a Python function that returns the square of a number.",
    "What is the capital of Italy?",
    "Give one tip for better sleep.",
    "Explain what a noun is in one sentence.",
    "List two planets of the solar system.",
    "What does CPU stand for?",
    "Write a haiku about rain.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app() -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_SERVER_NAME": "127.0.0.1"}
    proc = subprocess.Popen([sys.executable, "-m", "app"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    for _ in range(360):
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("app did not start")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("runs/load_test.json"))
    args = parser.parse_args()

    from gradio_client import Client

    from dflash_core.engine import Engine
    from dflash_core.speculative import GenerationConfig

    engine = Engine.from_registry()
    expected = {p: engine.generate(p, GenerationConfig(max_new_tokens=args.max_new_tokens)).token_ids for p in PROMPTS}
    del engine

    proc, url = (None, args.url) if args.url else start_app()
    results: list[dict] = []
    lock = threading.Lock()

    def user(uid: int) -> None:
        client = Client(url, verbose=False)
        for r in range(args.requests):
            prompt = PROMPTS[(uid + r) % len(PROMPTS)]
            started = time.time()
            max_rank = 0
            record = {"user": uid, "request": r, "prompt": prompt}
            try:
                job = client.submit(prompt, args.max_new_tokens, 16, 0.0, "", api_name="/generate")
                while not job.done():
                    status = job.status()
                    if status.rank is not None:
                        max_rank = max(max_rank, int(status.rank) + 1)
                    time.sleep(0.1)
                final = job.outputs()[-1]
                record.update(ok=True, correct=final["token_ids"] == expected[prompt], tokens=final["tokens"])
            except Exception as exc:  # a failure is what this script counts
                record.update(ok=False, correct=False, error=repr(exc))
            record.update(latency_s=round(time.time() - started, 3), max_queue_position=max_rank)
            with lock:
                results.append(record)

    began = time.time()
    threads = [threading.Thread(target=user, args=(u,)) for u in range(args.users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - began
    if proc is not None:
        proc.terminate()

    latencies = sorted(r["latency_s"] for r in results)
    p = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
    summary = {
        "users": args.users, "requests": len(results), "failures": sum(not r["ok"] for r in results),
        "wrong_results": sum(r["ok"] and not r["correct"] for r in results),
        "p50_latency_s": p(0.5), "p95_latency_s": p(0.95), "max_queue_position_seen": max(r["max_queue_position"] for r in results),
        "wall_s": round(wall, 1), "max_new_tokens": args.max_new_tokens,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "requests": results}, indent=2))
    print("| users | requests | failures | wrong results | p50 latency | p95 latency | max queue position seen | wall time |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {summary['users']} | {summary['requests']} | {summary['failures']} | {summary['wrong_results']} | "
          f"{summary['p50_latency_s']:.1f} s | {summary['p95_latency_s']:.1f} s | {summary['max_queue_position_seen']} | {summary['wall_s']:.0f} s |")
    sys.exit(1 if summary["failures"] or summary["wrong_results"] else 0)


if __name__ == "__main__":
    main()
