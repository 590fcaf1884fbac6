"""The CLI on the real default pair (SmolLM2-135M, bf16): greedy DFlash == greedy AR."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dflash_core import cli
from dflash_core.evaluation import humaneval_prompts
from dflash_core.training.prompt_sources import read_prompts, split

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def unseen_prompts(count: int) -> list[str]:
    """Real prompts from the held-out split of the prompt set and from HumanEval: neither was
    written for these tests, nor trained on."""
    _, held = split(read_prompts(ROOT / "assets" / "data" / "train_prompts.jsonl.gz"))
    single = [p.messages[-1]["content"] for p in held if len(p.messages) == 1]
    rng = random.Random(2026)
    return rng.sample(single, count - 1) + [rng.choice(humaneval_prompts())]


def run_json(capsys, *args: str) -> dict:
    assert cli.main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("prompt", unseen_prompts(4))
def test_default_pair_greedy_dflash_equals_ar(capsys, engines_loaded_once, prompt):
    dflash = run_json(capsys, "generate", "--json", "--prompt", prompt, "--max-new-tokens", "96")
    ar = run_json(capsys, "generate", "--json", "--prompt", prompt, "--max-new-tokens", "96", "--mode", "ar")
    assert dflash["token_ids"] == ar["token_ids"]
    assert dflash["text"] == ar["text"]
    assert ar["cycles"] == []
    cycles = dflash["cycles"]
    assert sum(len(c["committed"]) for c in cycles) + 1 == dflash["num_tokens"] <= 96
    for c in cycles:
        assert 0 <= c["num_accepted"] <= len(c["drafted"])
        assert c["committed"][: c["num_accepted"]] == c["drafted"][: c["num_accepted"]][: len(c["committed"])]
    assert dflash["finish_reason"] in ("stop", "length")
    adaptive = run_json(capsys, "generate", "--json", "--prompt", prompt, "--max-new-tokens", "96", "--adaptive")
    assert adaptive["token_ids"] == ar["token_ids"]
    # Tree verification on the real bf16 pair: the same tokens, and the trees really branched.
    tree = run_json(capsys, "generate", "--json", "--prompt", prompt, "--max-new-tokens", "96", "--tree")
    assert tree["token_ids"] == ar["token_ids"]
    assert any(c["tree_nodes"] > len(c["drafted"]) for c in tree["cycles"])
    tree_adaptive = run_json(capsys, "generate", "--json", "--prompt", prompt, "--max-new-tokens", "96", "--tree", "--adaptive")
    assert tree_adaptive["token_ids"] == ar["token_ids"]
    # Lookup's guesses in the same pass, from the text and from the pair's committed answers
    # (models.toml's lookup_answers): the same tokens, and guesses of both kinds were verified.
    lookup = run_json(capsys, "generate", "--json", "--prompt", prompt, "--max-new-tokens", "96", "--lookup")
    assert lookup["token_ids"] == ar["token_ids"]
    assert any(c["lookup_nodes"] for c in lookup["cycles"])
    assert any(c["answer_nodes"] for c in lookup["cycles"])
    # The shown drafts a lookup guessed: never more than its guesses had verified nor than were shown.
    assert all(c["lookup_drafted"] <= min(max(c["lookup_nodes"], c["answer_nodes"]), len(c["drafted"]))
               for c in lookup["cycles"])
    assert any(c["lookup_drafted"] for c in lookup["cycles"])
    combined = run_json(capsys, "generate", "--json", "--prompt", prompt, "--max-new-tokens", "96", "--tree", "--lookup",
                        "--adaptive")
    assert combined["token_ids"] == ar["token_ids"]
    assert len(engines_loaded_once) == 1


def test_generate_json_has_the_documented_fields(capsys):
    out = run_json(capsys, "generate", "--json", "--prompt", "Say hello.", "--max-new-tokens", "8")
    for key in ("token_ids", "text", "finish_reason", "num_tokens", "decode_s", "cycles", "tau", "prompt_tokens"):
        assert key in out
    assert out["num_tokens"] == len(out["token_ids"]) <= 8


def test_raw_prompts_skip_the_chat_template(capsys):
    templated = run_json(capsys, "generate", "--json", "--prompt", "def add(a, b):", "--max-new-tokens", "4")
    raw = run_json(capsys, "generate", "--json", "--prompt", "def add(a, b):", "--max-new-tokens", "4", "--raw")
    assert raw["prompt_tokens"] < templated["prompt_tokens"]


def test_pairs_lists_the_registry_with_availability(capsys):
    out = run_json(capsys, "pairs", "--json")
    names = {p["name"]: p for p in out["pairs"]}
    default = names["smollm2-135m-w4a8"]
    assert default["default"] and default["runnable"] and default["otherwise"] == "smollm2-135m"
    assert default["weights"] == "w4a8"
    from dflash_core import int8_rows
    if int8_rows.refusal() is None:
        assert default["loads_instead"] is None
    else:  # a CPU without w4a8's kernels: the bf16 pair runs, and `pairs` says so
        assert default["loads_instead"] == {"pair": "smollm2-135m", "why": int8_rows.refusal()}
    assert not names["smollm2-135m"]["default"] and names["smollm2-135m"]["runnable"]
    assert names["smollm2-135m"]["loads_instead"] is None
    assert not names["smollm2-135m-int4"]["default"] and names["smollm2-135m-int4"]["runnable"]
    assert not names["qwen3-8b"]["runnable"] and "CUDA" in names["qwen3-8b"]["reason"]


def test_pairs_says_which_pair_runs_where_the_defaults_kernels_cannot(capsys, monkeypatch):
    from dflash_core import int8_rows

    monkeypatch.setattr(int8_rows, "refusal", lambda: "this CPU has no AVX512-VNNI")
    names = {p["name"]: p for p in run_json(capsys, "pairs", "--json")["pairs"]}
    assert names["smollm2-135m-w4a8"]["loads_instead"] == {"pair": "smollm2-135m", "why": "this CPU has no AVX512-VNNI"}
    assert cli.main(["pairs"]) == 0
    out = capsys.readouterr().out
    assert "* smollm2-135m-w4a8" in out and "ok, as smollm2-135m (this CPU has no AVX512-VNNI)" in out


def test_streaming_text_output(capsys):
    assert cli.main(["generate", "--prompt", "Name a colour.", "--max-new-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert "tok/s" in err and "tau=" in err
