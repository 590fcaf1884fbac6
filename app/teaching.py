"""Teaching mode: step through a recorded generation one speculative cycle at a time."""

from __future__ import annotations

import html
from dataclasses import dataclass

from .recording import RunRecord


@dataclass
class TeachingState:
    dflash: RunRecord
    ar: RunRecord
    block_size: int
    mask_text: str
    position: int = 0


def explanation_md() -> str:
    return (
        "### How DFlash works, one cycle at a time\n"
        "1. **Draft.** The block is the last committed token followed by `MASK` tokens. The drafter — a few "
        "transformer layers that read hidden states from several layers of the target — fills *every* masked "
        "slot in **one** forward pass (block diffusion), each with a confidence.\n"
        "2. **Verify.** The target runs **once** over the whole block and says, at every slot, which token it "
        "would have produced there. Greedy, on a CPU, its last step (the output head) runs only for the slots the "
        "check below reaches: after the first mismatch the target's choices are not needed, so they are not "
        "computed (shown as —).\n"
        "3. **Accept.** Drafts are kept while they match the target's choice; at the first mismatch the target's "
        "own token replaces the draft (the *bonus*). A cycle therefore commits between 1 and B tokens: the "
        "output is exactly what the target alone would write.\n"
        "4. **Roll back.** The target's cache forgets the rejected slots; the next block starts at the bonus "
        "token.\n\n"
        "Speedup: **S = τ · t_AR / (t_draft + t_verify)**, where τ is the mean number of tokens a cycle commits, "
        "t_AR the time of one plain decoding step, and t_draft, t_verify the two phases of a cycle. Verifying 16 "
        "tokens costs little more than decoding one, so τ is what buys the speed.\n\n"
        "**Trees** (the *Tree verification* box of the Live tab): the drafter scores every slot on its own, so "
        "besides its top token it has runners-up. Instead of one chain, the 15 verified slots can hold a *tree* "
        "of the likeliest continuations; the target checks all its branches in the same single pass (each "
        "branch sees only its own ancestors) and keeps the longest branch it agrees with. The output is still "
        "exactly the target's.\n\n"
        "**Prompt lookup** (the *Prompt lookup* box): answers often repeat what came before — a function's name, "
        "its arguments, a phrase of the question. Where the last few tokens occurred earlier, what followed them "
        "then is a free guess at what follows now. That guess joins the drafter's drafts as one more branch of "
        "the same tree, checked in the same pass: the drafter is good at the next few tokens, the copy at long "
        "repeated runs. Where the model came with its own earlier answers (SmolLM2 does: its answers to the "
        "training prompts), a second guess comes from them: what most often followed the same last tokens "
        "there, since a small model says the same things in the same words. Any guess can only change how many "
        "tokens a cycle keeps, never which."
    )


def _chip(text: str) -> str:
    shown = text.replace(" ", "\u2423").replace("\n", "\u21b5") or "\u2205"
    return html.escape(shown)


def step_html(state: TeachingState) -> str:
    cycles = state.dflash.cycles
    if not cycles:
        return "<p>The answer ended after its first token: there was no speculative cycle to show.</p>"
    c = cycles[state.position]
    k = len(c.drafted)
    head = "".join(f"<th>slot {i}</th>" for i in range(k + 1))
    anchor = html.escape("(last token)")
    block_row = f"<td>{anchor}</td>" + "".join(f'<td class="mask">{_chip(state.mask_text)}</td>' for _ in range(k))
    draft_cells = ["<td>—</td>"]
    for i, (tok, conf) in enumerate(zip(c.drafted, c.confidence)):
        width = int(60 * conf)
        draft_cells.append(f'<td>{_chip(tok)}<br><span class="dfs-bar" style="width:{width}px"></span> {conf:.2f}</td>')
    target_cells = []
    for i in range(k + 1):
        if i < len(c.target_choices):
            target_cells.append(f"<td>{_chip(c.target_choices[i])}</td>")
        else:  # past the first mismatch: a greedy verify leaves it out (acceptance.greedy_choices)
            target_cells.append('<td class="mask" title="not computed: not needed after the first mismatch">—</td>')
    decision = ["<td>—</td>"]
    for i in range(k):
        if i < c.num_accepted:
            decision.append('<td class="ok">✓ keep</td>')
        elif i == c.num_accepted:
            decision.append('<td class="bad">✗ reject</td>')
        else:
            decision.append("<td>not used</td>")
    committed = "".join(f"<b>{_chip(t)}</b> " for t in c.drafted[: c.num_accepted]) + f"<b>{_chip(c.bonus)}</b>"
    return (
        f'<div class="dfs-teach"><p><b>Cycle {c.index}</b> of {len(cycles)} — {c.num_accepted} draft(s) kept + the '
        f"target's own token = <b>{c.num_accepted + 1}</b> token(s) committed.</p>"
        f"<table><tr><th></th>{head}</tr>"
        f"<tr><th>1. block (input)</th>{block_row}</tr>"
        f"<tr><th>2. drafter proposes (confidence)</th>{''.join(draft_cells)}</tr>"
        f"<tr><th>3. target's choice for the next slot</th>{''.join(target_cells)}</tr>"
        f"<tr><th>4. decision</th>{''.join(decision)}</tr></table>"
        f"<p>Committed this cycle: {committed}</p>"
        f"<p>Draft {c.draft_s * 1000:.1f} ms · verify {c.verify_s * 1000:.1f} ms</p></div>"
    )


def formula_md(state: TeachingState) -> str:
    d, ar = state.dflash, state.ar
    tau = d.tau or 1.0
    t_ar = ar.decode_s / max(1, ar.num_tokens - 1)
    t_draft, t_verify = d.mean_draft_s, d.mean_verify_s
    if t_ar <= 0 or t_draft + t_verify <= 0:
        return "Not enough cycles to fill in the formula."
    predicted = tau * t_ar / (t_draft + t_verify)
    measured = (d.tokens_per_s or 0) / (ar.tokens_per_s or float("inf"))
    return (
        f"**With this run's measurements:** τ = {tau:.2f}, t_AR = {t_ar * 1000:.1f} ms, "
        f"t_draft = {t_draft * 1000:.1f} ms, t_verify = {t_verify * 1000:.1f} ms  \n"
        f"S = {tau:.2f} × {t_ar * 1000:.1f} / ({t_draft * 1000:.1f} + {t_verify * 1000:.1f}) = **{predicted:.2f}×** "
        f"(measured end to end: {measured:.2f}×; t_AR from a {ar.num_tokens}-token autoregressive run)"
    )
