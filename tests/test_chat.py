"""The studio's Chat tab, in process on the real default pair (the handlers driven directly, as
tests/test_live_updates.py does for the Live tab), the thinking-mode box and the OpenAI server's
thinking default on a tiny pair whose template has the switch, and the chat in a real browser."""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path

import pytest

from dflash_core.messages import encode_messages
from dflash_core.testing import (RUNS_TO_BUDGET, browser_session, contains_run as has, empty_think_block, live_messages,
                                 open_studio, stop_at_first_live_update, thinking_registry)
from dflash_core.speculative import GenerationConfig, collect

pytestmark = pytest.mark.slow
MAX_NEW = 16
SPEEDUP = r"[\d.]+× (?:faster than|the speed of) the target alone \([\d.]+ vs [\d.]+ tok/s\)(?:: slower here)?"


Request = browser_session("chat-session")


def say(studio, message: str | None, history: list, max_new: int = MAX_NEW, baseline: bool = False,
        variant: str = "plain", system: str = "", thinking: bool = False):
    """The chat's generator for one message (None: Regenerate)."""
    pair = studio.service.registry.default
    settings = (system, 16, 0.0, max_new, 0, baseline, variant, thinking, Request())
    if message is None:
        return studio.chat.regenerate(pair, history, *settings)
    return studio.chat.send(pair, message, history, *settings)


def history_of(studio, updates: list[dict]) -> list[dict]:
    return [u[studio.chat.views.history] for u in updates if studio.chat.views.history in u][-1]


def greedy_reference(engine, ids: list[int], max_new: int = MAX_NEW) -> list[int]:
    """The target alone (autoregressive, greedy) on the same prompt ids."""
    config = engine.prepare("x", GenerationConfig(max_new_tokens=max_new), "ar")[1]
    return collect(engine.stream_ids(ids, config)).token_ids


def contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def visible_text(pane_html: str) -> str:
    spans = re.findall(r'<span class="tok ([^"]*)"[^>]*>(.*?)</span>', pane_html, flags=re.S)
    return "".join(html.unescape(text) for cls, text in spans if "tok-special" not in cls)


@pytest.fixture(scope="module")
def two_turns(studio):
    first = list(say(studio, "My name is Ada. Please remember it.", []))
    second = list(say(studio, "What is my name?", history_of(studio, first)))
    return first, second


def test_two_turns_the_second_answered_with_the_first_in_its_prompt(studio, two_turns):
    from app.chat import CHAT_PANES, fit_conversation

    v = studio.chat.views
    engine = studio.service.engine(None)
    first, second = two_turns
    history = history_of(studio, second)
    assert [t["role"] for t in history] == ["user", "assistant", "user", "assistant"]
    assert "done" in second[-1][v.status]
    # The second answer's prompt is the whole conversation through the chat template: it holds the
    # first answer's tokens, and greedy DFlash answered it exactly as the target alone does.
    ids, dropped = fit_conversation(engine, history[:3], "", engine.thinking(None), MAX_NEW)
    assert dropped == 0 and history[3]["prompt_ids"] == ids
    assert contains(ids, history[1]["token_ids"][:-1] or history[1]["token_ids"])
    assert history[1]["content"] in engine.decode(ids)
    assert history[3]["token_ids"] == greedy_reference(engine, ids)
    first_ids = encode_messages(engine.tokenizer, [{"role": "user", "content": history[0]["content"]}])
    assert history[1]["token_ids"] == greedy_reference(engine, first_ids)
    assert history[3]["content"] == engine.decode(history[3]["token_ids"])
    # The answer streamed into the chat's own panes, each token and cycle once; the conversation
    # ends drawn from the record.
    live = live_messages(second, v.live_update)
    assert live and all(u["panes"] == CHAT_PANES for u in live)
    assert "".join(u.get("dflash", "") for u in live) == history[3]["html"]
    assert visible_text(history[3]["html"]) == history[3]["content"]
    assert history[3]["html"] in second[-1][v.conversation]
    assert html.escape(history[2]["content"]) in second[-1][v.conversation]
    rows = [u["log"] for u in live if "log" in u]
    assert f'<div class="dfs-log">{"".join(reversed(rows))}</div>' == second[-1][v.log]
    assert "cycles" in second[-1][v.counters] and "τ" in second[-1][v.counters]


