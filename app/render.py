"""HTML for the studio: coloured tokens, the cycle log, counters. Every user-visible string is
escaped; nothing here reads files or runs code."""

from __future__ import annotations

import html

from .recording import CycleRecord, RunRecord, TokenView

LEGEND = (
    '<div class="dfs-legend"><span class="tok tok-accepted">accepted draft</span>'
    '<span class="tok tok-target">target\'s own token</span>'
    '<span class="tok tok-rejected">rejected draft</span>'
    '<span class="tok tok-unused">draft never checked</span>'
    '<span class="tok tok-lookup">cycle log, dashed: guessed by lookup</span></div>'
)


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _visible(text: str) -> str:
    # Whitespace-only tokens stay visible in chips (the main text keeps the real characters).
    return text.replace(" ", "\u2423").replace("\n", "\u21b5").replace("\t", "\u21e5") or "\u2205"


def token_spans(tokens: list[TokenView], mode: str) -> str:
    """The coloured spans of some tokens (a whole run, or the ones new since the last update)."""
    parts = []
    for tok in tokens:
        if mode == "ar":
            title = f"cycle {tok.cycle} · the target's own token (autoregressive)"
        elif tok.kind == "accepted":
            title = f"cycle {tok.cycle} · drafted and accepted · drafter confidence {tok.confidence:.2f}"
        else:
            title = f"cycle {tok.cycle} · supplied by the target (bonus / correction)"
        cls = "tok-ar" if mode == "ar" else f"tok-{tok.kind}"
        if tok.special:
            cls += " tok-special"
        parts.append(f'<span class="tok {cls}" title="{_esc(title)}">{_esc(tok.text)}</span>')
    return "".join(parts)


def tokens_html(run: RunRecord | None, placeholder: str = "", run_id: int | None = None) -> str:
    """A run's whole text pane; with ``run_id``, an empty pane that live updates append to."""
    if run_id is not None:
        return f'<div class="dfs-text" data-run="{run_id}" data-placeholder="{_esc(placeholder)}"></div>'
    if run is None or not run.tokens:
        return f'<div class="dfs-text dfs-empty">{_esc(placeholder)}</div>'
    return f'<div class="dfs-text">{token_spans(run.tokens, run.mode)}</div>'


def cycle_html(cycle: CycleRecord) -> str:
    chips = []
    for k, (text, conf) in enumerate(zip(cycle.drafted, cycle.confidence)):
        if k < cycle.num_accepted:
            cls, note = "tok-accepted", "accepted"
        elif k == cycle.num_accepted:
            cls, note = "tok-rejected", "rejected (first mismatch)"
        else:
            cls, note = "tok-unused", "discarded after the first mismatch"
        if k < cycle.lookup_drafted:
            cls, note = cls + " tok-lookup", note + " · guessed by lookup (this text or the model's earlier answers)"
        chips.append(f'<span class="tok {cls}" title="{_esc(f"slot {k + 1} · confidence {conf:.2f} · {note}")}">'
                      f"{_esc(_visible(text))}</span>")
    chips.append(f'<span class="dfs-arrow">→</span><span class="tok tok-target" title="the target\'s own token">'
                 f"{_esc(_visible(cycle.bonus))}</span>")
    header = (f'<span class="dfs-cyc">#{cycle.index}</span> <b>{cycle.num_accepted + 1}</b> token(s) '
              f'· draft {cycle.draft_s * 1000:.0f} ms · verify {cycle.verify_s * 1000:.0f} ms')
    if cycle.tree_nodes:
        others = cycle.tree_nodes - len(cycle.drafted)
        header += (f' · <span class="dfs-tree" title="the target checked a tree of drafts in one pass; shown: the path '
                   f'it followed, then the likeliest drafts below">tree of {cycle.tree_nodes} drafts '
                   f'({others} on other branches)</span>')
    if cycle.lookup_nodes:
        header += (f' · <span class="dfs-lookup" title="drafts copied from what followed the last tokens where they '
                   f'occurred before (prompt lookup), checked in the same pass">{cycle.lookup_nodes} from prompt lookup</span>')
    if cycle.answer_nodes:
        header += (f' · <span class="dfs-lookup" title="drafts copied from what most often followed the last tokens in '
                   f'the model\'s own answers to other questions, checked in the same pass">{cycle.answer_nodes} from '
                   f'earlier answers</span>')
    if cycle.lookup_only:
        header += (' · <span class="dfs-lookup" title="the guesses were likely enough to be verified alone: the drafter '
                   'did not run this cycle">drafter skipped</span>')
    return f'<div class="dfs-cycle"><div class="dfs-cycle-head">{header}</div><div>{"".join(chips)}</div></div>'


LOG_ROWS = 60  # cycles the log keeps on the page (newest first)


def cycle_rows(cycles: list[CycleRecord]) -> str:
    """Log rows for some cycles, newest first (what a live update puts on top of the log)."""
    return "".join(cycle_html(c) for c in reversed(cycles[-LOG_ROWS:]))


def cycle_log_html(run: RunRecord | None, last: int = LOG_ROWS, run_id: int | None = None) -> str:
    """The whole cycle log; with ``run_id``, an empty log that live updates prepend to."""
    if run_id is not None:
        return (f'<div class="dfs-log" data-run="{run_id}" data-keep="{last}" '
                'data-placeholder="Each speculative cycle will appear here."></div>')
    if run is None or not run.cycles:
        return '<div class="dfs-log dfs-empty">Each speculative cycle will appear here.</div>'
    rows = [cycle_html(c) for c in run.cycles[-last:]][::-1]
    hidden = len(run.cycles) - min(len(run.cycles), last)
    more = f'<div class="dfs-more">… {hidden} earlier cycle(s)</div>' if hidden else ""
    return f'<div class="dfs-log">{"".join(rows)}{more}</div>'


