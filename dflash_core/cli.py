"""Command line: ``python -m dflash_core {pairs, generate, serve, train, bench}``.

Results go to stdout (one JSON object with ``--json``); progress and logs go to stderr. A
mistake in the input exits with status 2 and a one-line message that says what is allowed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

from . import isa_emulation
from .console import log, quiet_libraries
from .errors import DFlashError


# ------------------------------------------------------------------------------------------ pairs
def cmd_pairs(args: argparse.Namespace) -> int:
    from .loading import device_problem, kernels_refusal
    from .registry import load_registry, local_gpu_memory_gb, memory_problem

    registry = load_registry(args.registry)
    gpus = local_gpu_memory_gb()
    rows = []
    for name, pair in registry.pairs.items():
        problem, memory = device_problem(pair), memory_problem(pair, gpus)
        if problem and memory and not gpus:  # no GPU at all: say so once, with what the pair would need
            problem = f"{problem} (it needs about {pair.gpu_memory_gb:g} GiB of GPU memory)"
        else:
            problem = "; ".join(p for p in (problem, memory) if p) or None
        rows.append({
            "name": name,
            "default": name == registry.default,
            "description": pair.description,
            "target": pair.target.describe(),
            "drafter": pair.drafter.describe(),
            "dtype": pair.dtype,
            "target_device": pair.target_device,
            "drafter_device": pair.drafter_device,
            "quantization": pair.quantization,
            "enable_thinking": pair.enable_thinking,
            "gpu_memory_gb": pair.gpu_memory_gb,
            "weights": pair.weights,
            "otherwise": pair.otherwise.name if pair.otherwise else None,
            "runnable": problem is None,
            "reason": problem,
            # where this CPU cannot run the pair's kernels: the pair loaded instead, and why
            "loads_instead": (None if pair.otherwise is None or not (why := kernels_refusal(pair))
                              else {"pair": pair.otherwise.name, "why": why}),
        })
    if args.json:
        print(json.dumps({"registry": str(registry.path), "default": registry.default, "pairs": rows}, indent=2))
        return 0
    print(f"registry: {registry.path}")
    for row in rows:
        mark = "*" if row["default"] else " "
        status = "ok" if row["runnable"] else f"unavailable here: {row['reason']}"
        if row["runnable"] and row["loads_instead"]:
            status = f"ok, as {row['loads_instead']['pair']} ({row['loads_instead']['why']})"
        print(f"{mark} {row['name']:<22} {row['dtype']:<9} {row['target_device']:<6} {status}")
        print(f"    {row['description']}")
        print(f"    target:  {row['target']}")
        print(f"    drafter: {row['drafter']}")
        needs = [f"~{row['gpu_memory_gb']:g} GiB GPU memory"] if row["gpu_memory_gb"] else []
        if row["enable_thinking"] is not None:
            needs.append(f"thinking {'on' if row['enable_thinking'] else 'off'}")
        if needs:
            print(f"    {', '.join(needs)}")
    return 0


# --------------------------------------------------------------------------------------- generate
def result_json(engine: Any, result: Any, mode: str, prompt_tokens: int) -> dict[str, Any]:
    tokens = result.token_ids
    cycles = [
        {"drafted": e.drafted, "num_accepted": e.num_accepted, "bonus": e.bonus, "committed": e.committed,
         "draft_s": round(e.draft_s, 6), "verify_s": round(e.verify_s, 6), "tree_nodes": e.tree_nodes,
         "lookup_nodes": e.lookup_nodes, "lookup_only": e.lookup_only,
         "lookup_drafted": e.lookup_drafted, "answer_nodes": e.answer_nodes}
        for e in result.cycles
    ] if mode == "dflash" else []
    return {
        "pair": engine.pair.name,
        "mode": mode,
        "prompt_tokens": prompt_tokens,
        "token_ids": tokens,
        "text": engine.decode(tokens),
        "finish_reason": result.finish_reason,
        "num_tokens": len(tokens),
        "prefill_s": round(result.prefill_s, 6),
        "decode_s": round(result.decode_s, 6),
        "tokens_per_s": round(len(tokens) / result.decode_s, 3) if result.decode_s > 0 else None,
        "tau": round(result.tau, 4) if mode == "dflash" else None,
        "cycles": cycles,
    }


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine import Engine
    from .prompting import check_prompt_text, max_new_tokens_limit
    from .request import AR, VARIANTS, Request, dflash_variant
    from .speculative import collect

    chosen = VARIANTS[AR] if args.mode == AR else dflash_variant(args.tree, args.lookup, args.adaptive)
    request = Request(
        prompt=args.prompt, raw=args.raw, thinking=args.thinking, variant=chosen.name,
        max_new_tokens=args.max_new_tokens, block_size=args.block_size, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, rule=args.rule,
    )
    # Refuse what is wrong on its face before spending seconds loading models; the block size's
    # upper bound (the drafter's) and the context length are checked once they are known.
    check_prompt_text(args.prompt)
    request.generation_config().validated(max_block_size=1 << 20, max_new_tokens_limit=max_new_tokens_limit())
    engine = Engine.from_registry(args.pair, args.registry, progress=log)
    resolved = engine.resolve(request)
    mode = resolved.mode
    events = engine.stream_ids(resolved.prompt_ids, resolved.config)
    if args.json:
        result = collect(events)
        out = result_json(engine, result, mode, len(resolved.prompt_ids))
        out["enable_thinking"] = resolved.thinking  # None: the template's default
        print(json.dumps(out, ensure_ascii=False))
        return 0

    def echo(events_iter: Any) -> Any:
        # Stream the text as cycles commit it (decoding the whole output keeps multi-byte
        # characters whole).
        tokens: list[int] = []
        shown = ""
        for event in events_iter:
            tokens.extend(event.committed)
            text = engine.decode(tokens)
            if text.startswith(shown):
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
            yield event

    result = collect(echo(events))
    print()
    rate = len(result.token_ids) / result.decode_s if result.decode_s > 0 else float("nan")
    summary = f"[{mode}] {len(result.token_ids)} tokens, {rate:.1f} tok/s, finish={result.finish_reason}"
    if mode == "dflash":
        summary += f", tau={result.tau:.2f} over {len(result.cycles)} cycles"
    log(summary)
    return 0


# ------------------------------------------------------------------------------------------ serve
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from app.service import StudioService  # the studio's engine holder, so both front ends load pairs alike

    from .serving import build_app

    service = StudioService(args.registry)
    name = service.registry.get(args.pair).name  # an unknown pair fails here, before the server starts
    service.preload(name)
    if args.host not in LOOPBACK and not os.environ.get("DFLASH_API_KEY"):
        log(f"warning: serving on {args.host} without an API key: anyone who can reach this port can generate "
            f"(set DFLASH_API_KEY to require one)")
    log(f"OpenAI-compatible API on http://{args.host}:{args.port}/v1 (models: {', '.join(service.registry.pairs)}; "
        f"loading {name} in the background)")
    uvicorn.run(build_app(service), host=args.host, port=args.port, log_level="warning")
    return 0


# -------------------------------------------------------------------------------------- export-hf
def cmd_export_hf(args: argparse.Namespace) -> int:
    import torch

    from .hf_export import export_hf_assistant

    info = export_hf_assistant(args.drafter, args.out, dtype=getattr(torch, args.dtype))
    for note in info["notes"]:
        log(f"note: {note}")
    print(json.dumps(info, indent=2))
    return 0


# ------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dflash_core", description=__doc__.splitlines()[0])
    parser.add_argument("--registry", help="path of models.toml (default: $DFLASH_MODELS_TOML or the project's)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pairs", help="list the target/drafter pairs of the registry")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_pairs)

    g = sub.add_parser("generate", help="generate with DFlash or the autoregressive baseline")
    g.add_argument("--prompt", required=True)
    g.add_argument("--pair", help="pair name (default: the registry's default)")
    g.add_argument("--mode", choices=("dflash", "ar"), default="dflash")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--rule", choices=("match", "pq"), default="match", help="acceptance rule at temperature > 0")
    g.add_argument("--adaptive", action="store_true",
                   help="verify only as many drafts as pay off (drafter confidence vs measured verify cost)")
    g.add_argument("--tree", action="store_true",
                   help="verify a tree of the drafter's likeliest continuations instead of one chain (greedy or rule match)")
    g.add_argument("--lookup", action="store_true",
                   help="also verify, in the same target pass, what followed the last tokens where they occurred "
                        "before in the prompt or the answer (prompt lookup; greedy or rule match)")
    g.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    g.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="turn the chat template's thinking mode on or off (enable_thinking; default: the pair's "
                        "enable_thinking in models.toml, else the template's own)")
    g.add_argument("--json", action="store_true", help="print one JSON object with token ids, text and cycles")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models)")
    s.add_argument("--pair", help="pair to load at start (default: the registry's default); every pair is served")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.set_defaults(func=cmd_serve)

    from .training.cli import add_train_parser

    add_train_parser(sub)
    from .bench.cli import add_bench_parser, add_bench_report_parser

    x = sub.add_parser("export-hf", help="write a drafter as transformers' own DFlash assistant "
                                         "(generate(..., assistant_model=A, speculation_type='dflash'))")
    x.add_argument("--drafter", required=True, help="drafter directory in the z-lab format")
    x.add_argument("--out", required=True, help="directory for the assistant (config.json + safetensors)")
    x.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    x.set_defaults(func=cmd_export_hf)

    add_bench_parser(sub)
    add_bench_report_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    quiet_libraries()
    parser = build_parser()
    args = parser.parse_args(argv)
    if os.environ.get(isa_emulation.VARIABLE):  # started by `env $(python -m dflash_core.isa_emulation ISA) ...`
        log(f"running as a CPU with {isa_emulation.apply()} only (dflash_core/isa_emulation.py)")
    try:
        return int(args.func(args) or 0)
    except DFlashError as exc:
        log(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        log("interrupted")
        return 130
