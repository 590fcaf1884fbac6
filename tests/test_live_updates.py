"""The Live tab's handler, in process on the real default pair: the engine runs in its own
thread, the page's event stream carries each token and each cycle once (updates do not grow with
the output), the final panes are what was recorded, and Stop / a closed tab end the engine
within a cycle."""

from __future__ import annotations

import html
import json
import re
import time

import pytest

from dflash_core.testing import (RUNS_TO_BUDGET, browser_session, live_channel, live_messages, run_until_live,
                                 stop_at_first_live_update)

from dflash_core.speculative import GenerationConfig

pytestmark = pytest.mark.slow
PROMPT = "Write a Python function that checks whether a string is a palindrome."


Request = browser_session("test-session")


def run_compare(studio, max_new: int, variant=(True, True, True), baseline: bool = True, prompt: str = PROMPT):
    pair = studio.service.registry.default
    adaptive, tree, lookup = variant
    return studio.compare(pair, prompt, 16, 0.0, max_new, 0, baseline, adaptive, tree, lookup, Request())


def visible_text(pane_html: str) -> str:
    spans = re.findall(r'<span class="tok ([^"]*)"[^>]*>(.*?)</span>', pane_html, flags=re.S)
    return "".join(html.unescape(text) for cls, text in spans if "tok-special" not in cls)


def test_each_token_and_cycle_is_sent_once_and_the_final_panes_are_the_record(studio):
    v = studio.views
    updates = list(run_compare(studio, 64))
    live = live_messages(updates, v.live_update)
    final = updates[-1]
    assert "done" in final[v.status] and "tree + prompt lookup + adaptive" in final[v.status]
    # The text panes and the log are sent whole twice only: emptied at the start (with where the
    # run's updates stream), drawn from the records at the end. Through Gradio nothing else but
    # the status line; everything in between goes to the event stream, each token and cycle once.
    whole = [i for i, u in enumerate(updates) if v.dflash_text in u or v.ar_text in u or v.log in u]
    subscribed = [i for i, u in enumerate(updates) if v.live_update in u]
    assert whole == [subscribed[0], len(updates) - 1] and len(subscribed) == 1
    assert all(set(u) == {v.status} for u in updates[whole[0] + 1:-1])
    assert live and {u["run"] for u in live} == {json.loads(updates[whole[0]][v.live_update])["run"]}
    # The counters come with the updates, into boxes tagged with the run.
    assert all("counters" in " ".join(u) for u in live) and 'data-run="' in updates[whole[0]][v.dflash_counters]
    for mode, pane in (("dflash", v.dflash_text), ("ar", v.ar_text)):
        sent = "".join(u.get(mode, "") for u in live)
        assert f'<div class="dfs-text">{sent}</div>' == final[pane], mode
    rows = [u["log"] for u in live if "log" in u]
    assert f'<div class="dfs-log">{"".join(reversed(rows))}</div>' == final[v.log]  # newest first
    # Every update but the panes' own is small and carries no earlier token: the largest update
    # of the second half of the run is no larger than the largest of the first half plus what its
    # own new tokens and cycles take (the counters are of fixed size).
    sizes = [(len(json.dumps(u)), u) for u in live]
    half = len(sizes) // 2
    first_half = max(size for size, _ in sizes[:half])
    for size, u in sizes[half:]:
        assert size <= first_half + len(u.get("dflash", "")) + len(u.get("ar", "")) + len(u.get("log", "")), size
    # The page's greedy text is the engine's own greedy text (DFlash and the baseline alike).
    engine = studio.service.engine(None)
    expected = engine.decode(engine.generate(PROMPT, GenerationConfig(max_new_tokens=64), mode="ar").token_ids)
    assert visible_text(final[v.dflash_text]) == expected
    assert visible_text(final[v.ar_text]) == expected
    assert "identical output" in final[v.speedup] and "the target alone (" in final[v.speedup]


def test_stop_ends_the_engine_within_a_cycle(studio):
    v = studio.views
    rest = stop_at_first_live_update(studio, run_compare(studio, 1500, variant=(False, False, False), prompt=RUNS_TO_BUDGET),
                                     v.live_update, Request())
    assert "stopped" in rest[-1][v.status]
    assert studio.stop(Request()) == "Nothing is running."


def test_a_closed_page_frees_the_engine_within_a_cycle(studio, monkeypatch):
    v = studio.views
    engine = studio.service.engine(None)
    # An answer that runs to the budget, each target pass (blocks and trees) a little slower: the
    # run is still going when the page closes, however fast the default pair.
    runner = engine.target.runner
    for name in ("forward", "forward_tree"):
        def slower(*args, _pass=getattr(runner, name), **kwargs):
            time.sleep(0.01)
            return _pass(*args, **kwargs)
        monkeypatch.setattr(runner, name, slower)
    channel, finish = run_until_live(run_compare(studio, 1500, baseline=False, prompt=RUNS_TO_BUDGET), v.live_update)
    # The page's event stream opens and closes (the tab went away); a reconnecting page would be
    # given ``grace_s`` to come back, which this test does not wait for.
    channel.grace_s = 0.0
    channel.attach()
    channel.detach()
    at_close = engine.last_run["cycles"]
    finish()
    assert not engine.busy
    assert engine.last_run["finish_reason"] == "abandoned"
    assert engine.last_run["cycles"] <= at_close + 1
    assert engine.last_run["tokens"] < 1500
    assert studio.sessions.idle() and channel.closed_at is not None


def test_a_handler_closed_before_its_run_starts_none_and_closes_its_stream(studio):
    """Gradio closes a handler whose page went away at its next yield: the status line a run
    starts with. Nothing may run after that, and the run's event stream ends."""
    v = studio.views
    engine = studio.service.engine(None)
    runs_before = engine.runs
    updates = run_compare(studio, 1500, baseline=False)
    seen = []
    for update in updates:
        seen.append(update)
        if "running" in update.get(v.status, ""):
            break
    channel = live_channel(seen, v.live_update)
    updates.close()
    assert engine.runs == runs_before and not engine.busy
    assert channel.closed_at is not None and channel.messages == []
    assert studio.sessions.idle()


def test_teaching_mode_shows_mask_slots_as_mask(studio):
    engine = studio.service.engine(None)
    mask_text = html.escape(engine.tokenizer.decode([engine.drafter.mask_token_id]))
    state, step, formula, text = studio.teach_start(studio.service.registry.default, PROMPT, 8, 16)
    assert state is not None and "MASK" in step
    assert mask_text not in step  # SmolLM2's mask id would read <gh_stars>
