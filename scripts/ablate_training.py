"""Short, equal-time training runs on one feature cache, to choose the recipe's settings.

    python scripts/ablate_training.py --work runs/smollm2 --minutes 6 --configs base,reg,kl,target

Each config trains for the same wall-clock budget from the same cache and reports the held-out
per-slot accuracy and the tau proxy; results are appended to ``<work>/ablations.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflash_core.drafter_config import DrafterConfig
from dflash_core.loading import load_target
from dflash_core.registry import load_registry
from dflash_core.training.features import FeatureStore
from dflash_core.training.trainer import Trainer, TrainSettings

CONFIGS: dict[str, dict] = {
    "base": {},
    "reg": {"reg_weight": 1.0},
    "kl": {"ce_weight": 0.0, "kl_weight": 1.0},
    "klreg": {"ce_weight": 0.0, "kl_weight": 1.0, "reg_weight": 1.0},
    "target": {"init": "target", "reg_weight": 1.0},
    "lr2x": {"lr": 1.2e-3, "reg_weight": 1.0},
    "deep": {"target_layer_ids": [8, 15, 22, 27, 29], "reg_weight": 1.0},
    "one_layer": {"num_layers": 1, "reg_weight": 1.0},
    "three_layers": {"num_layers": 3, "reg_weight": 1.0},
    "sub4k": {"sub_vocab": 4096, "reg_weight": 1.0},
    "b8": {"block_size": 8, "gamma": 4.0, "reg_weight": 1.0},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=6.0)
    parser.add_argument("--configs", default="base,reg,kl,target")
    parser.add_argument("--steps", type=int, default=100000, help="schedule length (the time budget ends runs first)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    pair = load_registry().get(None)
    target = load_target(pair.target, "bfloat16")
    store = FeatureStore(args.work / "features")
    for name in args.configs.split(","):
        settings = TrainSettings(steps=args.steps, eval_every=10**9, checkpoint_every=10**9, eval_sequences=64,
                                 warmup_fraction=0.0, mask_token_id=7)
        settings.warmup_fraction = 0.0
        for key, value in CONFIGS[name].items():
            setattr(settings, key, value)
        cfg = DrafterConfig.for_target(target.config, num_layers=settings.num_layers, mask_token_id=settings.mask_token_id,
                                       block_size=settings.block_size, target_layer_ids=settings.target_layer_ids)
        work = args.work / "ablations" / name
        trainer = Trainer(settings, store, target.model.get_input_embeddings().weight.detach(),
                          target.runner.lm_head_weight.detach(), target.model.model.norm.weight.detach(), cfg, work,
                          target_model=target.model)
        started = time.time()
        history = []
        while time.time() - started < args.minutes * 60:
            metrics = trainer.train_step()
            if trainer.step % 50 == 0:
                history.append((trainer.step, round(metrics["loss"], 3), round(metrics["acc1"], 3)))
        result = {"config": name, "overrides": CONFIGS[name], "steps": trainer.step,
                  "seconds": round(time.time() - started), **trainer.evaluate(), "history": history[-4:]}
        print(json.dumps(result), flush=True)
        with open(args.work / "ablations.jsonl", "a") as fh:
            fh.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
