"""Each session's run in progress and its Stop (app/sessions.py), without a model."""

from __future__ import annotations

import threading
import time

from app.sessions import Sessions
from dflash_core.testing import browser_session

PAGE = browser_session("page")


def handler(sessions: Sessions, request, last_update_takes_s: float = 0.2):  # noqa: ANN001, ANN201
    """A run as the studio's handlers hold one: updates until Stop, then a last update that takes
    a while to make (the final conversation, charts and counters)."""
    with sessions.run(request) as stop:
        yield "running"
        while not stop.wait(0.01):
            pass
        time.sleep(last_update_takes_s)
        yield "stopped"


def drive(updates) -> tuple[list, threading.Thread]:  # noqa: ANN001
    """Gradio's part: take each update as it comes, in a thread; returns once the first is in."""
    got: list = []
    first = threading.Event()

    def take() -> None:
        for update in updates:
            got.append(update)
            first.set()

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    assert first.wait(10)
    return got, thread


def test_stop_answers_only_once_the_runs_last_update_is_handed_over():
    # Stop's answer and the run's last update reach the page on different connections: Stop may
    # only answer once the run's "stopped" is out, or its own answer could land after it.
    sessions = Sessions()
    got, thread = drive(handler(sessions, PAGE))
    assert not sessions.settled(PAGE, 0)
    assert sessions.stop(PAGE) is True
    assert got == ["running", "stopped"] and sessions.idle()
    thread.join(10)
    assert sessions.stop(PAGE) is None  # nothing runs any more


def test_a_run_slower_to_end_than_stop_waits_is_still_told_to_stop():
    sessions = Sessions()
    got, thread = drive(handler(sessions, PAGE, last_update_takes_s=1.0))
    assert sessions.stop(PAGE, wait_s=0.05) is False  # still ending: Stop says so
    thread.join(10)
    assert got == ["running", "stopped"] and sessions.idle()


def test_sessions_are_stopped_apart_and_a_newer_run_keeps_its_entry():
    sessions = Sessions()
    other = browser_session("other page")
    got, thread = drive(handler(sessions, PAGE))
    their, their_thread = drive(handler(sessions, other))
    assert sessions.stop(PAGE) is True and got[-1] == "stopped"
    assert not sessions.settled(other, 0) and their == ["running"]  # another page's run goes on
    assert sessions.stop(other) is True and their[-1] == "stopped"
    # A page that starts a run before its previous one has wound down: the older run's end
    # leaves the newer run's entry (and Stop) in place.
    older = handler(sessions, PAGE)
    assert next(older) == "running"
    newer, newer_thread = drive(handler(sessions, PAGE))
    older.close()
    assert not sessions.settled(PAGE, 0)
    assert sessions.stop(PAGE) is True and newer[-1] == "stopped" and sessions.idle()
    for t in (thread, their_thread, newer_thread):
        t.join(10)


def test_clear_right_after_the_last_update_finds_the_session_settled():
    # Gradio hands a run's last update to the page, then resumes the handler, which lets the
    # session go: a page quick to act on "done" may ask in between.
    sessions = Sessions()
    handed_over, sent = threading.Event(), threading.Event()

    def run():  # noqa: ANN202
        with sessions.run(PAGE):
            yield "done"

    def gradio() -> None:
        updates = run()
        next(updates)
        handed_over.set()
        sent.wait(10)  # sending the update
        next(updates, None)

    thread = threading.Thread(target=gradio, daemon=True)
    thread.start()
    assert handed_over.wait(10)
    assert not sessions.settled(PAGE, 0)  # the page already shows "done"; the run still holds the session
    threading.Timer(0.2, sent.set).start()
    assert sessions.settled(PAGE) and sessions.idle()  # Clear's wait covers the rest
    thread.join(10)
