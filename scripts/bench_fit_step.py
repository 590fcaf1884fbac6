"""Seconds per fit step under different settings, interleaved on the same batches: the figures
docs/TRAINING.md cites for the fit's pace.

    python scripts/bench_fit_step.py --features runs/smollm2-shards/features --steps 15 --rounds 2 \\
        --arms bf16:compute_dtype=bfloat16,fp32:compute_dtype=float32

Every arm is a ``Trainer`` with the bundled drafter's fit settings (the Makefile's ``FIT_ARGS``)
plus its overrides, on the given feature cache. In each round every arm runs the same
``--steps`` step indices (so the same sequences and anchors), one arm after the other; the
median over rounds is printed per arm. ``--block`` fixes the block size (the curriculum's
phases cost about the same per step by design: anchors scale as 1/B).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dflash_core.drafter import DrafterConfig
from dflash_core.loading import load_target
from dflash_core.registry import load_registry
from dflash_core.training.features import FeatureStore
from dflash_core.training.trainer import Trainer, TrainSettings

# The Makefile's FIT_ARGS, as TrainSettings fields.
FIT_SETTINGS = dict(num_layers=2, target_layer_ids=[1, 8, 15, 22, 27], mask_token_id=7, init="target", reg_weight=1.0,
                    sequences_per_step=8, anchors_per_sequence=32, eval_every=10**9, checkpoint_every=10**9)


def _value(text: str) -> object:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_arms(spec: str) -> dict[str, dict[str, object]]:
    """``name:key=value;key=value,name2:...`` -> {name: overrides}."""
    arms: dict[str, dict[str, object]] = {}
    for item in filter(None, spec.split(",")):
        name, _, rest = item.partition(":")
        arms[name] = {k: _value(v) for k, v in (kv.split("=", 1) for kv in filter(None, rest.split(";")))}
    return arms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", type=Path, required=True, help="a feature cache directory")
    ap.add_argument("--arms", default="bf16:compute_dtype=bfloat16,fp32:compute_dtype=float32")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per arm and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--block", type=int, default=16, help="block size of every step (16 = the curriculum's last phase)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()

    pair = load_registry().get(None)
    target = load_target(pair.target, "auto", "cpu")
    store = FeatureStore(args.features)
    arms = parse_arms(args.arms)
    trainers: dict[str, Trainer] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in arms.items():
            settings = TrainSettings(**FIT_SETTINGS, block_schedule=f"{args.block}:1", steps=10**6)
            for key, value in overrides.items():
                setattr(settings, key, value)
            cfg = DrafterConfig.for_target(target.config, num_layers=settings.num_layers,
                                           mask_token_id=settings.mask_token_id, block_size=settings.block_size,
                                           target_layer_ids=settings.target_layer_ids)
            trainers[name] = Trainer(settings, store, target.model.get_input_embeddings().weight.detach(),
                                     target.runner.lm_head_weight.detach(), target.model.model.norm.weight.detach(),
                                     cfg, Path(tmp) / name, target_model=target.model)
        for trainer in trainers.values():
            trainer.train_step()  # warm-up, untimed: first-call allocations and kernel choices
        seconds: dict[str, list[float]] = {name: [] for name in arms}
        for r in range(args.rounds):
            for name, trainer in trainers.items():
                trainer.step = 1 + r * args.steps  # every arm on the same batches
                started = time.perf_counter()
                for _ in range(args.steps):
                    trainer.train_step()
                seconds[name].append((time.perf_counter() - started) / args.steps)
                print(f"round {r} {name}: {seconds[name][-1]:.3f} s/step", flush=True)
    result = {"threads": torch.get_num_threads(), "block": args.block, "steps_per_round": args.steps,
              "arms": {name: {"overrides": arms[name], "s_per_step": [round(s, 3) for s in seconds[name]],
                              "median": round(statistics.median(seconds[name]), 3),
                              "compute_dtype": str(trainers[name].compute_dtype)} for name in arms}}
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
