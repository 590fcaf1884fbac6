"""results.json and a self-contained HTML report (plotly inlined: it opens offline)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from .runner import PromptRecord, fastest_variant

COLORS = {"dflash": "#2e9d5b", "ar": "#888888", "hf_generate": "#3468c0", "prompt_lookup": "#e39b2d",
          "hf_dflash": "#8e44ad", "llama_cpp": "#c0392b"}


def records_json(records: list[PromptRecord]) -> list[dict[str, Any]]:
    rows = []
    for r in records:
        row: dict[str, Any] = {"index": r.index, "prompt_tokens": r.prompt_tokens, "methods": {}}
        for name, run in r.runs.items():
            entry: dict[str, Any] = {"tokens": len(run.tokens), "seconds": round(run.seconds, 5),
                                     "tokens_per_s": round(run.tokens_per_s, 3)}
            if run.result is not None:
                entry["decode_seconds"] = round(run.decode_seconds or 0.0, 5)
                entry["tau"] = round(run.result.tau, 4)
                entry["acceptance_lengths"] = run.result.acceptance_lengths
                entry["draft_s"] = round(sum(c.draft_s for c in run.result.cycles), 5)
                entry["verify_s"] = round(sum(c.verify_s for c in run.result.cycles), 5)
            elif run.decode_seconds is not None:  # a peer that times its first token (hf_dflash, llama_cpp)
                entry["decode_seconds"] = round(run.decode_seconds, 5)
            if run.result is None and run.acceptance_lengths is not None:
                entry["tau"] = round(sum(run.acceptance_lengths) / len(run.acceptance_lengths), 4) if run.acceptance_lengths else 1.0
                entry["acceptance_lengths"] = run.acceptance_lengths
            row["methods"][name] = entry
        if "dflash" in r.runs and "ar" in r.runs:
            row["dflash_equals_ar"] = r.runs["dflash"].tokens == r.runs["ar"].tokens
        rows.append(row)
    return rows


def _weights(settings: dict) -> str:
    """The target's weight-only format for a report line (``weights`` in models.toml; empty for bf16)."""
    weights = settings.get("weights", "bf16")
    return "" if weights == "bf16" else f", {weights} weights"


def write_results(out: Path, settings: dict[str, Any], summary: dict[str, Any], records: list[PromptRecord]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps({"settings": settings, "summary": summary, "prompts": records_json(records)}, indent=2) + "\n")
    return path


def _figures(summary: dict[str, Any], records: list[PromptRecord]) -> list[go.Figure]:
    figs = []
    tps = summary["tokens_per_s"]
    fig = go.Figure(go.Bar(x=list(tps), y=list(tps.values()), marker_color=[COLORS.get(m, "#555") for m in tps]))
    fig.update_layout(title="Throughput (tokens/s, all prompts)", yaxis_title="tokens/s")
    figs.append(fig)
    fig = go.Figure()
    for method in tps:
        fig.add_scatter(x=[r.index for r in records if method in r.runs],
                        y=[r.runs[method].tokens_per_s for r in records if method in r.runs],
                        mode="lines+markers", name=method, line={"color": COLORS.get(method)})
    fig.update_layout(title="Tokens/s per prompt", xaxis_title="prompt", yaxis_title="tokens/s")
    figs.append(fig)
    hist = summary.get("acceptance_histogram") or []
    fig = go.Figure(go.Bar(x=list(range(1, len(hist) + 1)), y=hist, marker_color=COLORS["dflash"]))
    fig.update_layout(title=f"Acceptance lengths (tau = {summary.get('tau')})", xaxis_title="tokens per cycle", yaxis_title="cycles")
    figs.append(fig)
    if summary.get("mean_draft_ms") is not None:
        fig = go.Figure(go.Bar(x=["drafter", "verifier"], y=[summary["mean_draft_ms"], summary["mean_verify_ms"]],
                               marker_color=["#e39b2d", "#3468c0"]))
        fig.update_layout(title="Mean time per cycle (ms)", yaxis_title="ms")
        figs.append(fig)
    for f in figs:
        f.update_layout(template="plotly_white", height=340, margin={"t": 50, "l": 50, "r": 20, "b": 40})
    return figs