def test_regenerate_answers_the_last_turn_again_with_the_baseline_and_speedup(studio, two_turns):
    v = studio.chat.views
    history = history_of(studio, two_turns[1])
    updates = list(say(studio, None, history, baseline=True))
    again = history_of(studio, updates)
    assert len(again) == 4 and again[:3] == history[:3]
    assert again[3]["token_ids"] == history[3]["token_ids"]  # greedy: the same answer
    shown = re.sub(r"<[^>]+>", "", updates[-1][v.speedup])
    assert re.search(SPEEDUP, shown) and "identical output" in shown
    assert re.search(SPEEDUP + " · identical output ✓", again[3]["note"])
    assert visible_text(updates[-1][v.ar_text]) == again[3]["content"]
    # Regenerate with nothing to answer says so.
    assert "Nothing to regenerate" in list(say(studio, None, []))[-1][v.status]


def test_the_baseline_runs_for_an_earlier_answer_on_its_own_prompt_and_leaves_the_words_alone(
        studio, two_turns, monkeypatch):
    from app.render import cycle_log_html

    v = studio.chat.views
    engine = studio.service.engine(None)
    history = history_of(studio, two_turns[1])
    picker = two_turns[1][-1][v.answer]
    assert [index for _, index in picker.choices] == [1, 3] and picker.value == 3
    assert picker.choices[0][0] == "Answer 1: My name is Ada. Please remember it."
    updates = list(studio.chat.time_answer(1, history, Request()))
    timed = history_of(studio, updates)
    # The target alone ran on the first answer's own prompt (not the conversation since) and said
    # exactly what greedy DFlash said; only that answer's note changed, gaining the speedup.
    assert engine.last_run["tokens"] == len(history[1]["token_ids"])
    assert visible_text(updates[-1][v.ar_text]) == history[1]["content"]
    assert [(t["role"], t["content"], t.get("token_ids")) for t in timed] == [
        (t["role"], t["content"], t.get("token_ids")) for t in history]
    assert re.search(SPEEDUP + " · identical output ✓$", timed[1]["note"])
    assert timed[1]["note"].startswith(history[1]["note"]) and timed[3]["note"] == history[3]["note"]
    assert "baseline for answer 1" in updates[-1][v.status] and "identical output ✓" in updates[-1][v.status]
    shown = re.sub(r"<[^>]+>", "", updates[-1][v.speedup])
    assert re.search(SPEEDUP, shown) and "identical output" in shown
    # Beside it, that answer's own DFlash counters and cycle log (not the newest answer's).
    beside = [u for u in updates if v.counters in u]
    assert len(beside) == 1 and "answer 1" in beside[0][v.counters]
    assert beside[0][v.log] == cycle_log_html(history[1]["record"])
    live = live_messages(updates, v.live_update)
    assert live and all(set(u) == {"run", "ar", "ar_counters", "panes"} for u in live)
    assert timed[1]["note"] in updates[-1][v.conversation]
    # Nothing to time, or an engine error on the way: said, and the conversation is untouched.
    assert "No answer to time yet" in list(studio.chat.time_answer(None, [], Request()))[-1][v.status]
    assert "No answer to time yet" in list(studio.chat.time_answer(0, history, Request()))[-1][v.status]
    fail_after(engine, 1, monkeypatch)
    failed = list(studio.chat.time_answer(3, history, Request()))
    assert "⚠️" in failed[-1][v.status] and "the conversation is unchanged" in failed[-1][v.status]
    assert not any(v.history in u for u in failed) and studio.sessions.idle()


def test_clear_starts_a_new_conversation(studio, two_turns):
    from app.chat import AR_PLACEHOLDER
    from app.render import CHAT_PLACEHOLDER

    v = studio.chat.views
    cleared = studio.chat.clear(Request())
    assert cleared[v.history] == [] and CHAT_PLACEHOLDER in cleared[v.conversation]
    # Nothing of the last answer is left: its cycle log, counters, baseline and the answer picker.
    assert "dfs-empty" in cleared[v.log] and "waiting" in cleared[v.counters] and "waiting" in cleared[v.ar_counters]
    assert html.escape(AR_PLACEHOLDER) in cleared[v.ar_text] and "Speedup appears" in cleared[v.speedup]
    assert cleared[v.answer].choices == [] and cleared[v.answer].value is None
    assert "Type a message" in list(say(studio, "   ", []))[-1][v.status]


