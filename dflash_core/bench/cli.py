"""``python -m dflash_core bench``: DFlash vs the same engine's AR, HF generate(), prompt lookup,
transformers' own DFlash and llama.cpp."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch


def _methods(text: str) -> tuple[str, ...]:
    from .runner import METHODS

    items = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in items if m not in METHODS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown method(s) {bad}; allowed: {', '.join(METHODS)}")
    return items


def add_bench_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmark DFlash against AR, transformers generate() and prompt lookup")
    b.add_argument("--pair", help="registry pair (default: the default pair)")
    b.add_argument("--prompts", default="humaneval",
                   help="humaneval | mt-bench | heldout | path to a JSONL file: one object per line with 'prompt' "
                        "(text), 'messages' (a conversation ending with the user's) or 'turns' (user turns answered "
                        "in order, as MT-Bench); see dflash_core/bench/prompts.py")
    b.add_argument("--limit", type=int, default=20, help="first N prompts (a multi-turn record counts once)")
    b.add_argument("--offset", type=int, default=0, help="skip the first N prompts")
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--block-size", type=int, default=None)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--rules", default="match", help="acceptance rules at temperature > 0: match, pq or match,pq")
    b.add_argument("--methods", type=_methods, default=("dflash", "ar", "hf_generate", "prompt_lookup"))
    b.add_argument("--prompt-lookup-tokens", type=int, default=10)
    b.add_argument("--warmup", type=int, default=1, help="prompts run once, untimed, before measuring")
    b.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    b.add_argument("--full-vocab-drafts", action="store_true",
                   help="our drafter drafts over the whole vocabulary, not its draft vocabulary (as transformers' "
                        "assistant does: the hf_dflash comparison on equal terms)")
    b.add_argument("--out", type=Path, required=True, help="directory for results.json and report.html")
    b.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from ..console import log
    from ..engine import Engine
    from ..errors import SettingsError
    from ..hardware import hardware_summary
    from ..request import Request
    from .prompts import load_bench_prompts
    from .report import markdown_summary, write_html, write_results
    from .runner import Bench, summarize

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.limit < 1:
        raise SettingsError(f"--limit {args.limit}: must be at least 1")
    rules = tuple(r.strip() for r in args.rules.split(",") if r.strip())
    prompts = load_bench_prompts(args.prompts)[args.offset : args.offset + args.limit]
    if not prompts:
        raise SettingsError(f"--offset {args.offset}: {args.prompts} has no prompts past it")
    engine = Engine.from_registry(args.pair, args.registry, progress=log)
    if args.full_vocab_drafts:
        engine.drafter.set_draft_vocab(None)
    request = Request(max_new_tokens=args.max_new_tokens, block_size=args.block_size, temperature=args.temperature,
                      seed=args.seed)
    bench = Bench(engine, request, args.methods, args.prompt_lookup_tokens, rules if args.temperature > 0 else ("match",))
    # The settings as every run gets them; a mistake in them is refused before any run starts.
    config = engine.resolve(bench.asked(prompts[0])).config
    log(f"bench: {len(prompts)} prompts ({sum(p.turns for p in prompts)} turns) from {args.prompts}, "
        f"methods {','.join(args.methods)}, "
        f"B={config.block_size}, T={config.temperature}, {args.max_new_tokens} new tokens")
    records = bench.run(prompts, warmup=args.warmup, log=log)
    summary = summarize(records, config.block_size, config.temperature)
    if config.temperature == 0:
        from .partings import partings

        summary["partings"] = partings(engine, records)  # untimed: after every run
    settings = {
        "command": "python -m dflash_core " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "pair": engine.pair.name, "prompts": args.prompts, "offset": args.offset, "limit": len(prompts),
        "turns": sum(p.turns for p in prompts),
        "max_new_tokens": args.max_new_tokens, "block_size": config.block_size, "temperature": config.temperature,
        "rules": list(bench.rules), "methods": list(args.methods), "warmup": args.warmup, "dtype": engine.pair.dtype,
        "runner": type(engine.target.runner).__name__, "threads": torch.get_num_threads(),
        "weights": getattr(engine.target.runner, "weight_format", "bf16"),
        "kernels": getattr(engine.target.runner, "kernels", "onednn"),
        "draft_vocab": None if engine.drafter.draft_vocab is None else int(engine.drafter.draft_vocab.numel()),
        "machine": hardware_summary(), "torch": torch.__version__,
    }
    if "llama_cpp" in args.methods:
        from importlib.metadata import version

        settings["llama_cpp_python"] = version("llama_cpp_python")
    write_results(args.out, settings, summary, records)
    write_html(args.out, settings, summary, records)
    (args.out / "summary.md").write_text(markdown_summary(settings, summary), encoding="utf-8")
    print(json.dumps(summary, indent=2))
    if summary.get("lossless") is False:
        log(f"WARNING: greedy DFlash output differed from AR on prompts {summary['mismatched_prompts']} "
            f"(by method: {summary.get('mismatched_by_method')})")
    return 0


def add_bench_report_parser(sub: Any) -> None:
    r = sub.add_parser("bench-report", help="write docs/BENCHMARKS.md from bench result directories")
    r.add_argument("runs", nargs="+", type=Path, help="bench --out directories (each holds results.json), in order")
    r.add_argument("--drafter", type=Path, help="drafter directory whose training_info.json to include")
    r.add_argument("--notes", type=Path, help="a Markdown file of hand-written analysis, appended under 'Notes'")
    r.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    r.add_argument("--made-by", default="make benchmarks", help="the command that runs the runs and writes the page")
    r.set_defaults(func=cmd_bench_report)


def cmd_bench_report(args: argparse.Namespace) -> int:
    from ..errors import SettingsError
    from .report import benchmarks_markdown

    runs = []
    for directory in args.runs:
        path = directory / "results.json"
        if not path.is_file():
            raise SettingsError(f"{path} does not exist: run `python -m dflash_core bench --out {directory}` first")
        runs.append(json.loads(path.read_text()))
    info = None
    if args.drafter is not None:
        info_file = args.drafter / "training_info.json"
        info = json.loads(info_file.read_text()) if info_file.is_file() else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    page = benchmarks_markdown(runs, info, args.made_by)
    if args.notes is not None:
        if not args.notes.is_file():
            raise SettingsError(f"--notes {args.notes} does not exist")
        page += "\n## Notes (written by hand, from the tables above)\n\n" + args.notes.read_text(encoding="utf-8")
    args.out.write_text(page, encoding="utf-8")
    print(args.out)
    return 0
