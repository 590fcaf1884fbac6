"""scripts/answer_guesses.py: the replay's arithmetic (tokens per cycle of guesses alone)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "answer_guesses.py"
_spec = importlib.util.spec_from_file_location("answer_guesses", SCRIPT)
answer_guesses = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(answer_guesses)


def test_a_cycle_keeps_the_longest_agreeing_guess_plus_the_targets_token():
    answer = [5, 6, 7, 8, 9, 10]

    def knows(text, length):  # guesses the answer exactly from where the text stands
        return answer[len(text) - 1 :][:length]

    def wrong(text, length):
        return [0] * length

    rows = [([1], answer)]
    assert answer_guesses.tokens_per_cycle(rows, [wrong], 4) == 1.0  # the target alone: a token a cycle
    # Guesses of 4: a cycle keeps 4 + 1, then the one token left.
    assert answer_guesses.tokens_per_cycle(rows, [knows], 4) == 3.0
    assert answer_guesses.tokens_per_cycle(rows, [wrong, knows], 4) == 3.0  # the better guess counts
    assert answer_guesses.agreeing([5, 6, 0], [5, 6, 7]) == 2 and answer_guesses.agreeing([5, 6], [5]) == 1
