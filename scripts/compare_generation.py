"""The generate stage's two decoders side by side, on the same training prompts.

    python scripts/compare_generation.py --prompts 384 --offset 8000 --out runs/genab

Runs transformers' batched ``generate()`` and our continuous-batching decoder (the path the
recipe takes for Llama-family targets) one after the other over the same prompts, reports tokens
per second of each, how many answers are identical, and, for answers that differ, whether the
first difference is a near-tie: the fp32 target's top-2 logit gap there, and which of the two
tokens fp32 greedy decoding would have chosen. Results go to ``<out>/comparison.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from dflash_core.loading import load_target
from dflash_core.registry import load_registry
from dflash_core.training.prompt_sources import read_prompts, split
from dflash_core.training.selfdistill import generate_responses, read_samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="smollm2-135m")
    parser.add_argument("--prompt-file", default="assets/data/train_prompts.jsonl.gz")
    parser.add_argument("--prompts", type=int, default=384)
    parser.add_argument("--offset", type=int, default=8000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--check-divergences", type=int, default=40, help="first differences examined in fp32")
    parser.add_argument("--out", type=Path, default=Path("runs/genab"))
    args = parser.parse_args()

    source = load_registry().get(args.pair).target
    target = load_target(source, "bfloat16", "cpu")
    train, _ = split(read_prompts(args.prompt_file))
    prompts = train[args.offset : args.offset + args.prompts]
    report: dict = {"prompts": len(prompts), "offset": args.offset, "batch_size": args.batch_size,
                    "max_new_tokens": args.max_new_tokens}
    for name, runner in (("continuous", target.runner), ("hf_generate", None)):
        folder = args.out / name
        shutil.rmtree(folder, ignore_errors=True)
        stats = generate_responses(target.model, target.tokenizer, prompts, folder, batch_size=args.batch_size,
                                   max_new_tokens=args.max_new_tokens, runner=runner)
        report[name] = stats
        print(name, stats, flush=True)
    ours = {s.id: s for s in read_samples(args.out / "continuous")}
    theirs = {s.id: s for s in read_samples(args.out / "hf_generate")}
    report["identical_answers"] = sum(ours[k].response_ids == theirs[k].response_ids for k in ours)
    report["speedup"] = report["continuous"]["tokens_per_s"] / report["hf_generate"]["tokens_per_s"]

    reference = load_target(source, "float32", "cpu").model
    gaps, sides = [], {"continuous": 0, "hf_generate": 0, "neither": 0}
    for key in ours:
        a, b = ours[key].response_ids, theirs[key].response_ids
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None:
            continue
        with torch.inference_mode():
            logits = reference(torch.tensor([ours[key].prompt_ids + a[:first]])).logits[0, -1].float()
        top = torch.topk(logits, 2)
        gaps.append(float(top.values[0] - top.values[1]))
        best = int(top.indices[0])
        sides["continuous" if best == a[first] else "hf_generate" if best == b[first] else "neither"] += 1
        if len(gaps) >= args.check_divergences:
            break
    gaps.sort()
    report["divergences_checked"] = len(gaps)
    report["fp32_top2_gap_at_divergence"] = {"median": gaps[len(gaps) // 2], "max": gaps[-1]} if gaps else None
    report["fp32_greedy_sides_with"] = sides
    (args.out / "comparison.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