def test_stop_ends_the_answer_within_a_cycle_and_keeps_what_was_said(studio):
    v = studio.chat.views

    def clear_is_refused() -> None:  # not while answering
        assert "press Stop first" in studio.chat.clear(Request())[v.status]

    rest = stop_at_first_live_update(studio, say(studio, RUNS_TO_BUDGET, [], max_new=1500),
                                     v.live_update, Request(), while_running=clear_is_refused)
    assert "stopped" in rest[-1][v.status]
    answer = history_of(studio, rest)[-1]
    assert answer["role"] == "assistant" and "stopped" in answer["note"] and len(answer["token_ids"]) < 1500
    # The baseline for a stopped answer says the same tokens (as many as the answer has).
    timed = list(studio.chat.time_answer(1, history_of(studio, rest), Request()))
    assert re.search(SPEEDUP + " · identical output ✓$", history_of(studio, timed)[-1]["note"])


def fail_after(engine, events: int, monkeypatch) -> None:
    """Make ``engine`` raise the context-overflow error after ``events`` events of each run."""
    from dflash_core.errors import PromptError

    real = engine.stream_ids

    def stream_ids(ids, config, should_stop=None):
        def failing():
            inner = real(ids, config, should_stop)
            try:
                for _ in range(events):
                    yield next(inner)
                raise PromptError("the conversation no longer fits the target's context (a test's failure)")
            finally:
                inner.close()

        return failing()

    monkeypatch.setattr(engine, "stream_ids", stream_ids)


def test_an_engine_error_mid_answer_keeps_the_conversation_well_formed(studio, monkeypatch):
    v = studio.chat.views
    engine = studio.service.engine(None)
    first = history_of(studio, list(say(studio, "Hello!", [], max_new=4)))
    # Broken off after its first token: the answer so far is kept, marked.
    fail_after(engine, 1, monkeypatch)
    updates = list(say(studio, "Tell me about the sea.", first, max_new=8))
    assert "⚠️" in updates[-1][v.status] and "the answer so far is kept" in updates[-1][v.status]
    broken = history_of(studio, updates)
    assert [t["role"] for t in broken] == ["user", "assistant", "user", "assistant"]
    assert broken[3]["note"].startswith("interrupted: the conversation no longer fits")
    assert 1 <= len(broken[3]["token_ids"]) < 8
    assert "interrupted" in updates[-1][v.conversation]
    # Failing before its first token: the conversation is as it was, the message back in its box.
    fail_after(engine, 0, monkeypatch)
    updates = list(say(studio, "And the mountains?", broken, max_new=8))
    assert updates[-1][v.history] == broken and updates[-1][v.message] == "And the mountains?"
    assert "as it was" in updates[-1][v.status] and "⚠️" in updates[-1][v.status]
    assert updates[-1][v.answer].value == 3
    monkeypatch.undo()
    said = broken[3]["token_ids"]  # lossless as far as it went
    assert said == greedy_reference(engine, broken[3]["prompt_ids"], 8)[:len(said)]
    # The next turn and Regenerate both work on top of the interrupted answer.
    more = history_of(studio, list(say(studio, "And the mountains?", broken, max_new=4)))
    assert [t["role"] for t in more] == ["user", "assistant"] * 3 and more[:4] == broken
    assert contains(more[5]["prompt_ids"], broken[3]["token_ids"])
    again = history_of(studio, list(say(studio, None, broken, max_new=8)))
    assert len(again) == 4 and again[:3] == broken[:3] and "interrupted" not in again[3]["note"]
    assert again[3]["token_ids"] == greedy_reference(engine, again[3]["prompt_ids"], 8)
    assert not engine.busy and studio.sessions.idle()


