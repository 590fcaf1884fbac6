"""The prompt set: appending keeps gen-data's answers valid, and the sources parse what they claim."""

from __future__ import annotations

import ast
import gzip
import random
from pathlib import Path

import pytest

from dflash_core.training.prompt_sources import (
    DOC_COMMENTED, Prompt, _doc_commented_functions, _jsdoc_functions, append_prompts, chitchat_conversations,
    chitchat_more, chitchat_replies, code_references, read_prompts, web_platform_questions, wordnet_questions,
    write_prompts,
)
from dflash_core.training.shards import DataDir, ids_digest, prompt_order

COMMITTED = Path(__file__).resolve().parents[1] / "assets/data/train_prompts.jsonl.gz"
# The first set (issue #21 appends after it): its ids, in order, as committed.
FIRST_SET_SIZE = 12959
FIRST_SET_DIGEST = "3bb8d47971ebdba05f0e8f41ab9dec8f534b3999"


def _prompt(i: int, text: str | None = None) -> Prompt:
    return Prompt(f"p{i}", "test", [{"role": "user", "content": text or f"Question {i}?"}])


def _shard_entry(first: int, next_: int) -> dict:
    return {"file": f"shard-{first}.npz", "first": first, "next": next_, "answers": next_ - first, "skipped": 0,
            "answer_tokens": 1, "prompt_tokens": 1, "wall_s": 0.1, "bytes": 1}


def test_appending_keeps_earlier_shards_valid_and_continues_after_them(tmp_path):
    path = tmp_path / "prompts.jsonl.gz"
    write_prompts([_prompt(i) for i in range(40)], path)
    old_bytes = gzip.decompress(path.read_bytes())
    old_order = [p.id for p in prompt_order(read_prompts(path))]
    data = DataDir(tmp_path / "data")
    data.add_shard(_shard_entry(0, 25), old_order)  # gen-data has answered the first 25

    new = [_prompt(i) for i in range(100, 130)]
    repeats = [_prompt(3), _prompt(200, text="question 7?")]  # an id, and a text, the file already has
    added = append_prompts(path, new + repeats)

    assert [p.id for p in added] == [p.id for p in new]
    assert gzip.decompress(path.read_bytes()).startswith(old_bytes)  # earlier lines byte for byte
    order = [p.id for p in prompt_order(read_prompts(path))]
    DataDir(tmp_path / "data").check_order(order)  # the shards already made stay valid
    assert order[: len(old_order)] == old_order
    # What gen-data answers next: the rest of the old prompts, then the new ones (less the held-out).
    assert order[25:] == old_order[25:] + [p.id for p in prompt_order(new)]
    before = path.read_bytes()
    assert append_prompts(path, new) == [] and path.read_bytes() == before


def test_the_committed_file_still_begins_with_the_first_set():
    ids = [p.id for p in read_prompts(COMMITTED)]
    assert len(ids) > FIRST_SET_SIZE and len(set(ids)) == len(ids)
    assert ids_digest(ids[:FIRST_SET_SIZE]) == FIRST_SET_DIGEST


def test_jsdoc_functions_give_name_parameters_description_and_example():
    source = '''
    /**
     * Creates an array of elements split into groups the length of `size`.
     *
     * @param {Array} array The array to process.
     * @example
     *
     *     _.chunk(['a', 'b', 'c'], 2);
     *     // => [['a', 'b'], ['c']]
     */
    function chunk(array, size, guard) {}

    /**
     * The base implementation, not for users to call directly.
     * @private
     */
    function baseChunk(array) {}

    /**
     * @summary Add the specified number of days to the given date.
     * @description Longer text that is not the summary.
     */
    export function addDays(date, amount) {}
    '''
    found = list(_jsdoc_functions(source))
    assert [(name, params) for name, params, _, _ in found] == [("chunk", "array, size"), ("addDays", "date, amount")]
    assert found[0][2] == "Creates an array of elements split into groups the length of `size`."
    assert found[0][3] == "_.chunk(['a', 'b', 'c'], 2);\n// => [['a', 'b'], ['c']]"
    assert found[1][2] == "Add the specified number of days to the given date."