def write_html(out: Path, settings: dict[str, Any], summary: dict[str, Any], records: list[PromptRecord]) -> Path:
    figs = _figures(summary, records)
    body = [fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figs)]
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(json.dumps(v))}</td></tr>" for k, v in summary.items())
    conf = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(json.dumps(v))}</td></tr>" for k, v in settings.items())
    lossless = summary.get("lossless")
    banner = ("" if lossless is None else
              ('<p style="color:#2e9d5b"><b>Lossless: every greedy DFlash output equalled the autoregressive output.</b></p>'
               if lossless else
               f'<p style="color:#c0392b"><b>MISMATCH: DFlash differed from AR on prompts {summary["mismatched_prompts"]}.</b></p>'))
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>DFlash benchmark</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}td{border:1px solid #ddd;padding:3px 8px}"
        "table{border-collapse:collapse}</style></head><body><h1>DFlash benchmark</h1>" + banner +
        f"<h2>Summary</h2><table>{rows}</table><h2>Settings</h2><table>{conf}</table>" + "".join(body) + "</body></html>"
    )
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def markdown_summary(settings: dict[str, Any], summary: dict[str, Any]) -> str:
    """A Markdown block for docs/BENCHMARKS.md: the command, the settings, the measurements."""
    tps = summary["tokens_per_s"]
    lines = [
        f"`{settings['command']}`",
        "",
        f"{settings['limit']} prompts from `{settings['prompts']}` (offset {settings['offset']}), pair `{settings['pair']}`, "
        f"{settings['dtype']}{_weights(settings)}, {settings['runner']}, block {settings['block_size']}, temperature {settings['temperature']}, "
        f"{settings['max_new_tokens']} new tokens, {settings['threads']} threads, warm-up {settings['warmup']}.",
        "",
        "| method | tokens/s |",
        "|---|---|",
    ]
    lines += [f"| {m} | {v:.2f} |" for m, v in tps.items()]
    lines += [
        "",
        "| tau | speedup vs AR | vs HF generate | vs prompt lookup | AR vs HF generate | lossless | draft ms/cycle | verify ms/cycle |",
        "|---|---|---|---|---|---|---|---|",
        f"| {summary.get('tau')} | {summary.get('speedup_vs_ar')} | {summary.get('speedup_vs_hf_generate')} | "
        f"{summary.get('speedup_vs_prompt_lookup')} | {summary.get('ar_vs_hf_generate')} | {summary.get('lossless')} | "
        f"{summary.get('mean_draft_ms')} | {summary.get('mean_verify_ms')} |",
    ]
    extra = {k: v for k, v in summary.items() if k.startswith(("tau_", "speedup_dflash")) and k != "tau_hf_dflash"}
    if extra:
        lines += ["", "| " + " | ".join(extra) + " |", "|" + "---|" * len(extra), "| " + " | ".join(str(v) for v in extra.values()) + " |"]
    lines += _peer_lines(summary)
    lines += ["", f"Acceptance-length histogram (1..B): {summary.get('acceptance_histogram')}"]
    return "\n".join(lines) + "\n"


