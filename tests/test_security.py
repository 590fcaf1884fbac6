"""Remote code is never executed; limits for public deployments come from the environment."""

from __future__ import annotations

import json

import pytest

from dflash_core.errors import PromptError, SettingsError
from dflash_core.registry import ModelSource
from dflash_core.testing import tiny_drafter, tiny_target

EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("remote code ran")
raise SystemExit("remote code ran")
"""


def tiny_tokenizer(vocab: int):
    """A word-level tokenizer with ``vocab`` entries: enough for a folder to load as a target."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    words["<unk>"] = 0
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="w2")


def test_a_target_with_remote_code_loads_without_running_it(tmp_path):
    from dflash_core.loading import load_target
    from dflash_core.target import FastTarget

    model = tiny_target("llama")
    folder = tmp_path / "target"
    model.save_pretrained(folder)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(folder)
    marker = tmp_path / "ran.txt"
    (folder / "evil.py").write_text(EVIL.format(marker=str(marker)))
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil.EvilModel", "AutoConfig": "evil.EvilConfig",
                          "AutoTokenizer": ["evil.EvilTokenizer", None]}
    (folder / "config.json").write_text(json.dumps(config))
    # The folder loads as the plain Llama it declares, never through evil.py.
    target = load_target(ModelSource("path", str(folder)))
    assert type(target.model).__name__ == "LlamaForCausalLM" and isinstance(target.runner, FastTarget)
    assert not marker.exists()


def test_a_drafter_with_an_auto_map_loads_through_our_module(tmp_path):
    from dflash_core.drafter import DFlashDrafter

    folder = tmp_path / "drafter"
    tiny_drafter(tiny_target("llama")).save_pretrained(folder)
    marker = tmp_path / "ran.txt"
    (folder / "dflash.py").write_text(EVIL.format(marker=str(marker)))
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    (folder / "config.json").write_text(json.dumps(config))
    drafter = DFlashDrafter.from_pretrained(folder)
    assert type(drafter) is DFlashDrafter
    assert not marker.exists()


def test_limits_come_from_the_environment(monkeypatch):
    from dflash_core.prompting import check_fits_context, check_prompt_text, max_new_tokens_limit
    from dflash_core.speculative import GenerationConfig

    monkeypatch.setenv("DFLASH_MAX_NEW_TOKENS", "16")
    monkeypatch.setenv("DFLASH_MAX_PROMPT_CHARS", "10")
    monkeypatch.setenv("DFLASH_MAX_PROMPT_TOKENS", "5")
    assert max_new_tokens_limit() == 16
    with pytest.raises(SettingsError, match="from 1 to 16"):
        GenerationConfig(max_new_tokens=17).validated(16, max_new_tokens_limit())
    with pytest.raises(PromptError, match="limit is 10"):
        check_prompt_text("x" * 11)
    with pytest.raises(PromptError, match="at most 5"):
        check_fits_context(6, 1, 8192)
    monkeypatch.setenv("DFLASH_MAX_NEW_TOKENS", "many")
    with pytest.raises(SettingsError, match="must be an integer"):
        max_new_tokens_limit()
