"""Thinking mode: the pair's ``enable_thinking`` (models.toml), a request's own choice through
``Engine.prepare`` / ``stream`` and the CLI's ``--thinking/--no-thinking``, all reaching the chat
template. The tokenizer is ``dflash_core.testing.tiny_chat_tokenizer`` (no downloads): 96 ids, one per character plus the chat
specials, with a Qwen3-style template that writes an empty think block when thinking is off."""

from __future__ import annotations

import json

import pytest

from dflash_core import cli
from dflash_core.engine import Engine
from dflash_core.errors import RegistryError, SettingsError
from dflash_core.prompting import encode_prompt, has_thinking_switch
from dflash_core.registry import load_registry
from dflash_core.testing import (PLAIN_TEMPLATE, QWEN3_STYLE_TEMPLATE, contains_run, empty_think_block,
                                 thinking_registry, tiny_chat_tokenizer, tiny_target)


def test_the_template_gets_enable_thinking_only_when_asked():
    tok = tiny_chat_tokenizer()
    assert has_thinking_switch(tok)
    block = empty_think_block(tok)
    default = encode_prompt(tok, "hi there")
    on = encode_prompt(tok, "hi there", enable_thinking=True)
    off = encode_prompt(tok, "hi there", enable_thinking=False)
    assert default == on and not contains_run(on, block)  # the template's default: thinking
    assert contains_run(off, block) and off[: len(on)] == on
    assert tok.decode(off).endswith("assistant\n<think>\n\n</think>\n\n")


def test_a_template_without_the_switch_refuses_an_explicit_choice():
    tok = tiny_chat_tokenizer(PLAIN_TEMPLATE)
    assert not has_thinking_switch(tok)
    assert encode_prompt(tok, "hi") == encode_prompt(tok, "hi", enable_thinking=None)
    with pytest.raises(SettingsError, match="no thinking switch"):
        encode_prompt(tok, "hi", enable_thinking=False)
    with pytest.raises(SettingsError, match="chat-templated prompts"):
        encode_prompt(tiny_chat_tokenizer(), "hi", raw=True, enable_thinking=True)


def test_enable_thinking_in_the_registry(tmp_path):
    file = tmp_path / "models.toml"
    file.write_text('[pairs.p]\ntarget = { hub = "a/b" }\ndrafter = { path = "d" }\nenable_thinking = false\n'
                    'gpu_memory_gb = 12.5\n')
    pair = load_registry(file).get("p")
    assert pair.enable_thinking is False and pair.gpu_memory_gb == 12.5
    file.write_text('[pairs.p]\ntarget = { hub = "a/b" }\ndrafter = { path = "d" }\n')
    assert load_registry(file).get("p").enable_thinking is None
    file.write_text('[pairs.p]\ntarget = { hub = "a/b" }\ndrafter = { path = "d" }\nenable_thinking = "no"\n')
    with pytest.raises(RegistryError, match="enable_thinking = 'no'; expected true or false"):
        load_registry(file)


def test_engine_prepare_applies_the_pairs_choice_and_a_requests_override(tmp_path):
    from dflash_core.speculative import GenerationConfig

    engine = Engine.from_registry("tiny", str(thinking_registry(tmp_path, "enable_thinking = false")))
    block = empty_think_block(engine.tokenizer)
    config = GenerationConfig(max_new_tokens=8)
    assert engine.thinking_switch and engine.pair.enable_thinking is False
    pair_default, _ = engine.prepare("hi", config)
    on, _ = engine.prepare("hi", config, enable_thinking=True)
    off, _ = engine.prepare("hi", config, "ar", enable_thinking=False)
    raw, _ = engine.prepare("hi", config, raw=True)  # no template: the pair's choice does not apply
    assert contains_run(pair_default, block) and pair_default == off
    assert not contains_run(on, block)
    assert raw == engine.tokenizer("hi")["input_ids"]
    result = engine.generate("hi", config, enable_thinking=True)
    assert 1 <= len(result.token_ids) <= 8
    assert engine.describe()["enable_thinking"] is False and engine.describe()["thinking_switch"] is True


def test_a_pair_that_sets_thinking_on_a_template_without_the_switch_says_so(tmp_path):
    from dflash_core.speculative import GenerationConfig

    engine = Engine.from_registry("tiny", str(thinking_registry(tmp_path, "enable_thinking = true", PLAIN_TEMPLATE)))
    with pytest.raises(SettingsError, match="remove enable_thinking from the pair"):
        engine.prepare("hi", GenerationConfig(max_new_tokens=4))


def test_cli_thinking_flags(tmp_path, capsys):
    registry = str(thinking_registry(tmp_path, "enable_thinking = false"))

    def run(*flags: str) -> dict:
        assert cli.main(["--registry", registry, "generate", "--pair", "tiny", "--json", "--prompt", "hello",
                         "--max-new-tokens", "6", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    pair_default, on, off = run(), run("--thinking"), run("--no-thinking")
    assert pair_default["enable_thinking"] is False and off["enable_thinking"] is False
    assert on["enable_thinking"] is True
    # The empty think block (6 tokens: <think>, two newlines, </think>, two newlines) is in the
    # prompt exactly when thinking is off.
    assert off["prompt_tokens"] == pair_default["prompt_tokens"] == on["prompt_tokens"] + 6
    assert cli.main(["--registry", registry, "generate", "--pair", "tiny", "--prompt", "hi", "--raw", "--thinking"]) == 2
    assert "chat-templated prompts" in capsys.readouterr().err