def test_a_conversation_too_long_for_the_context_drops_its_oldest_exchanges(studio, two_turns, monkeypatch):
    from app.chat import fit_conversation

    v = studio.chat.views
    engine = studio.service.engine(None)
    history = history_of(studio, two_turns[1]) + [{"role": "user", "content": "And what did I ask first?"}]
    whole = len(fit_conversation(engine, history, "Be brief.", engine.thinking(None), MAX_NEW)[0])
    # A prompt limit just under the whole conversation: the oldest exchange goes (the system
    # prompt stays), and the answer's note says so.
    monkeypatch.setenv("DFLASH_MAX_PROMPT_TOKENS", str(whole - 1))
    ids, dropped = fit_conversation(engine, history, "Be brief.", engine.thinking(None), MAX_NEW)
    assert dropped == 1 and "Be brief." in engine.decode(ids) and history[0]["content"] not in engine.decode(ids)
    assert history[2]["content"] in engine.decode(ids)
    updates = list(say(studio, history[-1]["content"], history[:-1], max_new=4, system="Be brief."))
    answer = history_of(studio, updates)[-1]
    assert "oldest exchange(s) left out" in answer["note"] and "context" in answer["note"]
    # When even the last message does not fit, the engine's own context message is shown.
    monkeypatch.setenv("DFLASH_MAX_PROMPT_TOKENS", "3")
    updates = list(say(studio, "Hello there, how are you?", [], max_new=4))
    assert re.search(r"the prompt is \d+ tokens; the target accepts at most 3", updates[-1][v.status])
    assert v.history not in updates[-1]


def test_the_thinking_box_is_off_and_disabled_for_a_template_without_the_switch(studio):
    from app.chat import thinking_box

    engine = studio.service.engine(None)
    assert not engine.thinking_switch
    box = thinking_box(studio.service, None)
    assert box.interactive is False and box.value is False and "no thinking switch" in box.info
    # The box's value does not reach a template without the switch (no error, the pair decides).
    updates = list(say(studio, "Hi!", [], max_new=2, thinking=True))
    assert "done" in updates[-1][studio.chat.views.status]


@pytest.fixture(scope="module")
def thinking_pair(tmp_path_factory):
    return str(thinking_registry(tmp_path_factory.mktemp("thinking"), "enable_thinking = false"))


def test_the_thinking_box_follows_the_pair_and_reaches_the_template(thinking_pair):
    from app.chat import thinking_box
    from app.service import StudioService
    from app.studio import build_studio

    service = StudioService(thinking_pair, warm_up=False)
    assert thinking_box(service, "tiny").interactive is False  # not loaded yet
    box = thinking_box(service, "tiny", load=True)
    assert box.interactive is True and box.value is False and "off" in box.info  # the pair's setting
    studio, _ = build_studio(service)
    engine = service.engine("tiny")
    block = empty_think_block(engine.tokenizer)
    prompts = {}
    for thinking in (False, True):
        updates = list(studio.chat.send("tiny", "hi there", [], "", 4, 0.0, 4, 0, False, "plain", thinking, Request()))
        answer = history_of(studio, updates)[-1]
        prompts[thinking] = len(answer["prompt_ids"])
        ids = encode_messages(engine.tokenizer, [{"role": "user", "content": "hi there"}], thinking)
        assert answer["prompt_ids"] == ids and has(ids, block) is (not thinking)
        assert answer["token_ids"] == greedy_reference(engine, ids, 4)
    assert prompts[False] == prompts[True] + len(block)
    # The Live tab takes the box too: its greedy text is the target's on the prompt so encoded.
    for thinking in (False, True):
        final = list(studio.compare("tiny", "hi there", 4, 0.0, 8, 0, False, False, False, False, Request(),
                                    thinking))[-1]
        ids = encode_messages(engine.tokenizer, [{"role": "user", "content": "hi there"}], thinking)
        assert "done" in final[studio.views.status]
        assert visible_text(final[studio.views.dflash_text]) == engine.decode(greedy_reference(engine, ids, 8))


def test_the_openai_server_defaults_thinking_to_the_pairs_setting(thinking_pair):
    from dflash_core.engine import Engine
    from dflash_core.serving import protocol

    engine = Engine.from_registry("tiny", thinking_pair)
    block = empty_think_block(engine.tokenizer)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4}
    default = engine.resolve(protocol.parse(body, "chat").generation).prompt_ids
    on = engine.resolve(protocol.parse({**body, "thinking": True}, "chat").generation).prompt_ids
    assert has(default, block)  # the pair says off
    assert not has(on, block)


def open_chat(browser, url: str):
    page = open_studio(browser, url)
    page.get_by_role("tab", name="Chat").click()
    page.wait_for_selector("#dfs-chat-send", timeout=30_000)
    # Loading and warming the pair up comes first, so that each answer's wait is for answering.
    page.wait_for_function("() => /ready|failed/.test(document.querySelector('#dfs-model-status')?.innerText || '')",
                           timeout=600_000)
    assert "ready" in page.locator("#dfs-model-status").inner_text()
    return page


