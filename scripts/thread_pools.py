"""Why all model work runs on one thread (dflash_core/compute.py): AR decode speed with one
OpenMP pool in the process, then with a second one held by a thread that lives on.

    python scripts/thread_pools.py [--runs 3] [--max-new-tokens 200]

Loads the default pair in a thread that then exits, and times autoregressive generations of the
studio's first example, each in a new thread (one pool at a time, as the compute thread has).
Then a long-lived thread runs one small parallel op (as a server's handler thread did when it ran
a teaching step or an API request) and the same generations are timed again.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any, Callable


def in_new_thread(fn: Callable[[], Any]) -> Any:
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    thread.join()
    return box[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    args = parser.parse_args()
    from app.studio import EXAMPLES
    from dflash_core.engine import Engine
    from dflash_core.speculative import GenerationConfig, collect

    engine = in_new_thread(Engine.from_registry)
    ids, config = engine.prepare(EXAMPLES[0], GenerationConfig(max_new_tokens=args.max_new_tokens), "ar")

    def tokens_per_s() -> float:
        started = time.perf_counter()
        result = collect(engine.stream_ids(ids, config))
        return round(len(result.token_ids) / (time.perf_counter() - started), 1)

    in_new_thread(tokens_per_s)  # warm
    one_pool = [in_new_thread(tokens_per_s) for _ in range(args.runs)]
    import torch

    def linger() -> None:
        torch.randn(256, 256) @ torch.randn(256, 256)
        threading.Event().wait()

    threading.Thread(target=linger, daemon=True).start()
    time.sleep(0.5)
    two_pools = [in_new_thread(tokens_per_s) for _ in range(args.runs)]
    print(f"AR tok/s, one OpenMP pool: {one_pool}; with a second pool held by a live thread: {two_pools}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
