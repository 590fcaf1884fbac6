"""Where a decode step of the generate stage goes: the figures docs/TRAINING.md cites.

    python scripts/profile_generation.py --responses runs/smollm2-v2/responses --out runs/genprofile

Measures, on the default pair's target (bf16, CPU) and ``--rows`` training prompts:

* transformers ``generate()``: time per decode step of a left-padded batch (a run of 1 new
  token, the prefill, subtracted from a run of ``1 + --steps``; ``min_new_tokens`` keeps every
  row decoding);
* the matrix products alone of one step of that many rows (every layer's projections and the LM
  head, FastTarget's fused weights): the floor a decoder cannot go under;
* our continuous-batching decoder: a step with every slot holding ``--cached`` positions, and its
  prompt prefill in tokens/s;
* with ``--responses``, the share of the generate stage's answers that ended (EOS) before the
  token cap, i.e. rows a fixed batch keeps computing as padding.

Results go to ``<out>/profile.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable

import torch

from dflash_core.loading import load_target
from dflash_core.registry import load_registry
from dflash_core.training.batched_decode import ContinuousBatchDecoder
from dflash_core.training.prompt_sources import read_prompts, split
from dflash_core.training.selfdistill import chat_ids, read_samples


def _seconds(fn: Callable[[], object], repeats: int = 1) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="smollm2-135m")
    parser.add_argument("--prompt-file", default="assets/data/train_prompts.jsonl.gz")
    parser.add_argument("--offset", type=int, default=8000)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed for generate()")
    parser.add_argument("--cached", type=lambda s: [int(x) for x in s.split(",")], default=[150, 350])
    parser.add_argument("--responses", type=Path, default=None, help="a generate stage's responses/ folder")
    parser.add_argument("--out", type=Path, default=Path("runs/genprofile"))
    args = parser.parse_args()

    target = load_target(load_registry().get(args.pair).target, "bfloat16", "cpu")
    model, runner, tokenizer = target.model, target.runner, target.tokenizer
    train, _ = split(read_prompts(args.prompt_file))
    prompts = [chat_ids(tokenizer, p.messages) for p in train[args.offset : args.offset + args.rows]]
    report: dict = {"rows": args.rows, "threads": torch.get_num_threads()}

    # transformers generate(), left-padded like the generate stage's fallback path.
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention[row, width - len(ids):] = 1

    def generate(new: int) -> None:
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)

    generate(2)  # warm-up
    prefill = _seconds(lambda: generate(1))
    total = _seconds(lambda: generate(1 + args.steps))
    report["hf_generate_ms_per_step"] = round((total - prefill) / args.steps * 1000, 1)
    report["hf_generate_prefill_tok_s"] = round(int(attention.sum()) / prefill, 1)

    # The matrix products of one step: the floor under any decoder of these rows.
    x = torch.randn(args.rows, runner.embed_weight.shape[1], dtype=runner.dtype)
    attention_out = torch.randn(args.rows, runner.num_heads * runner.head_dim, dtype=runner.dtype)

    def products() -> None:
        with torch.inference_mode():
            for layer in runner.layers:
                layer.qkv(x)
                layer.o(attention_out)
                gate, up = layer.gate_up(x).chunk(2, dim=-1)
                layer.down(gate * up)
            runner.logits(x)

    products()
    report["matrix_products_ms_per_step"] = round(_seconds(products, 5) * 1000, 1)

    # Our decoder: every slot filled to a given length, then one step timed.
    vocab = int(target.config.vocab_size)
    for cached in args.cached:
        decoder = ContinuousBatchDecoder(runner, args.rows, cached + 16)
        ids = torch.randint(4, vocab, (args.rows, cached), generator=torch.Generator().manual_seed(cached))
        prefill_s = _seconds(lambda: [decoder.prefill(slot, ids[slot]) for slot in range(args.rows)])
        tokens = torch.randint(4, vocab, (args.rows,))
        decoder.step(tokens)  # warm-up (the cache grows to cached + 1)
        report[f"continuous_ms_per_step_at_{cached}"] = round(_seconds(lambda: decoder.step(tokens), 5) * 1000, 1)
        report[f"continuous_prefill_tok_s_at_{cached}"] = round(args.rows * cached / prefill_s, 1)

    if args.responses is not None:
        samples = read_samples(args.responses)
        report["answers"] = len(samples)
        report["answers_ended_before_cap"] = round(sum(s.finished for s in samples) / max(len(samples), 1), 3)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