def _peer_lines(summary: dict[str, Any]) -> list[str]:
    """transformers' DFlash and llama.cpp beside ours, when the run measured them."""
    lines: list[str] = []
    if summary.get("tau_hf_dflash") is not None:
        lines += ["", "| transformers DFlash tau | ours tau | DFlash / transformers DFlash | fastest variant / transformers DFlash | "
                      "transformers DFlash parts from AR (prompt: first token) |",
                  "|---|---|---|---|---|",
                  f"| {summary['tau_hf_dflash']} | {summary.get('tau')} | {summary.get('speedup_vs_hf_dflash')} | "
                  f"{summary.get('fastest_variant_vs_hf_dflash')} | {_parted(summary, 'hf_dflash')} |"]
    vs_llama = summary.get("speedup_vs_llama_cpp")
    if vs_llama:
        decode = summary.get("decode_tokens_per_s", {})
        lines += ["", f"Decode tokens/s (prefill excluded) against llama.cpp on the same GGUF "
                      f"({decode.get('llama_cpp')} tok/s); llama.cpp's greedy text parts from our AR on "
                      f"{_parted(summary, 'llama_cpp')}; fastest variant / llama.cpp: "
                      f"{summary.get('fastest_variant_vs_llama_cpp')}.", ""]
        medians = summary.get("median_prompt_ratio_vs_llama_cpp")  # runs before it was measured lack it
        lines += ["| method | decode tokens/s | / llama.cpp |" + (" median over prompts of / llama.cpp |" if medians else ""),
                  "|---|---|---|" + ("---|" if medians else "")]
        lines += [f"| {m} | {decode.get(m)} | {v} |" + (f" {medians.get(m)} |" if medians else "") for m, v in vs_llama.items()]
    shared = summary.get("tau_on_shared_text")
    if shared:
        lines += ["", f"On the {len(shared['prompts'])} prompts where transformers' DFlash text equals ours "
                      f"(prompts {shared['prompts']}): tau ours {shared['ours']}, transformers {shared['hf_dflash']}."]
    lines += _parting_lines(summary.get("partings") or {})
    return lines


def _parting_lines(partings: dict[str, dict[Any, dict[str, Any]]]) -> list[str]:
    """Where greedy texts part, and each numerics' margin there (see bench/partings.py)."""
    if not partings:
        return []
    rows = [(name, index, row) for name, by_prompt in partings.items() for index, row in by_prompt.items()]
    counts = ", ".join(f"{name.replace('_vs_', ' vs ')}: {len(by_prompt)}" for name, by_prompt in partings.items())
    lines = ["", f"Prompts where greedy texts part ({counts}). Margin: the logit of the second method's token minus "
                 "the first's at the first differing position, after the shared prefix, in our runner and in "
                 "transformers' forward (opposite signs and small sizes: a near-tie).", ""]
    if not rows:
        return lines
    lines += ["| compared | prompt | at token | tokens (second / first) | margin ours | margin transformers |",
              "|---|---|---|---|---|---|"]
    for name, index, row in rows:
        margins = row.get("margins")
        if margins is None:
            lines.append(f"| {name.replace('_vs_', ' vs ')} | {index} | {row['at']} | one text ends first | – | – |")
        else:
            lines.append(f"| {name.replace('_vs_', ' vs ')} | {index} | {row['at']} | {row['reference_token']} / "
                         f"{row['peer_token']} | {margins['ours']} | {margins['transformers']} |")
    return lines


def _parted(summary: dict[str, Any], peer: str) -> str:
    parted, compared = summary.get(f"{peer}_differs_from_ar"), summary.get(f"{peer}_compared_prompts")
    if parted is None:
        return "–"
    where = ", ".join(f"{i}: {at}" for i, at in parted.items())
    return f"{len(parted)} of {compared} prompts" + (f" ({where})" if where else "")


def _section_title(settings: dict[str, Any], main_pair: str | None = None) -> str:
    """A run's title; it names the pair where that is not ``main_pair`` (the page's first run's)."""
    parts = [f"{settings['prompts']} ({settings['limit']} prompts)", f"block {settings['block_size']}"]
    parts.append("greedy" if not settings["temperature"] else f"temperature {settings['temperature']}, rules {'/'.join(settings['rules'])}")
    parts.append(f"{settings['max_new_tokens']} new tokens")
    if main_pair is not None and settings.get("pair", main_pair) != main_pair:
        parts.append(f"pair {settings['pair']}")
    return ", ".join(parts)


