"""Where a peer's greedy text parts from another method's, and how close the two tokens were there.

Greedy outputs of two implementations part where their numerics pick different argmaxes; the
question a reader has is whether that was a near-tie (a rounding flip) or a real disagreement (a
bug). For each prompt where ``peer`` parts from ``reference`` at token ``at``, both texts share
the prompt and ``at`` tokens; one forward over that shared prefix gives, in each numerics, the
*margin*: the logit of the reference's token minus the logit of the peer's token at that
position. A flip of sign between our runner and transformers' model, with small magnitudes, is a
near-tie; a large margin on both sides would be a real disagreement.

``ours`` is our runner (the numerics of our AR: the runner is row-count invariant, so a pass over
the prefix scores each position as decoding did). ``transformers`` is the same weights through
transformers' own forward, scored in one pass over the prefix: its incremental decode and its
DFlash verify may round differently again, which is one more way its texts can part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from .runner import first_difference

if TYPE_CHECKING:
    from ..engine import Engine
    from .runner import PromptRecord

# (peer, reference) pairs whose partings the bench explains; the first of each is the one that
# may part, the second the one it is compared with.
COMPARED = (("hf_dflash", "ar"), ("llama_cpp", "ar"), ("hf_dflash", "hf_generate"), ("hf_generate", "ar"))


def last_logits(engine: Engine, ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """The next-token logits after ``ids`` in both numerics, as float32 (V,)."""
    runner = engine.target.runner
    tensor = torch.tensor(list(ids), device=runner.device)
    with torch.inference_mode():
        runner.reset(len(ids) + 1)
        ours = runner.forward(tensor, None, last_only=True).logits[-1].float()
        theirs = engine.target.model(input_ids=tensor[None]).logits[0, -1].float()
    return {"ours": ours, "transformers": theirs}


def partings(engine: Engine, records: list[PromptRecord],
             compared: Sequence[tuple[str, str]] = COMPARED) -> dict[str, dict[int, dict[str, Any]]]:
    """For each ``(peer, reference)`` both measured: prompt index -> where they part, the two
    tokens, and each numerics' margin (reference's logit minus peer's). A text that is a prefix of
    the other (one stopped early) has no token to compare and gives ``margins: None``."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for peer, reference in compared:
        rows: dict[int, dict[str, Any]] = {}
        for record in records:
            if peer not in record.runs or reference not in record.runs:
                continue
            theirs, ref = record.runs[peer].tokens, record.runs[reference].tokens
            at = first_difference(theirs, ref)
            if at is None:
                continue
            row: dict[str, Any] = {"at": at, "margins": None}
            if at < min(len(theirs), len(ref)):
                logits = last_logits(engine, record.prompt_ids + ref[:at])
                row.update(reference_token=ref[at], peer_token=theirs[at],
                           margins={name: round(float(v[ref[at]] - v[theirs[at]]), 4) for name, v in logits.items()})
            rows[record.index] = row
        if any(peer in r.runs and reference in r.runs for r in records):
            out[f"{peer}_vs_{reference}"] = rows
    return out
