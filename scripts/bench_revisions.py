"""The bench on two revisions of the engine, interleaved: is a change "same outputs, same speed"?

    python scripts/bench_revisions.py --base a106fa5 [--rounds 2] [--out runs/revisions] -- \
        --prompts humaneval --limit 10 --max-new-tokens 256 --block-size 16 --methods dflash,ar

Checks ``--base`` out into a temporary git worktree and runs ``python -m dflash_core bench`` with
the arguments after ``--`` from it and from this checkout in turn (base, head, head, base, ...: an
even number of rounds balances both slow drift and the place of a run in its round). Prints, per method, each revision's decode
tokens/s (median over rounds) and their ratio, and whether every prompt's acceptance lengths and
token counts (and DFlash == AR) came out the same on both: a restructuring must change none of
them. Adaptive variants decide from measured times, so theirs may differ between runs of the same
code; their outputs are still checked against AR by the bench itself. With ``ar`` among the
methods it also prints each method against AR within the same run (per prompt and round, the
median): drift between runs cancels there. ``--from-runs`` prints the same from the runs already
in ``--out``, running nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench(tree: Path, args: list[str], out: Path) -> dict:
    """One bench run with ``tree``'s code (first on the path, ahead of the editable install)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, "-m", "dflash_core", "bench", *args, "--out", str(out)], cwd=tree, env=env,
                   check=True)
    return json.loads((out / "results.json").read_text())


def fingerprint(results: dict) -> dict:
    """What must not change: per prompt and method, token count and acceptance lengths."""
    return {(row["index"], name): (entry["tokens"], entry.get("acceptance_lengths"), row.get("dflash_equals_ar"))
            for row in results["prompts"] for name, entry in row["methods"].items()}


def against_ar(runs: list[dict], method: str) -> float:
    """``method``'s decode tokens/s over AR's, per prompt of each run: the median."""
    def speed(entry: dict) -> float:
        return entry["tokens"] / entry["decode_seconds"]

    return statistics.median(speed(row["methods"][method]) / speed(row["methods"]["ar"])
                             for results in runs for row in results["prompts"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the revision to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "revisions")
    parser.add_argument("--from-runs", action="store_true", help="report the runs already in --out, run nothing")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: the bench's own arguments")
    opts = parser.parse_args()
    args = [a for a in opts.bench_args if a != "--"]
    opts.out = opts.out.resolve()  # each bench runs from its own tree
    if opts.from_runs:
        runs = {label: [json.loads(f.read_text()) for f in sorted(opts.out.glob(f"{label}-*/results.json"))]
                for label in ("base", "head")}
        if not runs["base"] or len(runs["base"]) != len(runs["head"]):
            sys.exit(f"--from-runs: {opts.out} holds {len(runs['base'])} base and {len(runs['head'])} head runs "
                     f"(base-N/results.json, head-N/results.json); it needs as many of each, at least one")
        return report(runs, opts, args)
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), opts.base], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            runs: dict[str, list[dict]] = {"base": [], "head": []}
            # ABBA: each round runs the other revision first, so that drift and whatever favours a
            # run by its place in the round fall on both alike. What the tool cannot resolve: the
            # same code on both sides gave head / base 0.87 (ABAB) and 0.93 (ABBA) for AR on the
            # EPYC (docs/benchmark-notes-amd.md).
            for r in range(opts.rounds):
                order = (("base", base_tree), ("head", ROOT))
                for label, tree in (order if r % 2 == 0 else order[::-1]):
                    runs[label].append(bench(tree, args, opts.out / f"{label}-{r}"))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
    return report(runs, opts, args)


def report(runs: dict[str, list[dict]], opts: argparse.Namespace, args: list[str]) -> int:
    """Print and write (``revisions.json``) what ``runs`` (per revision, each round's results) say."""
    methods = sorted(runs["head"][0]["summary"]["decode_tokens_per_s"])
    summary = {"base": opts.base, "bench_args": args, "rounds": len(runs["head"]), "methods": {}}
    print(f"{'method':32} {'base tok/s':>11} {'head tok/s':>11} {'head/base':>9}  same outputs")
    for m in methods:
        speed = {label: statistics.median(r["summary"]["decode_tokens_per_s"][m] for r in rs) for label, rs in runs.items()}
        same = all(fingerprint(b).get(k) == v for b, h in zip(runs["base"], runs["head"])
                   for k, v in fingerprint(h).items() if k[1] == m)
        summary["methods"][m] = {**speed, "ratio": round(speed["head"] / speed["base"], 3), "same_outputs": same}
        print(f"{m:32} {speed['base']:11.2f} {speed['head']:11.2f} {speed['head'] / speed['base']:9.3f}  {same}")
    if "ar" in methods:
        print(f"{'against AR within each run':32} {'base':>11} {'head':>11} {'head/base':>9}")
        for m in methods:
            if m != "ar":
                ratio = {label: against_ar(rs, m) for label, rs in runs.items()}
                summary["methods"][m]["vs_ar_within_runs"] = {k: round(v, 3) for k, v in ratio.items()}
                print(f"{m:32} {ratio['base']:11.3f} {ratio['head']:11.3f} {ratio['head'] / ratio['base']:9.3f}")
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "revisions.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
