"""Fits of one feature cache side by side: each arm a complete schedule of --steps, interleaved.

    python scripts/compare_fits.py --work runs/compare-fits --steps 800 --arms sampled,draft

The cache holds the committed shards whose features `make gen-data` kept on this machine (no
target pass); with --target-pass, the committed answers from the first shard on, the target running
over those whose features were not kept. --max-tokens caps it. Every arm starts from the bundled recipe's fit (the Makefile's
FIT_ARGS) and changes what its entry in ARMS says. Arms take turns of --turn steps, so a machine
that slows down slows them alike. Each evaluates on the same held-out sequences every
--eval-every steps (blocks of 16; the proxy over the 8,192-token draft vocabulary is what the
exported drafter would propose from) and appends to <work>/<arm>/log.jsonl; the summary goes to
<work>/compare.json. A rerun resumes nothing: it starts over in a fresh --work.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from dflash_core.drafter_config import DrafterConfig
from dflash_core.loading import load_target
from dflash_core.registry import load_registry
from dflash_core.training.features import build_feature_cache
from dflash_core.training.recipe import RecipeOptions
from dflash_core.training.selfdistill import Sample
from dflash_core.training.shards import read_samples
from dflash_core.training.trainer import Trainer, TrainSettings

FEATURE_LAYERS = [1, 8, 15, 22, 27, 29]
# The Makefile's FIT_ARGS with 2 layers (train-bundled-fresh's fit), but for the step count;
# `make train-bundled` fits the three_layers arm.
RECIPE: dict[str, Any] = {
    "num_layers": 2, "target_layer_ids": [1, 8, 15, 22, 27], "mask_token_id": 7, "init": "target",
    "reg_weight": 1.0, "block_schedule": "4:0.45,8:0.25,16:0.3", "sequences_per_step": 8, "anchors_per_sequence": 32,
}
ARMS: dict[str, dict[str, Any]] = {
    "sampled": {},  # the recipe: sampled softmax (4,096 frequent + labels + 4,096 random rows)
    "draft": {"ce_vocab": "draft"},  # exact softmax over the draft vocabulary
    "draft_kl": {"ce_vocab": "draft", "kl_weight": 1.0},  # + KL to the target at every slot
    "three_layers": {"num_layers": 3},
    "four_layers": {"num_layers": 4},
    "grouped": {"length_group_steps": 32},  # steps of like-length sequences: less context padding
    "fp32": {"compute_dtype": "float32"},  # the recipe with its arithmetic pinned, to time the two side by side
    "bf16": {"compute_dtype": "bfloat16"},
}


def pick_samples(samples: list[Sample], max_tokens: int | None, target_pass: bool) -> list[Sample]:
    """The answers the cache holds, in shard order: only those with kept features unless
    ``target_pass``, cut before the first that would take it past ``max_tokens`` (prompts included)."""
    chosen = samples if target_pass else [s for s in samples if s.features is not None]
    if max_tokens is not None:
        total = 0
        for i, s in enumerate(chosen):
            total += len(s.prompt_ids) + len(s.response_ids)
            if total > max_tokens:
                return chosen[:i]
    return chosen


def build_cache(target: Any, shards: Path, kept: Path, work: Path, max_tokens: int | None, target_pass: bool) -> Any:
    samples = pick_samples(read_samples(shards, kept), max_tokens, target_pass)
    if not samples:
        raise SystemExit(f"no answers in {shards} have kept features in {kept}: run `make gen-data` on this machine "
                         "first, or pass --target-pass --max-tokens N to run the target over committed answers")
    return build_feature_cache(target.runner, samples, FEATURE_LAYERS, work / "features", responses_dir=kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--shards", type=Path, default=Path("assets/data/smollm2-answers"))
    parser.add_argument("--kept", type=Path, default=Path("runs/smollm2-shards/kept-features"))
    parser.add_argument("--max-tokens", type=int, default=None, help="cap the cache (prompt + answer tokens)")
    parser.add_argument("--target-pass", action="store_true",
                        help="also take answers whose features were not kept here: the target runs over them once "
                             "(on a fresh clone, where no features were kept)")
    parser.add_argument("--arms", default="sampled,draft")
    parser.add_argument("--steps", type=int, default=800, help="each arm's whole schedule")
    parser.add_argument("--turn", type=int, default=25, help="steps an arm runs before the next takes over")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-sequences", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(2)
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    target = load_target(load_registry().get("smollm2-135m").target, "auto")
    store = build_cache(target, args.shards, args.kept, args.work, args.max_tokens, args.target_pass)
    print(f"cache: {len(store)} sequences, {store.num_tokens} tokens", flush=True)

    trainers: dict[str, Trainer] = {}
    for arm in args.arms.split(","):
        settings = TrainSettings(steps=args.steps, eval_every=10**9, checkpoint_every=10**9,
                                 eval_sequences=args.eval_sequences, **{**RECIPE, **ARMS[arm]})
        cfg = DrafterConfig.for_target(target.config, num_layers=settings.num_layers,
                                       mask_token_id=settings.mask_token_id, block_size=settings.block_size,
                                       target_layer_ids=settings.target_layer_ids)
        trainers[arm] = Trainer(settings, store, target.model.get_input_embeddings().weight.detach(),
                                target.runner.lm_head_weight.detach(), target.model.model.norm.weight.detach(), cfg,
                                args.work / arm, target_model=target.model, draft_vocab=RecipeOptions.draft_vocab)
    seconds = dict.fromkeys(trainers, 0.0)
    curves: dict[str, list[dict[str, Any]]] = {arm: [] for arm in trainers}
    for start in range(0, args.steps, args.turn):
        for arm, trainer in trainers.items():
            for _ in range(min(args.turn, args.steps - start)):
                began = time.time()
                metrics = trainer.train_step()
                seconds[arm] += time.time() - began
                record: dict[str, Any] = {"step": trainer.step, "train_s": round(seconds[arm], 1),
                                          **{k: round(v, 4) for k, v in metrics.items()}}
                if trainer.step % args.eval_every == 0 or trainer.step == args.steps:
                    record.update(trainer.evaluate())
                    curves[arm].append({k: record[k] for k in ("step", "valid_tau_proxy", "valid_tau_proxy_draft")})
                    print(json.dumps({"arm": arm, **curves[arm][-1]}), flush=True)
                with open(args.work / arm / "log.jsonl", "a") as fh:
                    fh.write(json.dumps(record) + "\n")
    summary = {"steps": args.steps, "cache_sequences": len(store), "cache_tokens": store.num_tokens,
               "arms": {arm: {"overrides": ARMS[arm], "seconds_per_step": round(seconds[arm] / args.steps, 3),
                              "curve": curves[arm]} for arm in trainers}}
    (args.work / "compare.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["arms"]), flush=True)


if __name__ == "__main__":
    main()
