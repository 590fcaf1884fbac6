"""One line describing the machine, for model cards and benchmark reports."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def hardware_summary() -> str:
    """CPU model and threads, GPU (or none), torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    threads = torch.get_num_threads()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return f"CPU {cpu} ({threads} threads), GPU {gpu}, torch {torch.__version__}"
