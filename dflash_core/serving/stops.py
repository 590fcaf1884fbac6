"""Stop strings for streamed text: cut the answer before the first stop string, and never send a
client text that a stop string arriving in a later cycle would have removed."""

from __future__ import annotations

from typing import Sequence


class StopCutter:
    """Feeds on the whole decoded answer after every cycle and tells what may be sent so far.

    A cycle commits several tokens at once, so a stop string can appear anywhere in the new text,
    or begin at its end and finish in the next cycle: the tail that could still become a stop
    string is held back until the next cycle settles it.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.sent = ""  # text already handed out (always a prefix of the final answer)
        self.stopped = False  # a stop string was found: the answer is final

    def feed(self, text: str, final: bool = False) -> str:
        """The new text that may be sent, given the whole answer ``text`` decoded so far;
        ``final`` when generation ended (nothing more will come: flush what was held back)."""
        if self.stopped:
            return ""
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, final, self.stopped = text[:cut], True, True
        end = len(text) if final else len(text) - self._held(text)
        if not text.startswith(self.sent) or end <= len(self.sent):
            # Decoding more tokens can rewrite the last characters (a multi-byte character still
            # incomplete, a tokenizer's space clean-up): wait until the text extends what was sent.
            return ""
        delta = text[len(self.sent) : end]
        self.sent += delta
        return delta

    def _held(self, text: str) -> int:
        """How many trailing characters to hold back: an unfinished character (U+FFFD from a
        partial UTF-8 sequence) or the longest tail that is the beginning of a stop string."""
        held = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        if text.endswith("\ufffd"):
            held = max(held, 1)
        return held
