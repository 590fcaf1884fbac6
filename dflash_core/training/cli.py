"""``python -m dflash_core train``: the resumable training recipe from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from .errors import TrainingError
from .recipe import STAGES, RecipeOptions, run_recipe
from .trainer import TrainSettings


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_train_parser(sub: Any) -> None:
    t = sub.add_parser(
        "train",
        help="train a DFlash drafter for a target (self-distillation data, features, fit, export, evaluate)",
        description="Stages run in order and resume after an interruption: " + " -> ".join(STAGES),
    )
    t.add_argument("--pair", help="take the target from this registry pair (default: the default pair)")
    t.add_argument("--target", help="or a target directly: hub id, local directory, or .gguf file")
    # auto: bf16 where this device multiplies bf16 natively, else fp32 (without native bf16 kernels
    # the target's passes run many times slower: docs/TRAINING.md, "Growing the data").
    t.add_argument("--target-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    t.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (accelerate launch handles several GPUs)")
    t.add_argument("--work-dir", required=True, type=Path, help="where data, features and checkpoints go")
    t.add_argument("--out", required=True, type=Path, help="where the exported z-lab drafter goes")
    t.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    t.add_argument("--prompts", type=Path, help="a prompt set (JSONL[.gz] of {id, source, messages}); default: built")
    t.add_argument("--gen-batch-size", type=int, default=64)
    t.add_argument("--gen-max-new-tokens", type=int, default=256)
    t.add_argument("--gen-minutes", type=float, default=None, help="time budget of the generate stage, in total over all runs into --work-dir")
    t.add_argument("--gen-tokens", type=int, default=None, help="token budget of the generate stage (answer tokens in --work-dir, in total)")
    t.add_argument("--gen-max-prompts", type=int, default=None)
    t.add_argument("--feature-layers", type=_int_list, default=None, help="target layers to cache (default: those trained on)")
    t.add_argument("--eval-prompts", type=int, default=40)
    t.add_argument("--draft-vocab", type=int, default=8192,
                   help="the exported drafter proposes only the N most frequent response tokens, a cheaper LM head (0 = all)")
    t.add_argument("--shards", type=Path, default=None,
                   help="a data directory of answer shards (assets/data/smollm2-answers): the generate stage adds "
                        "shards there and the features stage trains on all of them (see `gen-data`)")
    t.add_argument("--shard-limit", type=int, default=0,
                   help="with --shards: train on the first N shards only (0: all), so that a drafter stays "
                        "reproducible while gen-data adds shards")
    t.add_argument("--shard-select", default=None, metavar="SLICES",
                   help="with --shards, instead of --shard-limit: comma-separated Python slices over the shards' "
                        "order, e.g. 0:157:4,157: (every fourth of the first 157 and all after)")
    t.add_argument("--gen-shard-prompts", type=int, default=256, help="prompts per shard (with --shards)")
    t.add_argument("--fit-minutes", type=float, default=None,
                   help="re-plan the step count from the measured pace so the fit ends within this many minutes")
    for f in dataclasses.fields(TrainSettings):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kind = _int_list if isinstance(default, list) else type(default)
        t.add_argument(flag, type=kind, default=None, help=f"default {default}")
    t.set_defaults(func=cmd_train)
    add_gen_data_parser(sub)


def add_gen_data_parser(sub: Any) -> None:
    g = sub.add_parser(
        "gen-data",
        help="add answer shards (the target's greedy answers) to a committed data directory, within a time budget",
        description="Answers the next prompts of --prompts (training split, file order) and appends them as "
                    "compressed token-id shards to --data-dir; resumable, any number of runs (docs/TRAINING.md).",
    )
    g.add_argument("--pair", help="take the target from this registry pair (default: the default pair)")
    g.add_argument("--target", help="or a target directly: hub id, local directory, or .gguf file")
    # auto: bf16 where this CPU multiplies bf16 natively, else fp32 (each shard records which ran).
    g.add_argument("--target-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    g.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    g.add_argument("--prompts", type=Path, default=Path("assets/data/train_prompts.jsonl.gz"))
    g.add_argument("--data-dir", type=Path, required=True, help="where the shards and manifest.json go")
    g.add_argument("--minutes", type=float, default=None, help="this run's wall-clock budget (default: until done)")
    g.add_argument("--max-tokens", type=int, default=None, help="or stop after this many answer tokens in this run")
    g.add_argument("--shard-prompts", type=int, default=256, help="prompts per shard (all a killed run can lose)")
    g.add_argument("--slots", type=int, default=64, help="rows decoded together")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--keep-features", type=_int_list, default=[], metavar="LAYERS",
                   help="also keep the target's features of these layers (the ones `train --feature-layers` "
                        "caches), so train's features stage copies them instead of running the target again")
    g.add_argument("--features-dir", type=Path, default=None,
                   help="where kept features go (never the committed data: ~7 KB per token); train reads "
                        "them from <work-dir>/kept-features")
    g.set_defaults(func=cmd_gen_data)


def target_source(target: str | None, pair: str | None, registry: Any = None) -> Any:
    """The ``ModelSource`` of ``--target`` (a .gguf file, a directory or a hub id), else of ``--pair``."""
    from ..registry import ModelSource, load_registry

    if target:
        path = Path(target).expanduser()
        if path.suffix == ".gguf":
            return ModelSource("gguf", str(path.resolve().parent), gguf_file=path.name)
        if path.exists():
            return ModelSource("path", str(path.resolve()))
        return ModelSource("hub", target)
    return load_registry(registry).get(pair).target


def cmd_gen_data(args: argparse.Namespace) -> int:
    from ..console import log
    from ..loading import load_target
    from .gen_data import GenDataOptions, generate_shards

    if not args.prompts.is_file():
        raise TrainingError(f"prompt file {args.prompts} does not exist (the committed set is "
                            "assets/data/train_prompts.jsonl.gz)")
    options = GenDataOptions(
        prompts_file=args.prompts, data_dir=args.data_dir, minutes=args.minutes, max_answer_tokens=args.max_tokens,
        shard_prompts=args.shard_prompts, slots=args.slots, max_new_tokens=args.max_new_tokens,
        feature_layers=args.keep_features, features_dir=args.features_dir,
    )
    if args.keep_features and args.features_dir is None:
        raise TrainingError("--keep-features needs --features-dir (train reads them from <work-dir>/kept-features)")
    options.check()  # before the target loads (minutes for a large one)
    target = load_target(target_source(args.target, args.pair, getattr(args, "registry", None)), args.target_dtype,
                         args.device, progress=log)
    stats = generate_shards(target, options)
    print(json.dumps(stats, indent=2))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from ..console import log
    from ..loading import load_target

    source = target_source(args.target, args.pair, args.registry)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise TrainingError(f"unknown stage(s) {unknown}; allowed: {', '.join(STAGES)}")
    if args.shard_limit < 0 or (args.shard_limit and args.shards is None):
        raise TrainingError(f"--shard-limit {args.shard_limit}: a number of shards (0: all), with --shards")
    if args.shard_select is not None:
        if args.shards is None or args.shard_limit:
            raise TrainingError("--shard-select goes with --shards, and instead of --shard-limit (--shard-limit N is "
                                "--shard-select :N)")
        from .shards import DataDir, select_shards
        select_shards(DataDir(args.shards).shards, args.shard_select)  # a mistyped one fails before the target loads
    settings = TrainSettings()
    for f in dataclasses.fields(TrainSettings):
        value = getattr(args, f.name)
        if value is not None:
            setattr(settings, f.name, value)
    target = load_target(source, args.target_dtype, args.device, progress=log)
    options = RecipeOptions(
        work_dir=args.work_dir, out_dir=args.out, prompts_file=args.prompts,
        gen_batch_size=args.gen_batch_size, gen_max_new_tokens=args.gen_max_new_tokens,
        gen_time_budget_s=args.gen_minutes * 60 if args.gen_minutes else None,
        gen_token_budget=args.gen_tokens, gen_max_prompts=args.gen_max_prompts,
        feature_layers=args.feature_layers, eval_prompts=args.eval_prompts, draft_vocab=args.draft_vocab,
        shards_dir=args.shards, shard_select=f":{args.shard_limit}" if args.shard_limit else args.shard_select,
        gen_shard_prompts=args.gen_shard_prompts,
        fit_time_budget_s=args.fit_minutes * 60 if args.fit_minutes else None,
        command="python -m dflash_core " + " ".join(shlex.quote(a) for a in sys.argv[1:]), settings=settings,
    )
    result = run_recipe(target, options, stages)
    print(json.dumps(result, indent=2, default=str))
    return 0
