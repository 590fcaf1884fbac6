"""Does one OpenAI-API request slow the studio's later runs? AR tokens/s through ``/generate``
twice, then one ``/v1/chat/completions`` request, then twice more, in one studio process.

    python scripts/studio_after_api.py [TREE]

TREE (default: this checkout) is the source tree the studio runs from, so a git worktree of an
older revision can be compared (``git worktree add --detach /tmp/old REV``). Before the compute
thread (dflash_core/compute.py), the API's steps ran on long-lived worker threads and every later
run paid for the OpenMP pool they left behind (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from studio_bench import free_port  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper."


def main() -> int:
    from gradio_client import Client

    tree = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent).resolve()
    port = free_port()
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONPATH": str(tree)}
    studio = subprocess.Popen([sys.executable, "-m", "app"], cwd=tree, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(480):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        client.predict("Hi", 4, 16, 0.0, "", api_name="/generate")  # waits for the pair to be ready

        def ar_tokens_per_s() -> float:
            started = time.perf_counter()
            final = client.predict(PROMPT, 200, 1, 0.0, "", api_name="/generate")
            return round(final["tokens"] / (time.perf_counter() - started), 1)

        before = [ar_tokens_per_s() for _ in range(2)]
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=300).read()
        after = [ar_tokens_per_s() for _ in range(2)]
        print(f"{tree}: AR tok/s through /generate before one API request {before}, after it {after}")
    finally:
        studio.terminate()
        studio.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