def chat_status(page, text: str, timeout_ms: int) -> None:
    page.wait_for_function(f"() => (document.querySelector('#dfs-chat-status')?.innerText || '').includes({text!r})",
                           timeout=timeout_ms)


def finished_answers(page) -> int:
    return page.locator("#dfs-chat-conv .dfs-chat-assistant .dfs-text:not([data-run])").count()


def send_in_browser(page, message: str, until: str) -> None:
    """Send a message; wait until its answer is in the conversation (``until`` = "done") or the
    status line shows ``until``."""
    before = finished_answers(page)
    page.locator("#dfs-chat-message textarea").fill(message)
    page.locator("#dfs-chat-send").click()
    if until == "done":
        page.wait_for_function(
            "(n) => document.querySelectorAll('#dfs-chat-conv .dfs-chat-assistant .dfs-text:not([data-run])').length > n"
            " && (document.querySelector('#dfs-chat-status')?.innerText || '').includes('done')", arg=before,
            timeout=240_000)
    else:
        chat_status(page, until, 240_000)


@pytest.mark.browser
def test_real_browser_chat_two_turns_a_baseline_for_the_first_and_stop(app_url):
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.fail("Debian's chromium is not installed: run `make browser`")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"])
        page = open_chat(browser, app_url)
        page.locator("#dfs-chat-max-new input[type=number]").fill("24")
        page.locator("#dfs-chat-max-new input[type=number]").press("Enter")
        page.locator("#dfs-chat-variant input[value=plain]").check()
        send_in_browser(page, "My name is Ada. Please remember it.", "done")
        send_in_browser(page, "What is my name?", "done")
        answers = page.locator("#dfs-chat-conv .dfs-chat-assistant")
        assert answers.count() == 2 and page.locator("#dfs-chat-conv .dfs-chat-user").count() == 2
        # The second answer knows the name, which only the first turn said.
        assert "Ada" in answers.nth(1).inner_text()
        assert answers.nth(1).locator(".tok-target").count() >= 1
        assert "cycle" in answers.nth(1).locator(".tok").first.get_attribute("title")
        assert page.locator("#dfs-chat-log .dfs-cycle").count() >= 1
        # The baseline for the first answer, picked from the list: the target alone on that
        # answer's prompt says exactly what it said, and the conversation's words stay as they were.
        said = [answers.nth(i).locator(".dfs-text").inner_text() for i in range(2)]
        page.locator("#dfs-chat-answer input").click()
        page.get_by_role("option", name="Answer 1: My name is Ada. Please remember it.").click()
        page.locator("#dfs-chat-time").click()
        chat_status(page, "baseline for answer 1", 240_000)
        assert "identical output ✓" in page.locator("#dfs-chat-status").inner_text()
        assert page.locator("#dfs-chat-ar .dfs-text").inner_text() == said[0]
        assert re.search(SPEEDUP, answers.nth(0).locator(".dfs-chat-note").inner_text())
        assert [answers.nth(i).locator(".dfs-text").inner_text() for i in range(2)] == said
        # Stop ends a long answer; what it had said stays, marked as stopped. Plain DFlash: the
        # fastest variant's lookup guesses a count's number words so well that it reaches the
        # 1,500-token budget in about two seconds here, which a Stop on a loaded machine missed.
        page.locator("#dfs-chat-variant input[value=plain]").check()
        page.locator("#dfs-chat-max-new input[type=number]").fill("1500")
        page.locator("#dfs-chat-max-new input[type=number]").press("Enter")
        send_in_browser(page, RUNS_TO_BUDGET, "answering")
        page.wait_for_function("() => document.querySelectorAll('#dfs-chat-conv .dfs-text[data-run] .tok').length > 0",
                               timeout=120_000)
        page.locator("#dfs-chat-stop").click()
        chat_status(page, "stopped", 60_000)
        assert answers.count() == 3 and "stopped" in answers.nth(2).inner_text()
        page.locator("#dfs-chat-clear").click()
        page.wait_for_function("() => document.querySelectorAll('#dfs-chat-conv .dfs-chat-turn').length === 0",
                               timeout=30_000)
        assert page.locator("#dfs-chat-answer input").input_value() == ""
        browser.close()
