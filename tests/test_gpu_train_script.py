"""scripts/gpu_train.py, the GPU training recipe, run here end to end on the CPU at toy scale.

A lent GPU comes rarely and for minutes, so the script must work the first time: it runs from
any directory with a bare interpreter (it puts the checkout on ``sys.path``), and ``--device cpu
--tiny`` takes every stage a GPU run takes: generate (shards continuing committed data, features
kept), features, a fit re-planned to its time budget, export, quick tau, packing for the trip back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from dflash_core.drafter import DFlashDrafter
from dflash_core.training.gen_data import GenDataOptions, generate_shards
from dflash_core.training.prompt_sources import Prompt, write_prompts
from dflash_core.training.shards import DataDir, read_samples

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_train.py"


def run_script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_gpu_recipe_runs_every_stage_on_the_cpu_within_its_budget(tiny_chat_target, tmp_path):
    prompts = [Prompt(f"q{i}", f"test/{i % 4}", [{"role": "user", "content": f"Tell me about the number {i}."}])
               for i in range(40)]
    write_prompts(prompts, tmp_path / "prompts.jsonl")
    # Committed data to continue from: one shard made here, as `make gen-data` would.
    committed = tmp_path / "committed"
    generate_shards(tiny_chat_target, GenDataOptions(prompts_file=tmp_path / "prompts.jsonl", data_dir=committed,
                                                     shard_prompts=6, slots=3, max_new_tokens=12, max_answer_tokens=1))
    cursor = DataDir(committed).cursor
    committed_tokens = DataDir(committed).shards[0]["answer_tokens"] + DataDir(committed).shards[0]["prompt_tokens"]
    out = tmp_path / "out"
    target_dir = tiny_chat_target.source.location
    done = run_script("--device", "cpu", "--tiny", "--dtype", "float32", "--target", target_dir, "--out", str(out),
                      "--minutes", "0.75", "--gen-share", "0.2", "--slots", "4", "--shard-prompts", "8",
                      "--prompts", str(tmp_path / "prompts.jsonl"), "--data", str(committed), "--eval-prompts", "1",
                      "--pack-mb", "0.05", "--fit-tokens", str(committed_tokens + 1), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    # Within the budget (45 s), give or take the export, the quick tau and the interpreter's start.
    assert report["seconds"] < 45 + 60, report["stages_s"]
    assert report["fit"]["steps"] >= 10  # re-planned from the pace, not the provisional million
    assert report["data"]["new_answers"] > 0 and report["data"]["committed_shards_used"] == 1
    assert report["data"]["answers"] == report["data"]["new_answers"] + DataDir(committed).manifest["totals"]["answers"]
    assert report["quick_tau_b16"]["heldout"]["tau"] >= 1.0
    # The fit's data thinned to the budget its features may take on the machine's disk.
    shards = DataDir(committed).shards + [{"file": f} for f in report["data"]["new_shards"]]
    assert report["data"]["fit_selection"].startswith("::") and 1 <= report["data"]["fit_shards"] < len(shards)
    # The training log: a header with hardware, settings and data size, the fit's lines, a result.
    lines = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert lines[0]["kind"] == "run" and lines[0]["hardware"] and lines[0]["data"]["answer_tokens"] > 0
    assert lines[0]["settings"]["num_layers"] == 1
    steps = [line for line in lines if "step" in line]
    assert len(steps) == report["fit"]["steps"] and all({"loss", "elapsed_s"} <= set(s) for s in steps)
    assert any("valid_tau_proxy" in s for s in steps) and lines[-1]["kind"] == "result"
    # Packed for the trip back (a device call returns at most 8 files of 16 MiB): reassemble.
    assert report["parts"] and sorted(p.name for p in out.iterdir()) == sorted(report["parts"] + ["report.json", "train_log.jsonl"])
    (tmp_path / "result.tar").write_bytes(b"".join((out / p).read_bytes() for p in report["parts"]))
    unpacked = tmp_path / "unpacked"
    with tarfile.open(tmp_path / "result.tar") as tar:
        tar.extractall(unpacked, filter="data")
    drafter = DFlashDrafter.from_pretrained(unpacked / "drafter")
    assert drafter.config.target_layer_ids == [0, 1] and drafter.draft_vocab.numel() <= 256
    # The new shards continue the committed data: copied back, they extend it.
    for f in (unpacked / "shards").iterdir():
        (committed / f.name).write_bytes(f.read_bytes())
    data = DataDir(committed)
    assert data.cursor > cursor and [s["file"] for s in data.shards] == [f"shard-{i:05d}.npz" for i in range(len(data.shards))]
    assert len(read_samples(committed)) == report["data"]["answers"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_the_gpu_recipe_says_what_to_do_without_a_gpu(tmp_path):
    done = run_script("--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode != 0
    assert "no CUDA device" in done.stderr and "--device cpu --tiny" in done.stderr
