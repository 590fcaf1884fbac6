"""The target's own answers as a second source of lookup guesses: the index's guesses, their
chance buckets, loading from committed shards, and the loop (lossless whatever the answers hold,
more tokens per cycle where they hold what the target says)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_core.corpus import END, MAX_BACK, MAX_CANDIDATES, NGRAMS, AnswerCorpus, chance_keys, load_corpus
from dflash_core.errors import DFlashError
from dflash_core.lookup import LookupStats
from dflash_core.speculative import GenerationConfig, collect, stream
from dflash_core.target import FastTarget
from dflash_core.testing import PROMPTS, tiny_drafter, tiny_target
from dflash_core.training.shards import ShardContent, write_shard


def test_a_guess_follows_what_most_occurrences_say_next_and_stops_at_an_answers_end():
    corpus = AnswerCorpus([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 5], [9, 2, 3, 7]])
    assert len(corpus) == 19 and corpus.answers == 4
    # "8 2 3": no 3-gram; "2 3" occurs four times, three go on with 4, then two of those three with 5.
    assert corpus.continuation([8, 2, 3], 5) == ([4, 5], 2, [(3, 4), (2, 3)])
    assert corpus.continuation([8, 2, 3], 1) == ([4], 2, [(3, 4)])
    # The 3-gram "9 2 3" occurs once: copied to its answer's end.
    assert corpus.continuation([9, 2, 3], 5) == ([7], 3, [(1, 1)])
    assert corpus.continuation([42, 43], 5) == ([], 0, [])  # nowhere
    assert corpus.continuation([3], 5) == ([], 0, [])  # too short for any n-gram
    assert corpus.continuation([1, 2, 3], 0) == ([], 0, [])


def test_token_ids_past_the_packing_are_refused_clearly():
    with pytest.raises(DFlashError, match="below 65535"):
        AnswerCorpus([[1, 2, 70000]])


def test_occurrences_matching_further_back_outrank_the_majority():
    corpus = AnswerCorpus([[5, 6, 1, 2, 3, 4], [7, 7, 1, 2, 3, 9], [8, 8, 1, 2, 3, 9]])
    # "5 6 1 2 3" matches the first answer five tokens back: its continuation wins over the majority's 9.
    assert corpus.continuation([5, 6, 1, 2, 3], 1) == ([4], 5, [(1, 1)])
    # Nothing before "1 2 3" matches: the majority decides.
    assert corpus.continuation([0, 1, 2, 3], 1) == ([9], 3, [(2, 3)])


def test_many_occurrences_are_weighed_evenly_spread():
    answers = [[1, 2, 3, 4]] * (3 * MAX_CANDIDATES) + [[1, 2, 3, 5]] * (MAX_CANDIDATES // 2)
    tokens, match, support = AnswerCorpus(answers).continuation([1, 2, 3], 1)
    assert tokens == [4] and match == 3 and support[0][1] == MAX_CANDIDATES


def _guess_token_by_token(corpus: AnswerCorpus, text: list[int], length: int) -> tuple[list[int], int, list]:
    """``continuation``'s rule as its docstring states it, one token and one occurrence at a time."""
    tokens = corpus.tokens.tolist()
    for n in NGRAMS:
        if len(text) < n:
            continue
        found = [i + n for i in range(len(tokens) - n)
                 if tokens[i : i + n] == text[-n:] and tokens[i + n] != END and END not in tokens[i : i + n]]
        if not found:
            continue
        if len(found) > MAX_CANDIDATES:
            found = [found[int(i)] for i in np.linspace(0, len(found) - 1, MAX_CANDIDATES).astype(np.int64)]

        def back(at: int) -> int:
            k = 0
            while k < min(MAX_BACK, len(text) - n) and at - n - k - 1 >= 0 and tokens[at - n - k - 1] == text[-n - k - 1]:
                k += 1
            return k

        longest = max(back(at) for at in found)
        found = [at for at in found if back(at) == longest]
        guess, support = [], []
        while len(guess) < length:
            following = [tokens[at] for at in found]
            counts = {t: following.count(t) for t in following}
            token = min(counts, key=lambda t: (-counts[t], t))  # the most shared; a tie: the smallest id
            if token == END:
                break
            guess.append(token)
            support.append((counts[token], len(found)))
            found = [at + 1 for at in found if tokens[at] == token]
        return guess, n + longest, support
    return [], 0, []


