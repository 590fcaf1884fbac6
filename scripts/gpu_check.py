"""GPU check: lossless and speed on a tiny random Qwen3 pair, in well under 5 minutes.

    python3 scripts/gpu_check.py --out runs/gpu_check.json

It needs torch and transformers (the tiny models and drafters are the tests' own, from
dflash_core/testing.py); a lent GPU machine's own python3 has both, and the project need not be
installed there. ``--device cpu`` runs the same checks on the CPU (on shorter answers: there it
only tries the script's paths), as the test suite does, so the script is known to work before a
GPU is at hand.

Checks, on CUDA: greedy DFlash == greedy AR for the fast and the generic runner, in bf16 and
fp32, block sizes 2..16 (chains; trees and prompt lookup too on the fast runner), with a random
and an oracle drafter; drafter on the CPU with the target on the GPU (different devices); a 4-bit
bitsandbytes target when bitsandbytes is installed; hybrid targets (qwen3_5, qwen3_5_moe,
qwen3_next: Gated DeltaNet + full attention) and gpt_oss (sliding window 8 + full attention) on
the generic runner in fp32, whose rollbacks restore linear-attention states and sliding windows
(``dflash_core/rollback.py``); in bf16 those are reported, not counted (``hybrid_bf16``: blocks
and single tokens may round differently there, so outputs can part at near-ties).
Speed: CUDA-event timing of AR vs DFlash with the oracle drafter (every draft accepted), which
shows what the loop costs when the drafter is perfect. CUDA graphs (``cuda_graphs``): the
graphed runner's logits and tokens equal the eager runner's, DFlash through graphs equals AR,
and both are timed with and without graphs (``cuda_graphs``). Exit status 1 when any check fails.
Stopped by SIGINT (``timeout -s INT N``, as scripts/gpu_carry.py's last call runs it when the
call's time runs short), it still writes the report, with the checks that ran and ``stopped``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # dflash_core (and its tiny test models), uninstalled


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check.json"))
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu to try the script itself")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: this script checks the GPU path (--device cpu runs it on the CPU)")
    started = time.time()
    import transformers

    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "transformers": transformers.__version__, "checks": [], "speed": {}}
    print(f"gpu_check: checking on {report['device']}", file=sys.stderr, flush=True)
    try:
        run_checks(device, report)
    except KeyboardInterrupt:  # `timeout -s INT N`, or Ctrl-C: what was checked is still reported
        report["stopped"] = "interrupted (SIGINT) before the end: only the checks listed ran"
    report["failures"] = failures = failures_in(report)
    report["seconds"] = round(time.time() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "checks"}, indent=2))
    sys.exit(1 if failures or "stopped" in report else 0)


def failures_in(report: dict) -> int:
    """The failed checks a report lists: every row of ``checks`` (the hybrid families' fp32 ones
    among them; their bf16 ones, in ``hybrid_bf16``, are only reported) and of CUDA graphs'."""
    graphs = report.get("cuda_graphs", {}).get("checks", [])
    return sum(not row["lossless"] for row in report["checks"]) + sum(not row["ok"] for row in graphs)