def test_go_and_rust_doc_comments_give_public_functions_with_their_code():
    go = "// Mean gets the average of a slice of numbers.\nfunc Mean(input []float64) float64 {\n" \
         "\ttotal := 0.0\n\tfor _, x := range input {\n\t\ttotal += x\n\t}\n\treturn total\n}\n\n" \
         "// helper is private and has a long enough comment.\nfunc helper() {}\n"
    (name, signature, description, code), = _doc_commented_functions(go, *DOC_COMMENTED["Go"][1:])
    assert (name, signature) == ("Mean", "func Mean(input []float64) float64")
    assert description == "Mean gets the average of a slice of numbers." and code.endswith("return total\n}")
    rust = "    /// Calculates the number of positions where the elements differ.\n    ///\n    /// # Examples\n" \
           "    #[inline]\n    pub fn hamming<I>(a: I, b: I) -> usize\n        where I: Iterator,\n    {\n        0\n    }\n"
    (name, signature, description, code), = _doc_commented_functions(rust, *DOC_COMMENTED["Rust"][1:])
    assert name == "hamming" and signature == "pub fn hamming<I>(a: I, b: I) -> usize where I: Iterator,"
    assert description == "Calculates the number of positions where the elements differ."
    assert code.startswith("pub fn hamming") and code.endswith("    0\n}")


def test_more_chitchat_repeats_the_first_set_and_adds_chats_that_end_on_the_user():
    first = {p.id for p in chitchat_conversations()}
    if not first:
        pytest.skip("chitchat-dataset is not installed")
    more = list(chitchat_more(windows=200))
    assert first < {p.id for p in more}  # the first set's conversations come back unchanged (then de-duplicated)
    windows = [p for p in more if p.source == "chitchat-dataset/mid"]
    assert len(windows) > 50
    for prompt in windows:
        roles = [m["role"] for m in prompt.messages]
        assert len(roles) in (3, 5, 7) and roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]


def test_code_references_pair_a_stub_task_with_the_functions_own_source():
    pairs = list(code_references(per_package=3, packages=("jinja2",)))
    if not pairs:
        pytest.skip("jinja2 is not installed")
    assert len(pairs) == 3 and len({p.id for p, _ in pairs}) == 3
    for prompt, answer in pairs:
        task = prompt.messages[-1]["content"]
        name = task.split("def ", 1)[1].split("(", 1)[0]
        assert prompt.source == "code-references/jinja2" and answer.startswith(f"```python\ndef {name}(")
        docstring = ast.get_docstring(ast.parse(answer.strip("`").removeprefix("python\n")).body[0])
        assert docstring and docstring.split("\n")[0] in task  # the stub carries the real docstring
    assert [p.id for p, _ in pairs] == [p.id for p, _ in code_references(per_package=3, packages=("jinja2",))]


