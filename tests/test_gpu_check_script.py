"""scripts/gpu_check.py, the one prepared command for a lent GPU, run here on the CPU.

A session is lent a GPU rarely and briefly, so the script must work the first time it meets
one: it runs from any directory (it puts the checkout on ``sys.path`` itself, as the project is
not installed on a lent machine) and, with ``--device cpu``, performs every check it performs
on CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def run_script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_the_gpu_check_runs_every_check_on_the_cpu_from_anywhere(tmp_path):
    out = tmp_path / "report.json"
    done = run_script("--device", "cpu", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == 0 and report["device"] == "cpu"
    checks = report["checks"]
    assert checks and all(c["lossless"] for c in checks)
    # Both runners, both dtypes, trees and prompt lookup on the fast runner, every block size.
    seen = {(c["runner"], c["dtype"]) for c in checks}
    assert {("fast", "torch.bfloat16"), ("fast", "torch.float32"), ("hf", "torch.bfloat16"), ("hf", "torch.float32")} <= seen
    assert {(c["tree"], c["lookup"]) for c in checks if c["runner"] == "fast"} == {(False, False), (True, False), (False, True), (True, True)}
    assert {c["block"] for c in checks if c["runner"] == "hf"} == {2, 4, 8, 16}
    # Hybrid (linear attention) and sliding-window targets, on the generic runner.
    assert {c.get("family") for c in checks} >= {"qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss"}
    # The oracle drafter really is one: nearly every draft kept (the last cycle may be cut short).
    assert all(c["tau"] >= 0.9 * c["block"] for c in checks if c["drafter"] == "oracle")
    assert set(report["speed"]) == {"ar_tok_s", "dflash_oracle_tok_s", "ratio"}
    # CUDA graphs' bookkeeping (its CPU stand-in here): equal to eager, lossless, and replayed.
    graphs = report["cuda_graphs"]
    assert [c["dtype"] for c in graphs["checks"]] == ["torch.bfloat16", "torch.float32"]
    assert all(c["ok"] and c["replays"] > c["captures"] > 0 and c["broken"] is None for c in graphs["checks"])
    assert {"eager", "graphs", "graphs_vs_eager_ar", "graphs_vs_eager_dflash"} == set(graphs["speed"])
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        pass
    else:
        assert any(c["dtype"] == "nf4" for c in checks)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_the_gpu_check_says_what_to_do_without_a_gpu(tmp_path):
    done = run_script("--out", str(tmp_path / "report.json"), cwd=tmp_path)
    assert done.returncode != 0
    assert "no CUDA device" in done.stderr and "--device cpu" in done.stderr
    assert not (tmp_path / "report.json").exists()


def test_the_gpu_check_stopped_by_sigint_still_reports_what_it_checked(tmp_path):
    """A lent machine's call has a hard end: `timeout -s INT` stops the script, which writes the
    checks that ran, says it was stopped, and exits 1 (not every check ran)."""
    import signal
    import time

    out = tmp_path / "report.json"
    process = subprocess.Popen([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while "gpu_check: checking on cpu" not in process.stderr.readline():  # past the imports
        assert process.poll() is None, "the script ended before its checks began"
    time.sleep(3)  # inside the checks (the whole run takes ~45 s here)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1, stderr[-3000:]
    report = json.loads(out.read_text())
    assert "stopped" in report
    assert report["failures"] == sum(not c["lossless"] for c in report["checks"]) == 0


def test_the_failures_are_counted_from_the_report_rows():
    """The exit status and ``failures`` come from the rows the report lists, so a stopped run
    counts what it checked: the checks and CUDA graphs' rows, not the hybrids' bf16 ones."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    report = {"checks": [{"lossless": True}, {"lossless": False}], "hybrid_bf16": [{"lossless": False}],
              "cuda_graphs": {"checks": [{"ok": False}, {"ok": True}]}}
    assert gpu_check.failures_in(report) == 2
    assert gpu_check.failures_in({"checks": []}) == 0
