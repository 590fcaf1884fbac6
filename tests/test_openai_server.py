"""The OpenAI-compatible server, driven by the official ``openai`` client against a real uvicorn
server on 127.0.0.1 serving the SmolLM2 pair with a random drafter."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

from app.service import StudioService
from dflash_core import cli
from dflash_core.serving import build_app

pytestmark = pytest.mark.slow
PAIR = "smollm2-135m-random"
PROMPT = "Explain in two sentences why the sky is blue."
LONG_PROMPT = "Count from 1 to 300, separated by commas."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn in a thread, stopped at teardown."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def service():
    service = StudioService()
    service.engine(PAIR)  # load before the first request times anything
    return service


@pytest.fixture(scope="module")
def server(service):
    server = Server(build_app(service, api_key=""))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def chat(client, prompt: str = PROMPT, **kwargs):
    kwargs.setdefault("max_tokens", 24)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=PAIR, messages=[{"role": "user", "content": prompt}], **kwargs)


def cli_json(capsys, *args: str) -> dict:
    assert cli.main(["generate", "--json", "--pair", PAIR, *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_models_lists_every_registry_pair(client, service):
    models = client.models.list().data
    assert [m.id for m in models] == list(service.registry.pairs)
    assert next(m for m in models if m.id == PAIR).model_extra["status"].startswith("ready")
    assert client.models.retrieve(PAIR).id == PAIR


def test_greedy_chat_equals_the_cli_streamed_or_not(client, capsys):
    expected = cli_json(capsys, "--prompt", PROMPT, "--max-new-tokens", "24")
    whole = chat(client)
    assert whole.choices[0].message.content == expected["text"]
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == ("length" if expected["finish_reason"] == "length" else "stop")
    usage = whole.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (expected["prompt_tokens"], expected["num_tokens"])
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    figures = usage.model_extra["dflash"]
    assert figures["cycles"] == len(expected["cycles"])
    assert figures["tau"] == pytest.approx(expected["tau"], abs=1e-4)
    assert figures["draft_s"] > 0 and figures["verify_s"] > 0 and figures["block_size"] == 16

    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["text"]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed, cycle by cycle
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == expected["num_tokens"]


def test_completions_use_the_prompt_as_is_like_cli_raw(client, capsys):
    expected = cli_json(capsys, "--prompt", "def fibonacci(n):", "--max-new-tokens", "20", "--raw")
    out = client.completions.create(model=PAIR, prompt="def fibonacci(n):", max_tokens=20, temperature=0)
    assert out.choices[0].text == expected["text"]
    streamed = client.completions.create(model=PAIR, prompt="def fibonacci(n):", max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected["text"]


def test_ar_variant_gives_the_same_greedy_text_without_drafts(client):
    dflash, ar = chat(client), chat(client, extra_body={"variant": "ar"})
    assert ar.choices[0].message.content == dflash.choices[0].message.content
    assert ar.usage.model_extra["dflash"]["tau"] is None and ar.usage.model_extra["dflash"]["block_size"] == 1
    small = chat(client, extra_body={"block_size": 4})
    assert small.choices[0].message.content == dflash.choices[0].message.content
    assert small.usage.model_extra["dflash"]["block_size"] == 4


def test_stop_strings_cut_the_text_before_them(client):
    full = chat(client, max_tokens=32).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.find(stop)]
    cut = chat(client, max_tokens=32, stop=[stop, "@@never@@"])
    assert cut.choices[0].message.content == expected
    assert cut.choices[0].finish_reason == "stop"
    streamed = chat(client, max_tokens=32, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_seed_makes_sampling_repeatable(client):
    first = chat(client, temperature=0.9, top_p=0.9, seed=7)
    again = chat(client, temperature=0.9, top_p=0.9, seed=7)
    assert first.choices[0].message.content == again.choices[0].message.content


@pytest.mark.parametrize("kwargs, error, message", [
    ({"model": "no-such-pair"}, openai.NotFoundError, "unknown pair 'no-such-pair'"),
    ({"max_tokens": 10**9}, openai.BadRequestError, "max_new_tokens = 1000000000; allowed: an integer from 1 to"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, openai.BadRequestError, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, openai.BadRequestError, "messages[0].content"),
    ({"top_p": 2.0}, openai.BadRequestError, "top_p = 2.0; allowed: a number in (0, 1]"),
    ({"extra_body": {"block_size": 99}}, openai.BadRequestError, "block_size = 99; allowed"),
    ({"messages": [{"role": "user", "content": "   "}]}, openai.BadRequestError, "the prompt is empty"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(client, kwargs, error, message):
    request = {"model": PAIR, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **kwargs}
    with pytest.raises(error) as info:
        client.chat.completions.create(**request)
    body = info.value.body
    assert message in body["message"]
    assert set(body) == {"message", "type", "param", "code"}
    assert chat(client, max_tokens=4).choices[0].message.content  # still serving


def test_malformed_json_and_unknown_paths_answer_in_openai_shape(server):
    bad = httpx.post(server.url + "/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    missing = httpx.get(server.url + "/nowhere")
    assert missing.status_code == 404 and "error" in missing.json()


def test_a_client_that_leaves_mid_stream_frees_the_engine_within_a_cycle(client, service):
    engine = service.engine(PAIR)
    stream = chat(client, LONG_PROMPT, max_tokens=400, stream=True)
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    assert engine.busy
    cycles_when_left = engine.last_run["cycles"]
    stream.close()
    deadline = time.time() + 5
    while engine.busy:
        assert time.time() < deadline, "the engine is still generating for a client that left"
        time.sleep(0.01)
    run = engine.last_run
    assert run["finish_reason"] in ("abandoned", "cancelled")
    # The cycle in flight when the client left may finish (and the one whose text was being sent).
    assert run["cycles"] <= cycles_when_left + 2 and run["tokens"] < 400
    assert chat(client, max_tokens=4).choices[0].message.content  # the next request runs


def test_concurrent_requests_take_turns_on_the_engine(client):
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: chat(client, max_tokens=12).choices[0].message.content, range(3)))
    assert len(set(answers)) == 1 and answers[0]


def test_an_api_key_from_the_environment_is_required_when_set(service, monkeypatch):
    monkeypatch.setenv("DFLASH_API_KEY", "s3cret")
    server = Server(build_app(service))
    try:
        with pytest.raises(openai.AuthenticationError) as info:
            openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
        assert info.value.body["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/models").status_code == 401
        good = openai.OpenAI(base_url=server.url, api_key="s3cret", max_retries=0)
        assert PAIR in [m.id for m in good.models.list()]
    finally:
        server.stop()


@pytest.mark.parametrize("command", [["-m", "app"], ["-m", "dflash_core", "serve", "--port", "{port}"]],
                         ids=["studio", "serve"])
def test_the_api_runs_on_the_studio_port_and_alone(command):
    """``python -m app`` serves the API on the studio's own port; ``python -m dflash_core serve``
    serves it without the UI. Both answer a chat with the default pair (loaded in the background)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dflash_core.registry import load_registry

    port = free_port()
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False", "DFLASH_API_KEY": ""}
    env.pop("GRADIO_SERVER_NAME", None)
    args = [sys.executable, *(part.format(port=port) for part in command)]
    proc = subprocess.Popen(args, cwd=Path(__file__).resolve().parent.parent, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, f"{' '.join(command)} exited: {proc.stderr.read()}"
            assert time.time() < deadline, f"{' '.join(command)} did not serve /v1/models in 180 s"
            try:
                if httpx.get(url + "/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        default = load_registry().default
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        assert default in [m.id for m in client.models.list()]
        answer = client.chat.completions.create(model=default, messages=[{"role": "user", "content": "Say hello."}],
                                                max_tokens=8, temperature=0)
        assert answer.choices[0].message.content and answer.usage.completion_tokens <= 8
        if command == ["-m", "app"]:
            assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).status_code == 200  # the studio still there
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
