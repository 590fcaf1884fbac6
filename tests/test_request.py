"""One resolver: every front end's request goes through ``Engine.resolve``, which refuses a bad
request with a ``DFlashError`` that says what to change, and gives autoregressive decoding one
representation (block size 1, variant "ar"). Tiny models (``dflash_core.testing``), no downloads."""

from __future__ import annotations

import json

import pytest

from dflash_core import cli
from dflash_core.bench.runner import METHODS, PEERS, Bench
from dflash_core.engine import Engine
from dflash_core.errors import DFlashError, PromptError, SettingsError
from dflash_core.request import VARIANTS, Request, dflash_variant, variant
from dflash_core.speculative import GenerationConfig, collect
from dflash_core.testing import thinking_registry


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    return str(thinking_registry(tmp_path_factory.mktemp("request")))


@pytest.fixture(scope="module")
def engine(registry):
    return Engine.from_registry("tiny", registry)


def test_the_variant_table_is_what_the_bench_and_the_api_name():
    assert list(VARIANTS)[:2] == ["ar", "dflash"] and len(VARIANTS) == 9
    assert METHODS == tuple(VARIANTS) + PEERS  # the bench's engine methods are the table's names
    assert variant("tree_lookup") is variant("dflash_tree_lookup") is dflash_variant(tree=True, lookup=True)
    assert dflash_variant(adaptive=True).name == "dflash_adaptive" and variant("ar").autoregressive


@pytest.mark.parametrize("make, error, message", [
    (lambda: variant("dflash_fast"), SettingsError, "allowed: ar, dflash, or dflash_ followed by tree"),
    (lambda: variant("lookup_tree"), SettingsError, "in that order"),
    (lambda: dflash_variant(tree="yes"), SettingsError, "tree = 'yes'; allowed: true or false"),
    (lambda: Request.of("hi", GenerationConfig(), mode="fast"), SettingsError, "mode = 'fast'; allowed: dflash, ar"),
])
def test_bad_variants_and_modes_say_what_is_allowed(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize("request_, error, message", [
    (Request("hi", variant="turbo"), SettingsError, "variant = 'turbo'; allowed"),
    (Request("hi", block_size=17), SettingsError, "block_size = 17; allowed: an integer from 1 .* to 16"),
    (Request("hi", max_new_tokens=0), SettingsError, "max_new_tokens = 0; allowed: an integer from 1"),
    (Request("hi", temperature=0.7, rule="pq", variant="dflash_tree"), SettingsError, "rule = 'pq'"),
    (Request("   "), PromptError, "the prompt is empty"),
    (Request(None), PromptError, "the prompt must be text"),
    (Request("hi", messages=[{"role": "user", "content": "hi"}]), SettingsError, "not both: drop one"),
    (Request(messages=[{"role": "user", "content": "hi"}], raw=True), SettingsError, "not both: drop one"),
    (Request("hi", raw=True, thinking=True), SettingsError, "leave thinking unset"),
    (Request("hi", max_new_tokens=500), PromptError, r"exceeds the target's context of 512 tokens: .* at most 491"),
])
def test_a_bad_request_is_refused_with_what_to_change(engine, request_, error, message):
    with pytest.raises(error, match=message):
        engine.resolve(request_)


def test_the_three_spellings_of_autoregressive_resolve_to_one(engine):
    spellings = [
        engine.resolve(Request("hi", variant="ar", max_new_tokens=6)),
        engine.resolve(Request("hi", block_size=1, max_new_tokens=6)),
        engine.resolve(Request("hi", variant="dflash_tree_lookup_adaptive", block_size=1, max_new_tokens=6)),
        engine.resolve(Request.of("hi", GenerationConfig(max_new_tokens=6, tree=True), mode="ar")),
    ]
    first = spellings[0]
    assert all(r == first for r in spellings)
    assert first.mode == "ar" and first.variant is VARIANTS["ar"]
    assert (first.config.block_size, first.config.tree, first.config.lookup, first.config.adaptive) == (1, False, False, False)
    # ... and the loop runs the target alone on it: no cycle drafts anything.
    assert not any(e.drafted for e in collect(engine.stream_ids(first.prompt_ids, first.config)).cycles)
    dflash = engine.resolve(Request("hi", max_new_tokens=6))
    assert dflash.mode == "dflash" and dflash.config.block_size == engine.max_block_size


def test_a_request_without_a_budget_gets_what_the_context_leaves(engine):
    resolved = engine.resolve(Request("hi", max_new_tokens=None))
    assert resolved.config.max_new_tokens == engine.context_length - len(resolved.prompt_ids)
    conversation = [{"role": "user", "content": "hi"}]
    assert engine.resolve(Request(messages=conversation, variant="tree")).prompt_ids == resolved.prompt_ids


def test_tree_and_lookup_variants_need_the_fast_runner(tmp_path):
    hf = Engine.from_registry("tiny", str(thinking_registry(tmp_path, 'engine = "hf"')))
    with pytest.raises(SettingsError, match="variant 'dflash_lookup' .* needs the fast target runner.* use variant 'dflash'"):
        hf.resolve(Request("hi", variant="lookup"))
    assert hf.resolve(Request("hi", variant="dflash_adaptive")).variant.adaptive


def test_the_bench_applies_the_context_check(engine, registry, tmp_path, capsys):
    with pytest.raises(PromptError, match="exceeds the target's context"):
        Bench(engine, Request(max_new_tokens=500), ("dflash", "ar")).run(["hi"], warmup=0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    code = cli.main(["--registry", registry, "bench", "--pair", "tiny", "--prompts", str(prompts), "--methods", "ar",
                     "--max-new-tokens", "500", "--warmup", "0", "--out", str(tmp_path / "out")])
    assert code == 2 and "exceeds the target's context" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_every_failure_is_a_dflash_error(engine):
    # What a front end catches: the CLI's exit 2, the API's 400, the studio's status line.
    for bad in (Request("hi", top_p=0), Request("hi", seed="x"), Request("hi", variant=None)):
        with pytest.raises(DFlashError):
            engine.resolve(bad)
