"""The OpenAI server's request checks and stop strings, without a model (fast)."""

from __future__ import annotations

import pytest

from dflash_core.serving.protocol import ApiError, parse
from dflash_core.serving.stops import StopCutter


def stream_through(cutter: StopCutter, pieces: list[str]) -> str:
    """Feed the growing answer piece by piece (as cycles commit text); what a client receives."""
    text, sent = "", ""
    for i, piece in enumerate(pieces):
        text += piece
        sent += cutter.feed(text, final=i == len(pieces) - 1)
    return sent


@pytest.mark.parametrize("pieces", [["Hello wor", "ld. END", " more"], ["Hello world. E", "N", "D more"],
                                    ["Hello world. ", "EN", "D"], ["Hello world. END"]])
def test_text_is_cut_before_a_stop_string_however_the_cycles_split_it(pieces):
    cutter = StopCutter(["END"])
    assert stream_through(cutter, pieces) == "Hello world. "
    assert cutter.stopped


def test_a_possible_stop_prefix_is_held_back_then_released():
    cutter = StopCutter(["STOP"])
    assert cutter.feed("abc ST") == "abc "  # "ST" may become STOP
    assert cutter.feed("abc STAR") == "STAR"  # it did not
    assert cutter.feed("abc STAR S", final=True) == " S"  # the end flushes what was held
    assert not cutter.stopped


def test_the_earliest_of_several_stop_strings_wins_and_partial_characters_wait():
    cutter = StopCutter(["\n\n", "Q:"])
    assert cutter.feed("one Q: two\n\nthree", final=True) == "one "
    plain = StopCutter()
    assert plain.feed("caf\ufffd") == "caf"  # an unfinished UTF-8 character is not sent
    assert plain.feed("café", final=True) == "é"


def good(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    (good(messages="hi"), "messages"),
    (good(messages=[]), "messages"),
    (good(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (good(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
    (good(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), "messages[0].content"),
    (good(messages=[{"role": "system", "content": "be brief"}]), "messages"),
    (good(n=2), "n"),
    (good(presence_penalty=0.5), "presence_penalty"),
    (good(logprobs=True), "logprobs"),
    (good(stop=["a", "b", "c", "d", "e"]), "stop"),
    (good(stop=""), "stop"),
    (good(max_tokens="ten"), "max_tokens"),
    (good(temperature="hot"), "temperature"),
    (good(variant="dflash_fast"), "variant"),
    (good(thinking="yes"), "thinking"),
    (good(stream="yes"), "stream"),
])
def test_malformed_requests_name_the_faulty_field(body, param):
    with pytest.raises(ApiError) as info:
        parse(body, "chat")
    assert info.value.status == 400
    assert info.value.param == param
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


def test_variants_map_to_the_engine_flags():
    assert parse(good(variant="ar"), "chat").generation.variant == "ar"
    tree = parse(good(variant="tree_lookup"), "chat").generation
    config = tree.generation_config()
    assert (tree.variant, config.tree, config.lookup, config.adaptive) == ("dflash_tree_lookup", True, True, False)
    assert parse(good(variant="dflash_adaptive"), "chat").generation.generation_config().adaptive is True


def test_openai_defaults_and_content_parts():
    request = parse(good(messages=[{"role": "developer", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
                    "chat")
    assert request.generation.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert request.generation.temperature == 1.0  # OpenAI's default, not the CLI's greedy one
    assert request.generation.max_new_tokens is None and request.stops == [] and request.stream is False
    completion = parse({"model": "m", "prompt": ["def f():"], "stop": "\n", "max_completion_tokens": 5}, "completion")
    assert (completion.generation.prompt, completion.stops, completion.generation.max_new_tokens) == ("def f():", ["\n"], 5)
    assert completion.generation.raw and not request.generation.raw  # a completion's prompt is used as is
