"""Shared fixtures. The tiny models and reference drafters themselves live in
``dflash_core.testing`` (the GPU check script builds the same ones without pytest)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dflash_core import isa_emulation

# Before anything imports transformers, which reads these once.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# `make test` runs the suite in pytest-xdist workers (most tests are bound by Python's speed on a
# tiny model, not by arithmetic). The workers share the cores out, before torch starts its thread
# pool, and the studios and CLIs they start inherit the share: a thread pool whose cores are busy
# with another's spins and waits at every op, and the tiny models' many small ops then run many
# times slower. A user's own OMP_NUM_THREADS is kept.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = os.environ["DFLASH_TEST_SHARED_THREADS"] = str(
        max(1, (os.cpu_count() or 1) // max(1, int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
    if "torch" in sys.modules:  # a plugin imported it first: its pool exists but is not yet sized
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Under tests/test_other_isas.py's subprocess: run as the CPU it names (imports torch only then).
isa_emulation.apply()


@pytest.fixture(scope="session")
def smollm2_engine():
    """The real SmolLM2-135M target with a random drafter (the pair that needs no training)."""
    from dflash_core.engine import Engine

    return Engine.from_registry("smollm2-135m-random")


@pytest.fixture(scope="module")
def tiny_chat_target(tmp_path_factory):
    """A random 2-layer model with SmolLM2's vocabulary, chat template and tokenizer, on disk."""
    from transformers import AutoTokenizer

    from dflash_core.loading import converted_gguf_dir, load_target, resolve_gguf
    from dflash_core.registry import ModelSource, load_registry
    from dflash_core.testing import tiny_target

    smollm2 = converted_gguf_dir(resolve_gguf(load_registry().get("smollm2-135m").target))
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = tiny_target("llama", vocab=len(tokenizer), layers=2, seed=5)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    folder = tmp_path_factory.mktemp("tiny-chat-target")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return load_target(ModelSource("path", str(folder)), "float32", "cpu")


@pytest.fixture(scope="module")
def engines_loaded_once():
    """The CLI's ``Engine.from_registry`` loads each pair once for the module: each load costs
    seconds (the kernel probes), and many runs on one engine also show that nothing of one
    request carries into the next. Tests without this fixture load afresh, as the CLI does."""
    from dflash_core.engine import Engine

    load = Engine.from_registry.__func__
    loaded: dict[tuple, Engine] = {}

    def from_registry(cls, pair=None, registry=None, progress=None):  # noqa: ANN001, ANN202
        if (pair, registry) not in loaded:
            loaded[pair, registry] = load(cls, pair, registry, progress)
        return loaded[pair, registry]

    patch = pytest.MonkeyPatch()
    patch.setattr(Engine, "from_registry", classmethod(from_registry))
    yield loaded
    patch.undo()


ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_server():
    port = _free_port()
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    env.pop("GRADIO_SERVER_NAME", None)
    proc = subprocess.Popen([sys.executable, "-m", "app"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"app exited early:\n{proc.stdout.read()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("app did not start in 180 s")
    yield url, proc
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def app_url(app_server):
    return app_server[0]


@pytest.fixture(scope="module")
def client(app_url):
    from gradio_client import Client

    return Client(app_url, verbose=False)


@pytest.fixture(scope="module")
def studio():
    """The studio's handlers on the registry's pairs, in process (no server, no warm-up)."""
    from app.service import StudioService
    from app.studio import build_studio

    studio, _ = build_studio(StudioService(warm_up=False))
    return studio


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """One cache for the module's tests: the kernels are built once (about a minute)."""
    before = os.environ.get("DFLASH_CACHE_DIR")
    os.environ["DFLASH_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield Path(os.environ["DFLASH_CACHE_DIR"])
    if before is None:
        os.environ.pop("DFLASH_CACHE_DIR")
    else:
        os.environ["DFLASH_CACHE_DIR"] = before