def test_chitchat_replies_end_on_the_user_with_the_real_next_turn():
    pairs = list(chitchat_replies(limit=40))
    if not pairs:
        pytest.skip("chitchat-dataset is not installed")
    assert len(pairs) == 40
    lengths = set()
    for prompt, answer in pairs:
        roles = [m["role"] for m in prompt.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"] and answer.strip()
        lengths.add(len(roles))
    assert lengths == {1, 3, 5}  # opening windows of each length, not only the first turn


def test_math_questions_are_deterministic_and_leave_the_global_random_state_alone():
    pytest.importorskip("mathematics_dataset")
    from dflash_core.training.prompt_sources import math_dataset_questions

    random.seed(5)
    state = random.getstate()
    first = [p.messages[0]["content"] for p in math_dataset_questions(per_module=1)]
    assert random.getstate() == state
    assert len(first) > 60 and first == [p.messages[0]["content"] for p in math_dataset_questions(per_module=1)]


def test_web_platform_questions_ask_about_current_features_only(tmp_path):
    import json

    def compat(deprecated=False, standard=True):
        return {"__compat": {"status": {"deprecated": deprecated, "standard_track": standard}}}

    data = {
        "api": {"Observer": {**compat(), "observe": compat(), "old": compat(deprecated=True),
                             "secure_context_required": compat(), "Observer": compat()},
                "Gone": compat(deprecated=True), "Vendor": compat(standard=False)},
        "javascript": {"builtins": {"Array": {**compat(), "flatMap": compat(), "@@iterator": compat()}}},
        "css": {"properties": {"gap": compat(), "long": compat(), "nosyntax": compat()}},
        "html": {"elements": {"article": compat(), "blink": compat(deprecated=True)}},
        "http": {"headers": {"Accept": compat()}},
    }
    css = {"gap": {"syntax": "<'row-gap'> <'column-gap'>?"}, "long": {"syntax": "x " * 100}, "nosyntax": {}}
    modules = tmp_path / "node_modules"
    (modules / "@mdn/browser-compat-data").mkdir(parents=True)
    (modules / "@mdn/browser-compat-data/data.json").write_text(json.dumps(data))
    (modules / "mdn-data/css").mkdir(parents=True)
    (modules / "mdn-data/css/properties.json").write_text(json.dumps(css))
    prompts = list(web_platform_questions(modules))
    assert sorted(p.source for p in prompts) == ["npm-mdn/api", "npm-mdn/api-member", "npm-mdn/css", "npm-mdn/html",
                                                  "npm-mdn/http", "npm-mdn/javascript"]
    texts = " ".join(p.messages[0]["content"] for p in prompts)
    for asked in ("`Observer`", "`Observer.observe`", "`flatMap`", "`Array", "`gap`",
                  "<article>", "`Accept`"):
        assert asked in texts
    for left_out in ("old`", "secure_context_required", "Gone", "Vendor", "@@iterator", "`long`", "nosyntax", "blink"):
        assert left_out not in texts
    assert [p.to_json() for p in web_platform_questions(modules)] == [p.to_json() for p in prompts]  # deterministic
    assert list(web_platform_questions(None)) == [] and list(web_platform_questions(tmp_path)) == []


def test_wordnet_questions_ask_about_common_words_and_compare_nouns_of_one_category(tmp_path):
    counts = tmp_path / "usr/share/wordnet"
    counts.mkdir(parents=True)
    (counts / "cntlist.rev").write_text("\n".join((
        "dog%1:05:00:: 1 40", "cat%1:05:00:: 1 30", "dog%2:38:00:: 2 6",  # two animals, and "to dog"
        "swift%3:00:00:: 1 9", "rare_bird%1:05:00:: 1 2",  # an adjective; too rare
        "ox%1:05:00:: 1 50", "3-d%5:00:00:: 1 9", "quickly%4:02:00:: 1 50",  # too short, not letters, an adverb
    )) + "\n")
    prompts = list(wordnet_questions(tmp_path, seed=1))
    assert sorted(p.source for p in prompts) == ["debian-wordnet/adj", "debian-wordnet/noun", "debian-wordnet/noun",
                                                  "debian-wordnet/verb"]
    texts = [p.messages[0]["content"] for p in prompts]
    assert not any(w in t for t in texts for w in ("rare bird", "ox", "3-d", "quickly"))
    for text in texts:
        if "difference between" in text:  # compared within the category: the two animals
            assert {"dog", "cat"} <= set(text.rstrip("?").replace(" and ", " ").split())
    assert [p.to_json() for p in wordnet_questions(tmp_path, seed=1)] == [p.to_json() for p in prompts]
    assert list(wordnet_questions(None)) == [] and list(wordnet_questions(tmp_path / "none")) == []
