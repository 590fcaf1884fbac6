"""Adaptive verification's measured costs, kept on disk per machine and pair.

Adaptive drafting needs what verifying 1..B tokens costs on this machine (and, for trees, what a
tree costs beyond a chain). Measuring that takes seconds per process, which a user paid on every
start (inside the first timed run, before the studio warmed up at load). The figures depend on
the machine, the model, its dtype and runner, and the block size, so they are cached under that
key in ``$DFLASH_CACHE_DIR/calibration.json``. A cached entry is used only after a spot check: a
verify of one token and of a whole block measured now must be within ``TOLERANCE`` of the cached
figures; otherwise (another load on the machine, a changed build) everything is measured again.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any, Callable

import torch

from .loading import cache_root
from .speculative import _interleaved_medians, verify_pass
from .target import TargetRunner

TOLERANCE = 1.5  # a spot-checked cost may be this many times higher or lower than the cached one
SPOT_CONTEXT = 128  # positions before the spot check's verify passes, as in measure_verify_costs


def cache_file() -> Path:
    return cache_root() / "calibration.json"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(target: TargetRunner, pair: str, block_size: int) -> str:
    """What the measured costs depend on: machine, software, model and how it runs."""
    device = target.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model()
    parts = [where, f"threads={torch.get_num_threads()}", f"torch={torch.__version__}", f"pair={pair}",
             f"dtype={target.dtype}", f"runner={type(target).__name__}", f"vocab={target.vocab_size}",
             f"layers={target.num_layers}", f"hidden={target.hidden_size}", f"block={block_size}",
             f"min_rows={getattr(target, 'min_rows', None)}"]
    weights = getattr(target, "weight_format", "bf16")
    if weights != "bf16":  # int4 / int8 kernels cost differently per row (bf16 keys stay as they were)
        parts.append(f"weights={weights}")
    kernels = getattr(target, "kernels", "onednn")
    if kernels != "onednn":  # other kernels, other costs per row (oneDNN keys stay as they were)
        parts.append(f"kernels={kernels}")
    if getattr(target, "compiled_layers", False):  # whole compiled layers cost differently again
        parts.append("layers=compiled")
    if weights != "bf16" or kernels != "onednn":
        # the project's own C++ kernels run in these: a changed build may move every cost a little,
        # the spot check only the two it measures
        parts.append(f"csrc={csrc_digest()}")
    return " | ".join(parts)


def csrc_digest() -> str:
    """The builds of the project's C++ kernels (``csrc/``), as their libraries are named."""
    from .int8_dot import build_digest

    return "+".join(build_digest(source) for source in sorted((Path(__file__).parent / "csrc").glob("*.cpp")))


def _read() -> dict[str, Any]:
    try:
        data = json.loads(cache_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(key: str, entry: dict[str, Any]) -> None:
    data = _read()
    data[key] = entry
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)  # atomic: two processes never leave a half-written file
    except OSError:
        pass  # a read-only home: measure every time, as before


def spot_check(target: TargetRunner, verify_costs: list[float], repeats: int = 3) -> bool:
    """Whether verifying 1 and ``len(verify_costs)`` tokens costs now what the cache says."""
    block = len(verify_costs)
    ids = (torch.arange(SPOT_CONTEXT + block, dtype=torch.long) % 1000 + 10) % target.vocab_size
    target.reset(SPOT_CONTEXT + block)
    target.forward(ids[:SPOT_CONTEXT], None, last_only=True)
    calls = [lambda size=size: verify_pass(target.forward(ids[SPOT_CONTEXT:SPOT_CONTEXT + size], None))
             for size in (1, block)]
    now = _interleaved_medians(target, calls, SPOT_CONTEXT, repeats)
    cached = (verify_costs[0], verify_costs[-1])
    return all(c > 0 and 1 / TOLERANCE <= n / c <= TOLERANCE for n, c in zip(now, cached))


def cached_costs(key: str, name: str, target: TargetRunner, measure: Callable[[], Any]) -> Any:
    """The figures ``name`` ("verify" or "tree") cached under ``key``, when the entry passes the
    spot check (once per key and process); else ``measure()``'s, stored for next time."""
    entry = _read().get(key, {})
    if name in entry and (key in _checked or ("verify" in entry and spot_check(target, entry["verify"]))):
        _checked.add(key)
        return entry[name]
    value = measure()
    if name == "verify":
        entry = {"verify": value}  # a new anchor: figures measured beside the old one are stale
        _checked.add(key)
    elif "verify" not in entry:
        return value  # nothing to spot-check it against later: not stored
    else:
        entry[name] = value
    _write(key, entry)
    return value


# Keys whose cached entry this process has spot-checked (or measured itself).
_checked: set[str] = set()
