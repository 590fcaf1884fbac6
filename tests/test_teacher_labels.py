"""Exact drafter labels from a teacher-forced pass: counted by hand, and on an answer the engine decoded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_core.target import FastTarget
from dflash_core.testing import tiny_target
from dflash_core.training.teacher_labels import LabelTally, exact_label_counts, greedy_after_each_position


def counts_by_hand(ids: list[int], greedy: list[int], first: int, slots: int) -> list[int]:
    out = []
    for p in range(first, len(ids)):
        k = 1  # slot 1 is always exact
        while k < slots and p + k <= len(ids) - 1 and ids[p + k] == greedy[p + k - 1]:
            k += 1
        out.append(k)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_counts_match_a_slot_by_slot_walk(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    greedy = rng.integers(0, 4, n)
    # Mostly agreeing text, so that runs of every length occur.
    ids = np.concatenate([[7], np.where(rng.random(n - 1) < 0.8, greedy[:-1], rng.integers(0, 4, n - 1))])
    first = int(rng.integers(0, n))
    slots = int(rng.integers(1, 17))
    got = exact_label_counts(ids, greedy, first, slots)
    assert got.tolist() == counts_by_hand(ids.tolist(), greedy.tolist(), first, slots)


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="greedy has 2 entries for 3 tokens"):
        exact_label_counts([1, 2, 3], [1, 2], 0, 4)


def _decoded_answer(runner: FastTarget, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding through the cache, one token per step: the engine's AR path."""
    runner.reset(len(prompt) + steps)
    token = int(runner.forward(torch.tensor(prompt), None, last_only=True).logits[-1].argmax())
    answer = [token]
    for _ in range(steps - 1):
        token = int(runner.forward(torch.tensor([token]), None, last_only=True).logits[-1].argmax())
        answer.append(token)
    return answer


def test_a_decoded_answer_gives_every_slot_and_a_changed_token_cuts_the_runs_before_it() -> None:
    runner = FastTarget(tiny_target("llama"))
    prompt = [5, 17, 33, 8]
    ids = prompt + _decoded_answer(runner, prompt, 30)
    other = [9, 4, 4, 61, 2, 70, 11]  # stacked beside it: sequences must not see each other
    greedy, alone = greedy_after_each_position(runner, [ids, other])
    assert greedy_after_each_position(runner, [other])[0].tolist() == alone.tolist()
    slots = 15
    full = exact_label_counts(ids, greedy, len(prompt), slots)
    assert full.tolist() == [min(slots, len(ids) - p) for p in range(len(prompt), len(ids))]

    q = len(prompt) + 20  # replace one answer token with one the target would not choose
    changed = list(ids)
    changed[q] = (int(greedy[q - 1]) + 1) % 96
    changed_greedy = greedy_after_each_position(runner, [changed])[0]
    cut = exact_label_counts(changed, changed_greedy, len(prompt), slots)
    assert cut[: q - len(prompt)].tolist() == [min(slots, q - p) for p in range(len(prompt), q)]

    tally = LabelTally(slots)
    tally.add(ids, greedy, len(prompt), 1.0)
    tally.add(changed, changed_greedy, len(prompt), 1.0)
    summary = tally.summary()
    assert summary["exact_fraction_by_slot"][0] == 1.0
    assert summary["next_token_agreement"] < 1.0
    assert summary["exact_labels_per_anchor"] == round(float(full.sum() + cut.sum()) / (len(full) + len(cut)), 3)