def benchmarks_markdown(runs: list[dict[str, Any]], drafter_info: dict[str, Any] | None = None,
                        made_by: str = "make benchmarks") -> str:
    """docs/BENCHMARKS.md from several results.json files (each: settings + summary), in order.

    Nothing here is typed by hand: every figure is read from a bench run (or, for the training
    section, from the drafter's training_info.json written by the recipe's evaluate stage).
    """
    lines = [
        "# Benchmarks",
        "",
        "Produced by `python -m dflash_core bench-report` from the `results.json` of the bench runs",
        f"listed below (`{made_by}` runs them all, then writes this page). Every run interleaves",
        "the methods per prompt after a warm-up, so machine drift hits all of them alike; tokens/s",
        "counts generated tokens over wall time including the prompt's prefill.",
        "",
    ]
    if drafter_info:
        lines += ["## The bundled drafter (training recipe's evaluate stage)", ""]
        lines += [f"- {key}: **{value}**" for key, value in drafter_info.get("measured", {}).items()]
        for key in ("steps", "wall_time", "hardware", "command"):
            if drafter_info.get(key):
                lines.append(f"- {key.replace('_', ' ')}: `{drafter_info[key]}`" if key == "command" else f"- {key.replace('_', ' ')}: {drafter_info[key]}")
        lines.append("")
    main_pair = runs[0]["settings"].get("pair") if runs else None
    if runs:
        def cell(value: Any) -> str:
            return "–" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))

        lines += ["## Overview", "",
                  "DFlash verifies the whole block; *adaptive* verifies only the drafts worth their measured cost; "
                  "*pq* samples drafts from the drafter and accepts with min(1, p/q) (the default rule at "
                  "temperature > 0 is *match*: keep drafts while they equal the target's own samples); *tree* "
                  "verifies a tree of the drafter's likeliest continuations of the same size as the block "
                  "(*tree adaptive*: of the size worth its measured cost); *lookup* adds prompt lookup's guess "
                  "(what followed the last tokens where they occurred before) to the drafts verified in the "
                  "same pass. *Fastest variant*: the fastest of the DFlash variants the run measured, against "
                  "each peer.", "",
                  "| run | tau | AR tok/s | DFlash tok/s | DFlash / AR | adaptive / AR | tree tau | tree / AR | "
                  "tree adaptive / AR | lookup adaptive / AR | tree lookup adaptive / AR | pq tau | pq / AR | "
                  "DFlash / HF generate | DFlash / prompt lookup | AR / HF generate | fastest variant | "
                  "its / AR | its / HF generate | its / prompt lookup | lossless | transformers DFlash tau | "
                  "DFlash / transformers DFlash | its / llama.cpp (decode) |",
                  "|" + "---|" * 24]
        for run in runs:
            s, m = run["settings"], run["summary"]
            tps = m["tokens_per_s"]
            m = {**fastest_variant(tps), **m}  # runs written before the summary carried it
            lines.append("| " + " | ".join([
                _section_title(s, main_pair), cell(m.get("tau")), cell(tps.get("ar")), cell(tps.get("dflash")),
                cell(m.get("speedup_vs_ar")), cell(m.get("speedup_dflash_adaptive_vs_ar")), cell(m.get("tau_tree")),
                cell(m.get("speedup_dflash_tree_vs_ar")), cell(m.get("speedup_dflash_tree_adaptive_vs_ar")),
                cell(m.get("speedup_dflash_lookup_adaptive_vs_ar")), cell(m.get("speedup_dflash_tree_lookup_adaptive_vs_ar")),
                cell(m.get("tau_pq")), cell(m.get("speedup_dflash_pq_vs_ar")), cell(m.get("speedup_vs_hf_generate")),
                cell(m.get("speedup_vs_prompt_lookup")), cell(m.get("ar_vs_hf_generate")), cell(m.get("fastest_variant")),
                cell(m.get("fastest_variant_vs_ar")), cell(m.get("fastest_variant_vs_hf_generate")),
                cell(m.get("fastest_variant_vs_prompt_lookup")), cell(m.get("lossless")),
                cell(m.get("tau_hf_dflash")), cell(m.get("speedup_vs_hf_dflash")), cell(m.get("fastest_variant_vs_llama_cpp")),
            ]) + " |")
        lines.append("")
    for run in runs:
        s = run["settings"]
        lines += [f"## {_section_title(s, main_pair)}", "",
                  f"Machine: {s.get('machine', '?')}.", "",
                  markdown_summary(s, run["summary"])]
    return "\n".join(lines).rstrip() + "\n"