def run_checks(device: torch.device, report: dict) -> None:
    """Every check, its rows added to ``report`` as they run."""
    from dflash_core.bench.runner import Timer
    from dflash_core.speculative import GenerationConfig, collect, stream
    from dflash_core.target import FastTarget, HFTarget
    from dflash_core.testing import OracleDrafter, tiny_drafter, tiny_target

    prompt = [5, 17, 42, 8, 9, 60, 3, 77]
    # Answers' lengths (checked, timed): shorter on the CPU, where the script only tries its paths.
    n_check, n_timed = (64, 256) if device.type == "cuda" else (32, 64)
    for dtype in (torch.bfloat16, torch.float32):
        model = tiny_target("qwen3", vocab=512, layers=4, seed=0, dtype=dtype).to(device)
        for runner_name, runner in (("fast", FastTarget(model)), ("hf", HFTarget(model))):
            ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=n_check, block_size=1).validated(16)))
            for drafter_device in dict.fromkeys((device, torch.device("cpu"))):  # same or different devices
                base = tiny_drafter(model.to("cpu"), layers=1).to(drafter_device, dtype)
                model.to(device)
                oracle = OracleDrafter(base, prompt + ar.token_ids).to(drafter_device, dtype)
                for block in (2, 4, 8, 16):
                    # Trees and prompt lookup need the fast runner (HFTarget refuses them).
                    fast = runner_name == "fast"
                    for tree, lookup in ((False, False), (True, False), (False, True), (True, True))[: 4 if fast else 1]:
                        cfg = GenerationConfig(max_new_tokens=n_check, block_size=block, tree=tree, lookup=lookup).validated(16)
                        for name, drafter in (("random", base), ("oracle", oracle)):
                            out = collect(stream(runner, drafter, prompt, cfg))
                            ok = out.token_ids == ar.token_ids
                            report["checks"].append({"dtype": str(dtype), "runner": runner_name, "drafter": name,
                                                     "drafter_device": str(drafter_device), "block": block, "tree": tree, "lookup": lookup,
                                                     "lossless": ok, "tau": round(out.tau, 3)})
        if dtype == torch.bfloat16:
            runner = FastTarget(model)
            timer = Timer(device)
            ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=n_timed, block_size=1).validated(16)))
            oracle = OracleDrafter(tiny_drafter(model.to("cpu"), layers=1).to(device, dtype), prompt + ar.token_ids)
            model.to(device)
            for _ in range(2):  # warm-up
                collect(stream(runner, oracle, prompt, GenerationConfig(max_new_tokens=n_timed, block_size=16).validated(16)))
            _, t_ar = timer(lambda: collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=n_timed, block_size=1).validated(16))))
            _, t_df = timer(lambda: collect(stream(runner, oracle, prompt, GenerationConfig(max_new_tokens=n_timed, block_size=16).validated(16))))
            report["speed"] = {"ar_tok_s": round(n_timed / t_ar, 1), "dflash_oracle_tok_s": round(n_timed / t_df, 1),
                               "ratio": round(t_ar / t_df, 2)}
    check_cuda_graphs(device, prompt, report)
    check_hybrid_families(device, prompt, report)
    try:
        import bitsandbytes  # noqa: F401
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        folder = Path(tempfile.mkdtemp(prefix="dflash-gpu-check-"))
        tiny_target("qwen3", vocab=512, layers=4, seed=0).save_pretrained(folder)
        q = AutoModelForCausalLM.from_pretrained(folder, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16), device_map={"": str(device)})
        runner = HFTarget(q)
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=48, block_size=1).validated(16)))
        drafter = tiny_drafter(q, layers=1).to(device, torch.bfloat16)
        out = collect(stream(runner, drafter, prompt, GenerationConfig(max_new_tokens=48, block_size=8).validated(16)))
        ok = out.token_ids == ar.token_ids
        report["checks"].append({"dtype": "nf4", "runner": "hf", "drafter": "random", "block": 8, "lossless": ok})
    except ImportError:
        report["bitsandbytes"] = "not installed: 4-bit check skipped"


