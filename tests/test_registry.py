"""models.toml: the project's own file parses; every malformed file is refused by name."""

from __future__ import annotations

import pytest

from dflash_core.errors import RegistryError
from dflash_core.registry import load_registry

GOOD_PAIR = """
[pairs.p]
target = { hub = "org/model" }
drafter = { path = "drafter" }
"""


def test_the_projects_registry_parses_with_the_expected_pairs():
    registry = load_registry()
    assert registry.default == "smollm2-135m"
    default = registry.get(None)
    assert default.target.kind == "gguf" and default.target_device == "cpu"
    assert default.drafter.kind == "path"
    for name in ("qwen3-4b", "qwen3-8b", "llama31-8b"):
        assert registry.get(name).needs_cuda
    assert registry.get("qwen3-8b-4bit").quantization == "4bit"


def test_devices_can_differ_between_target_and_drafter(tmp_path):
    file = tmp_path / "m.toml"
    file.write_text(GOOD_PAIR + 'target_device = "cuda:0"\ndrafter_device = "cuda:1"\n')
    pair = load_registry(file).get("p")
    assert (pair.target_device, pair.drafter_device) == ("cuda:0", "cuda:1")


@pytest.mark.parametrize(
    "text, message",
    [
        ("this is [not toml", "not valid TOML"),
        ("default = 'p'\n", "at least one \\[pairs.NAME\\]"),
        ("colour = 'blue'\n" + GOOD_PAIR, "unknown top-level key"),
        ("default = 'q'\n" + GOOD_PAIR, "default = 'q' is not one of the pairs"),
        (GOOD_PAIR + "colour = 'blue'\n", r"\[pairs.p\]: unknown key\(s\) \['colour'\]. Allowed keys"),
        ("[pairs.p]\ndrafter = { path = 'd' }\n", "missing 'target'"),
        ("[pairs.p]\ntarget = { hub = 'org/m' }\n", "missing 'drafter'"),
        (GOOD_PAIR + "dtype = 'float8'\n", "dtype = 'float8'; allowed: float32, bfloat16, float16"),
        (GOOD_PAIR + "device = 'tpu'\n", "device = 'tpu'; allowed"),
        (GOOD_PAIR + "block_size = 0\n", "block_size = 0; expected an integer >= 1"),
        (GOOD_PAIR + "block_size = 'big'\n", "block_size = 'big'"),
        (GOOD_PAIR + "quantization = '3bit'\n", "quantization = '3bit'; allowed: 4bit, 8bit"),
        ("[pairs.p]\ntarget = { hub = 'no-slash' }\ndrafter = { path = 'd' }\n", "not a Hugging Face id"),
        ("[pairs.p]\ntarget = { hub = 'a/b', path = 'c' }\ndrafter = { path = 'd' }\n", "exactly one of"),
        ("[pairs.p]\ntarget = { random = true }\ndrafter = { path = 'd' }\n", "a target cannot be random"),
        ("[pairs.p]\ntarget = { hub = 'a/b' }\ndrafter = { random = true, layers = 0 }\n", "layers = 0"),
        ("[pairs.p]\ntarget = { hub = 'a/b' }\ndrafter = { path = 'x.gguf' }\n", "not GGUF"),
        ("[pairs.p]\ntarget = { package = 'x' }\ndrafter = { path = 'd' }\n", "needs gguf_file"),
        ("[pairs.p]\ntarget = { hub = 'a/b', colour = 1 }\ndrafter = { path = 'd' }\n", "unknown key"),
        ("pairs = 3\n", "at least one"),
    ],
)
def test_malformed_registries_are_refused_naming_file_entry_and_what_is_allowed(tmp_path, text, message):
    file = tmp_path / "models.toml"
    file.write_text(text)
    with pytest.raises(RegistryError, match=message) as info:
        load_registry(file)
    assert str(file) in str(info.value)


def test_unknown_pair_names_list_the_known_ones(tmp_path):
    file = tmp_path / "models.toml"
    file.write_text(GOOD_PAIR)
    with pytest.raises(RegistryError, match="unknown pair 'nope'.*known pairs: p"):
        load_registry(file).get("nope")


def test_missing_registry_file_is_refused(tmp_path):
    with pytest.raises(RegistryError, match="does not exist"):
        load_registry(tmp_path / "absent.toml")