@pytest.mark.parametrize("seed", range(6))
def test_guesses_equal_the_rule_taken_token_by_token(seed):
    # Few distinct tokens, answers that repeat and part: an n-gram's occurrences from one to past
    # FEW_OCCURRENCES and MAX_CANDIDATES, ties, runs into answers' ends and the corpus's end.
    rng = np.random.default_rng(seed)
    ids = 6 if seed % 2 else 14  # fewer distinct tokens: more occurrences of each n-gram
    stems = [rng.integers(1, ids, size=int(rng.integers(3, 12))).tolist() for _ in range(8)]
    answers = [stems[int(rng.integers(len(stems)))] + rng.integers(1, ids, size=int(rng.integers(0, 6))).tolist()
               for _ in range(300 + 200 * seed)]
    corpus = AnswerCorpus(answers)
    assert MAX_CANDIDATES < 4 * len(answers)
    for _ in range(25):
        text = rng.integers(1, ids, size=int(rng.integers(1, 20))).tolist()
        length = int(rng.integers(1, 16))
        assert corpus.continuation(text, length) == _guess_token_by_token(corpus, text, length)


def test_chance_keys_bucket_match_length_and_agreement():
    short_split, short_most, short_all, short_lone = chance_keys(2, [(1, 4), (3, 5), (5, 5), (1, 1)])
    assert len({short_split, short_most, short_all, short_lone}) == 4
    long_keys = chance_keys(12, [(1, 4), (5, 5)])
    assert set(long_keys).isdisjoint({short_split, short_most, short_all, short_lone})
    assert chance_keys(12, [(1, 4)]) == chance_keys(15, [(2, 9)])  # same buckets, same key


def test_lookup_stats_learn_per_bucket_from_recorded_keys():
    stats = LookupStats()
    for _ in range(30):
        stats.record([7, 7, 3], kept=1)  # the first token kept, the second not, the third never tried
    assert stats.chances([7, 7, 3]) == [stats.probability(7, 1), stats.probability(7, 2), stats.probability(3, 3)]
    assert stats.probability(7, 1) > 0.9 and stats.probability(7, 2) < 0.1 and stats.probability(3, 3) == 0.5


def _write(directory, answers: list[list[int]]) -> None:
    directory.mkdir()
    content = ShardContent(ids=[f"p{i}" for i in range(len(answers))], prompt_ids=[[1, 2]] * len(answers),
                           answer_ids=answers, finished=[True] * len(answers), skipped=[], meta={})
    write_shard(directory / "shard-00000.npz", content, vocab_size=100)


def test_load_corpus_reads_every_committed_answer(tmp_path):
    _write(tmp_path / "answers", [[10, 11, 12, 13], [20, 11, 12, 14], [30, 11, 12, 13]])
    corpus = load_corpus(str(tmp_path / "answers"))
    assert len(corpus) == 12 and corpus.answers == 3
    assert corpus.continuation([5, 11, 12], 3) == ([13], 2, [(2, 3)])
    with pytest.raises(DFlashError, match="lookup_answers.*no answer shards"):
        load_corpus(str(tmp_path / "nothing-here"))


def _cycles_tokens(out) -> float:
    return len(out.token_ids) / len(out.cycles)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_lookup_with_answers_equals_ar_and_keeps_more_where_the_answers_hold_the_text(family):
    model = tiny_target(family, seed=3)
    runner = FastTarget(model)
    drafter = tiny_drafter(model)  # random: its drafts are almost never kept
    gained = 0
    for prompt in PROMPTS:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=48, block_size=1).validated(16)))
        # Answers holding what the target says after this prompt, beside ones that hold noise.
        generator = torch.Generator().manual_seed(len(prompt))
        noise = [torch.randint(0, 96, (40,), generator=generator).tolist() for _ in range(20)]
        for answers in ([list(prompt) + ar.token_ids] + noise, noise):
            corpus = AnswerCorpus(answers)
            for tree in (False, True):
                for adaptive, costs in ((False, None), (True, [0.001 * 1.3 ** k for k in range(16)])):
                    cfg = GenerationConfig(max_new_tokens=48, block_size=16, tree=tree, lookup=True,
                                           adaptive=adaptive).validated(16)
                    plain = collect(stream(runner, drafter, prompt, cfg, verify_costs=costs))
                    out = collect(stream(runner, drafter, prompt, cfg, verify_costs=costs,
                                         answers=(corpus, LookupStats())))
                    assert out.token_ids == ar.token_ids, (family, tree, adaptive)
                    assert all(c.tree_nodes <= 15 and len(c.drafted) <= 15 for c in out.cycles)
                    if answers is not noise and not adaptive:
                        gained += _cycles_tokens(out) > _cycles_tokens(plain) + 1
    assert gained >= len(PROMPTS)  # the answers' guesses are kept where they hold the text


# Sampling with the answers' guesses: tests/test_sampling.py (match-answers), a chi-square test.