def check_cuda_graphs(device: torch.device, prompt: list[int], report: dict) -> None:
    """FastTarget's CUDA graphs (``dflash_core/cuda_graphs.py``, on by default on CUDA) against the
    same runner eager: equal logits and tokens, DFlash == AR through graphs, and AR / DFlash with
    the oracle drafter timed both ways. On the CPU the graphs' stand-in (``eager_capture``) runs
    the same bookkeeping, so the script's path is tried before a GPU is at hand."""
    from dflash_core.bench.runner import Timer
    from dflash_core.cuda_graphs import CudaGraphs, eager_capture
    from dflash_core.speculative import GenerationConfig, collect, stream
    from dflash_core.target import FastTarget
    from dflash_core.testing import OracleDrafter, tiny_drafter, tiny_target

    # Answers long enough to replay each graph many times; shorter on the CPU, where it only tries the path.
    n_check, n_timed = (96, 256) if device.type == "cuda" else (32, 24)
    report["cuda_graphs"] = graphs_report = {"checks": [], "speed": {}}
    for dtype in (torch.bfloat16, torch.float32):
        model = tiny_target("qwen3", vocab=512, layers=4, seed=0, dtype=dtype).to(device)
        eager, graphed = FastTarget(model), FastTarget(model)
        eager.graphs = None
        if device.type != "cuda":
            graphed.graphs = CudaGraphs(graphed, capture=eager_capture)
        block = torch.tensor(prompt + prompt)[:16]
        for runner in (eager, graphed):
            runner.reset(128)
            runner.forward(torch.tensor(prompt), [1, 3])
        logits = [runner.forward(block, [1, 3]).logits for runner in (eager, graphed)]  # captured
        for runner in (eager, graphed):
            runner.truncate(len(prompt))
        replayed = graphed.forward(block, [1, 3]).logits  # replayed
        same_logits = bool(torch.equal(logits[0], logits[1]) and torch.equal(logits[0], replayed))
        def greedy(runner, drafter, size, n=n_check):
            cfg = GenerationConfig(max_new_tokens=n, block_size=size).validated(16)
            return collect(stream(runner, drafter, prompt, cfg))
        ar_eager, ar_graphed = greedy(eager, None, 1), greedy(graphed, None, 1)
        base = tiny_drafter(model.to("cpu"), layers=1).to(device, dtype)
        model.to(device)
        oracle = OracleDrafter(base, prompt + ar_eager.token_ids).to(device, dtype)
        lossless = all(greedy(graphed, drafter, size).token_ids == ar_graphed.token_ids
                       for drafter in (base, oracle) for size in (4, 16))
        ok = same_logits and ar_graphed.token_ids == ar_eager.token_ids and lossless
        g = graphed.graphs
        graphs_report["checks"].append({
            "dtype": str(dtype), "same_logits_as_eager": same_logits, "ar_same_as_eager": ar_graphed.token_ids == ar_eager.token_ids,
            "dflash_lossless": lossless, "captures": g.captures, "replays": g.replays, "broken": g.broken, "ok": ok})
        if dtype == torch.bfloat16:
            timer = Timer(device)
            for runner in (eager, graphed):  # warm-up: graphs captured, kernels loaded
                greedy(runner, oracle, 16, n_timed)
                greedy(runner, None, 1, n_timed)
            # Interleaved, two rounds, the faster of each: a one-off stall hits either side alike.
            times: dict[tuple[str, str], float] = {}
            for _ in range(2):
                for name, runner in (("eager", eager), ("graphs", graphed)):
                    for method, drafter, size in (("ar_tok_s", None, 1), ("dflash_oracle_tok_s", oracle, 16)):
                        _, took = timer(lambda: greedy(runner, drafter, size, n_timed))
                        times[name, method] = min(took, times.get((name, method), float("inf")))
            speed = {name: {method: round(n_timed / times[name, method], 1) for method in ("ar_tok_s", "dflash_oracle_tok_s")}
                     for name in ("eager", "graphs")}
            speed["graphs_vs_eager_ar"] = round(speed["graphs"]["ar_tok_s"] / speed["eager"]["ar_tok_s"], 2)
            speed["graphs_vs_eager_dflash"] = round(
                speed["graphs"]["dflash_oracle_tok_s"] / speed["eager"]["dflash_oracle_tok_s"], 2)
            graphs_report["speed"] = speed


def check_hybrid_families(device: torch.device, prompt: list[int], report: dict) -> None:
    """Greedy DFlash == greedy AR on the generic runner for the hybrid and sliding-window
    families, with a random drafter (nearly every draft rejected: a rollback every cycle), one
    right except at every fifth position (rollbacks partway through blocks) and an oracle; the
    fp32 rows count as checks, the bf16 ones are reported (``hybrid_bf16``)."""
    from dflash_core.speculative import GenerationConfig, collect, stream
    from dflash_core.target import HFTarget
    from dflash_core.testing import OracleDrafter, SometimesRightDrafter, hybrid_drafter, tiny_target

    n_check = 48 if device.type == "cuda" else 32  # shorter on the CPU, where the script only tries its paths
    report["hybrid_bf16"] = []
    for family in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss"):
        for dtype in (torch.float32, torch.bfloat16):
            model = tiny_target(family, vocab=512, layers=4, seed=0, dtype=dtype)
            base = hybrid_drafter(model)
            model.to(device)
            runner = HFTarget(model)
            ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=n_check, block_size=1).validated(16)))
            oracle = OracleDrafter(base, prompt + ar.token_ids).to(device, dtype)
            sometimes = SometimesRightDrafter(base, prompt + ar.token_ids).to(device, dtype)
            for block in (4, 16):
                cfg = GenerationConfig(max_new_tokens=n_check, block_size=block).validated(16)
                for name, drafter in (("random", base.to(device)), ("sometimes", sometimes), ("oracle", oracle)):
                    out = collect(stream(runner, drafter, prompt, cfg))
                    row = {"family": family, "dtype": str(dtype), "runner": "hf", "drafter": name,
                           "drafter_device": str(device), "block": block, "tree": False, "lookup": False,
                           "lossless": out.token_ids == ar.token_ids, "tau": round(out.tau, 3)}
                    if dtype == torch.float32:
                        report["checks"].append(row)
                    else:
                        report["hybrid_bf16"].append(row)


if __name__ == "__main__":
    main()
