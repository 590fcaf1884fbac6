"""The live pages' event streams (app/channel.py) over real HTTP: framing, order, resuming after a
reconnect, the end of a run, unknown keys, and a reader that leaves marking the run abandoned."""

from __future__ import annotations

import json
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from app.channel import Channels, build_router  # noqa: E402


@pytest.fixture()
def served():
    channels = Channels()
    app = fastapi.FastAPI()
    app.include_router(build_router(channels))
    with TestClient(app) as client:
        yield channels, client


def events(response) -> list[tuple[str, str, str]]:  # noqa: ANN001
    """(event, id, data) of every event of a text/event-stream, comments skipped."""
    out, fields = [], {}
    for line in response.iter_lines():
        if not line:
            if fields:
                out.append((fields.get("event", "message"), fields.get("id", ""), fields.get("data", "")))
            fields = {}
        elif not line.startswith(":"):
            key, _, value = line.partition(": ")
            fields[key] = value
    return out


def test_a_run_streams_in_order_and_ends(served):
    channels, client = served
    channel = channels.open()
    channel.publish(json.dumps({"seq": 0}))

    def write_the_rest() -> None:  # the handler's thread, while the page reads
        for seq in range(1, 5):
            time.sleep(0.05)
            channel.publish(json.dumps({"seq": seq}))
        channel.close()

    writer = threading.Thread(target=write_the_rest)
    writer.start()
    with client.stream("GET", channel.url) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        got = events(response)
    writer.join()
    assert got[:-1] == [("message", str(i), json.dumps({"seq": i})) for i in range(5)]
    assert got[-1][0] == "end"


def test_a_reconnecting_page_resumes_after_the_last_event_it_had(served):
    channels, client = served
    channel = channels.open()
    for seq in range(4):
        channel.publish(json.dumps({"seq": seq}))
    channel.close()
    with client.stream("GET", channel.url, headers={"Last-Event-ID": "1"}) as response:
        got = events(response)
    assert [e[1] for e in got if e[0] == "message"] == ["2", "3"]


def test_an_unknown_key_is_refused_with_a_reason(served):
    _, client = served
    response = client.get("/dfs/live/not-a-run")
    assert response.status_code == 404 and "no such live run" in response.json()["detail"]


def test_keys_are_unguessable_and_distinct():
    channels = Channels()
    keys = {channels.open().key for _ in range(50)}
    assert len(keys) == 50 and all(len(k) >= 20 for k in keys)


def test_a_page_that_leaves_marks_the_run_abandoned_after_its_grace():
    channel = Channels().open(grace_s=0.2)
    assert not channel.abandoned()  # nobody has come yet: the page may still be loading
    channel.attach()
    assert not channel.abandoned()
    channel.detach()
    assert not channel.abandoned()  # an EventSource reconnects on its own: it gets a moment
    channel.attach()
    channel.detach()
    time.sleep(0.25)
    assert channel.abandoned()
    channel.attach()  # back after all
    assert not channel.abandoned()


def test_closed_channels_are_dropped_after_a_while(monkeypatch):
    import app.channel as module

    channels = Channels()
    old = channels.open()
    old.close()
    monkeypatch.setattr(module, "CLOSED_KEPT_S", 0.0)
    time.sleep(0.01)
    current = channels.open()
    assert channels.get(old.key) is None and channels.get(current.key) is current and len(channels) == 1