def _fmt(value: float | None, pattern: str, missing: str = "–") -> str:
    return missing if value is None else pattern.format(value)


def counters_inner(run: RunRecord | None, label: str) -> str:
    """What a counters box holds (a live update replaces it; the box keeps its run tag)."""
    if run is None:
        return f"<b>{_esc(label)}</b> waiting"
    state = run.finish_reason or "running"
    cells = [
        ("time", f"{run.elapsed_s:.2f} s"),
        ("tokens", str(run.num_tokens)),
        ("tok/s", _fmt(run.tokens_per_s, "{:.1f}")),
    ]
    if run.mode == "dflash":
        cells[1:1] = [("cycles", str(len(run.cycles))), ("mean acceptance length τ", _fmt(run.tau, "{:.2f}"))]
    body = "".join(f'<span class="dfs-cell"><small>{_esc(k)}</small><b>{_esc(v)}</b></span>' for k, v in cells)
    return f"<b>{_esc(label)}</b> <i>{_esc(state)}</i>{body}"


def counters_html(run: RunRecord | None, label: str, run_id: int | None = None) -> str:
    """A run's counters; with ``run_id``, tagged with its run for the live updates to fill."""
    tag = f' data-run="{run_id}"' if run_id is not None else ""
    return f'<div class="dfs-counters"{tag}>{counters_inner(run, label)}</div>'


def speedup_html(dflash: RunRecord | None, ar: RunRecord | None, same_text: bool | None, variant: str = "") -> str:
    if dflash is None or ar is None or dflash.tokens_per_s is None or ar.tokens_per_s is None:
        return '<div class="dfs-speedup">Speedup appears when both runs have finished.</div>'
    check = ""
    if same_text is not None:
        check = ("identical output ✓" if same_text else
                 "outputs differ (sampling, or a numerical near-tie in this dtype)")
    ran = f" · variant: {_esc(variant)}" if variant else ""
    ratio, words = speedup_parts(dflash.tokens_per_s, ar.tokens_per_s)
    return f'<div class="dfs-speedup"><b>{ratio}</b> {_esc(words)} · {_esc(check)}{ran}</div>'


def speedup_parts(dflash_tokens_per_s: float, ar_tokens_per_s: float) -> tuple[str, str]:
    """DFlash's rate against the target alone's as the page and the chat say it, the ratio apart
    (the page sets it in bold): ("1.93×", "faster than the target alone (x vs y tok/s)"), or where
    DFlash was the slower, ("0.48×", "the speed of the target alone (x vs y tok/s): slower here"),
    never "0.48× faster"."""
    ratio = round(dflash_tokens_per_s / ar_tokens_per_s, 2)  # as shown: 1.00× is not "slower"
    rates = f"({dflash_tokens_per_s:.1f} vs {ar_tokens_per_s:.1f} tok/s)"
    if ratio >= 1:
        return f"{ratio:.2f}×", f"faster than the target alone {rates}"
    return f"{ratio:.2f}×", f"the speed of the target alone {rates}: slower here"


TIMING_NOTE = (
    "How the comparison is timed: DFlash runs first, then the autoregressive baseline, on the same "
    "engine and the same CPU cores, never at the same time. The engine runs in its own thread and "
    "this page is sent what is new about four times a second, so showing a run costs it little; each "
    "timer is the engine's own clock for its run. Both runs are warm (the pair is warmed up when it "
    "loads). Tokens/s excludes the prompt prefill (the first token), as in z-lab's benchmark. The race "
    "chart replays both runs on a common clock starting at zero."
)


# ------------------------------------------------------------------------------------- chat
CHAT_PLACEHOLDER = "The conversation appears here: type a message below."


def chat_turn_html(turn: dict) -> str:
    """One finished turn: the user's text as typed, or the assistant's coloured tokens."""
    role = turn["role"]
    if role == "assistant":
        body = f'<div class="dfs-text">{turn.get("html", "")}</div>'
    else:
        body = f'<div class="dfs-chat-said">{_esc(turn["content"])}</div>'
    note = f'<div class="dfs-chat-note">{_esc(turn["note"])}</div>' if turn.get("note") else ""
    return f'<div class="dfs-chat-turn dfs-chat-{_esc(role)}"><div class="dfs-chat-role">{_esc(role)}</div>{body}{note}</div>'


def chat_html(history: list[dict], run_id: int | None = None) -> str:
    """The conversation; with ``run_id``, it ends in an empty assistant pane (tagged with the run)
    that live updates append the answer's tokens to."""
    turns = [chat_turn_html(t) for t in history]
    if run_id is not None:
        turns.append('<div class="dfs-chat-turn dfs-chat-assistant"><div class="dfs-chat-role">assistant</div>'
                     f'<div class="dfs-text" data-run="{run_id}" data-placeholder="…"></div></div>')
    if not turns:
        return f'<div class="dfs-chat dfs-empty">{_esc(CHAT_PLACEHOLDER)}</div>'
    return f'<div class="dfs-chat">{"".join(turns)}</div>'
