"""``python -m dflash_core train``: the resumable training recipe from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any

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
    t.add_argument("--target-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
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
    for f in dataclasses.fields(TrainSettings):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kind = _int_list if isinstance(default, list) else type(default)
        t.add_argument(flag, type=kind, default=None, help=f"default {default}")
    t.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from ..cli import _log
    from ..loading import load_target
    from ..registry import ModelSource, load_registry

    if args.target:
        path = Path(args.target).expanduser()
        if path.suffix == ".gguf":
            source = ModelSource("gguf", str(path.resolve().parent), gguf_file=path.name)
        elif path.exists():
            source = ModelSource("path", str(path.resolve()))
        else:
            source = ModelSource("hub", args.target)
    else:
        source = load_registry(args.registry).get(args.pair).target
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        from ..errors import DFlashError

        raise DFlashError(f"unknown stage(s) {unknown}; allowed: {', '.join(STAGES)}")
    settings = TrainSettings()
    for f in dataclasses.fields(TrainSettings):
        value = getattr(args, f.name)
        if value is not None:
            setattr(settings, f.name, value)
    target = load_target(source, args.target_dtype, args.device, progress=_log)
    options = RecipeOptions(
        work_dir=args.work_dir, out_dir=args.out, prompts_file=args.prompts,
        gen_batch_size=args.gen_batch_size, gen_max_new_tokens=args.gen_max_new_tokens,
        gen_time_budget_s=args.gen_minutes * 60 if args.gen_minutes else None,
        gen_token_budget=args.gen_tokens, gen_max_prompts=args.gen_max_prompts,
        feature_layers=args.feature_layers, eval_prompts=args.eval_prompts, draft_vocab=args.draft_vocab,
        command="python -m dflash_core " + " ".join(shlex.quote(a) for a in sys.argv[1:]), settings=settings,
    )
    result = run_recipe(target, options, stages)
    print(json.dumps(result, indent=2, default=str))
    return 0
