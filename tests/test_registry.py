"""models.toml: the project's own file parses; every malformed file is refused by name."""

from __future__ import annotations

from pathlib import Path

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
    assert registry.default == "smollm2-135m-w4a8"
    assert registry.get("smollm2-135m-int4").weights == "int4" and registry.get("smollm2-135m-int4").kernels == "aoti"
    default = registry.get(None)
    # The GGUF as llama.cpp computes it, or the bf16 pair where the CPU cannot run those kernels.
    assert (default.weights, default.kernels, default.otherwise) == ("w4a8", "aoti", registry.get("smollm2-135m"))
    assert registry.get("smollm2-135m").otherwise is None
    assert default.target.kind == "gguf" and default.target_device == "cpu"
    assert default.drafter.kind == "path"
    for name in ("qwen3-4b", "qwen3-8b", "llama31-8b"):
        assert registry.get(name).needs_cuda
    assert registry.get("qwen3-8b-4bit").quantization == "4bit"
    # The default pair's models on the fastest CPU kernels (docs/BENCHMARKS.md), by name.
    fast = registry.get("smollm2-135m-int8")
    assert (fast.target, fast.drafter) == (default.target, default.drafter)
    assert (fast.weights, fast.kernels, fast.dtype, fast.target_device) == ("int8", "aoti", "float32", "cpu")
    # Every pair of SmolLM2-135M-Instruct with a trained drafter guesses from its committed answers too.
    answers = Path(default.lookup_answers)
    assert answers.is_absolute() and (answers / "manifest.json").is_file()
    for name in ("smollm2-135m", "smollm2-135m-int4", "smollm2-135m-int8", "smollm2-135m-w8a8"):
        assert registry.get(name).lookup_answers == default.lookup_answers
    assert registry.get("qwen3-8b").lookup_answers is None


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
        (GOOD_PAIR + "dtype = 'float8'\n", "dtype = 'float8'; allowed: auto, float32, bfloat16, float16"),
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


# Every drafter z-lab/dflash's README lists, with the target its model card names.
Z_LAB_DRAFTERS = {
    "z-lab/Qwen3.5-4B-DFlash": "Qwen/Qwen3.5-4B",
    "z-lab/Qwen3.5-9B-DFlash": "Qwen/Qwen3.5-9B",
    "z-lab/Qwen3.5-27B-DFlash": "Qwen/Qwen3.5-27B",
    "z-lab/Qwen3.5-35B-A3B-DFlash": "Qwen/Qwen3.5-35B-A3B",
    "z-lab/Qwen3.5-122B-A10B-DFlash": "Qwen/Qwen3.5-122B-A10B",
    "z-lab/Qwen3.6-27B-DFlash": "Qwen/Qwen3.6-27B",
    "z-lab/Qwen3.6-35B-A3B-DFlash": "Qwen/Qwen3.6-35B-A3B",
    "z-lab/Qwen3-Coder-30B-A3B-DFlash": "Qwen/Qwen3-Coder-30B-A3B-Instruct",
    "z-lab/Qwen3-Coder-Next-DFlash": "Qwen/Qwen3-Coder-Next",
    "z-lab/gpt-oss-20b-DFlash": "openai/gpt-oss-20b",
    "z-lab/gpt-oss-120b-DFlash": "openai/gpt-oss-120b",
    "z-lab/Kimi-K2.5-DFlash": "moonshotai/Kimi-K2.5",
    "z-lab/Qwen3-4B-DFlash-b16": "Qwen/Qwen3-4B",
    "z-lab/Qwen3-8B-DFlash-b16": "Qwen/Qwen3-8B",
    "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat": "meta-llama/Llama-3.1-8B-Instruct",
}


def test_the_registry_lists_every_z_lab_drafter_with_its_target_memory_and_thinking():
    registry = load_registry()
    listed = {(p.drafter.location, p.target.location) for p in registry.pairs.values() if p.drafter.kind == "hub"}
    assert set(Z_LAB_DRAFTERS.items()) <= listed
    for pair in registry.pairs.values():
        if pair.needs_cuda:
            assert pair.gpu_memory_gb and pair.gpu_memory_gb > 0, pair.name
            assert pair.dtype == "bfloat16"
    for name in ("qwen3-4b", "qwen3-8b", "qwen3-8b-4bit"):
        assert registry.get(name).enable_thinking is False  # z-lab's b16 drafters: trained without thinking
    assert registry.get("qwen35-27b").enable_thinking is True
    assert registry.get("smollm2-135m").enable_thinking is None  # SmolLM2's template has no switch
    assert registry.get("qwen3-8b-4bit").gpu_memory_gb < registry.get("qwen3-8b").gpu_memory_gb
    # Pairs that outgrow one 141 GB GPU spread the target over every GPU.
    for name in ("qwen35-122b-a10b", "gpt-oss-120b", "qwen3-coder-next", "kimi-k25"):
        assert registry.get(name).target_device == "auto" and registry.get(name).gpu_memory_gb > 140


OTHER_PAIR = """
[pairs.q]
target = { hub = "org/model" }
drafter = { path = "drafter" }
"""


def test_otherwise_names_another_pair_one_step_away(tmp_path):
    file = tmp_path / "models.toml"
    file.write_text(GOOD_PAIR + 'weights = "w4a8"\notherwise = "q"\n' + OTHER_PAIR)
    registry = load_registry(file)
    assert registry.get("p").otherwise == registry.get("q") and registry.get("q").otherwise is None
    for text, message in ((GOOD_PAIR + 'otherwise = "nope"\n' + OTHER_PAIR, "otherwise = 'nope' is not the name of "
                                                                             "another pair: q"),
                          (GOOD_PAIR + 'otherwise = "p"\n' + OTHER_PAIR, "otherwise = 'p' is not the name"),
                          (GOOD_PAIR + 'otherwise = "q"\n' + OTHER_PAIR + 'otherwise = "p"\n',
                           "names a pair that has an 'otherwise' of its own")):
        file.write_text(text)
        with pytest.raises(RegistryError, match=message):
            load_registry(file)


def test_a_pair_whose_kernels_cannot_run_here_loads_its_otherwise_and_says_why(monkeypatch):
    from dflash_core import int8_rows, loading

    registry = load_registry()
    monkeypatch.setattr(int8_rows, "refusal", lambda: "this CPU has no AVX512-VNNI")
    said = []
    loaded = loading.load_pair(registry.get("smollm2-135m-w4a8"), said.append)
    assert loaded.pair.name == "smollm2-135m" and loaded.target.runner.weight_format == "bf16"
    assert said[0] == ("smollm2-135m-w4a8: this CPU has no AVX512-VNNI, which its weights (w4a8) need; loading "
                       "smollm2-135m instead (its 'otherwise')")
    assert loading.kernels_refusal(registry.get("smollm2-135m")) is None  # bf16: no kernels of its own


@pytest.mark.parametrize("text, message", [
    (GOOD_PAIR + "gpu_memory_gb = 0\n", "gpu_memory_gb = 0; expected a number of GiB > 0"),
    (GOOD_PAIR + "gpu_memory_gb = 'lots'\n", "gpu_memory_gb = 'lots'"),
    (GOOD_PAIR + "enable_thinking = 1\n", "enable_thinking = 1; expected true or false"),
    (GOOD_PAIR + "lookup_answers = 3\n", "lookup_answers = 3; expected a directory of answer shards"),
    (GOOD_PAIR + "thinking = true\n", r"unknown key\(s\) \['thinking'\]"),
])
def test_new_keys_are_checked_and_unknown_keys_stay_errors(tmp_path, text, message):
    file = tmp_path / "models.toml"
    file.write_text(text)
    with pytest.raises(RegistryError, match=message):
        load_registry(file)


def test_memory_problem_compares_the_estimate_with_the_gpus(tmp_path):
    from dflash_core.registry import memory_problem

    file = tmp_path / "models.toml"
    file.write_text(GOOD_PAIR + 'device = "cuda"\ngpu_memory_gb = 67\n'
                    '[pairs.big]\ntarget = { hub = "a/b" }\ndrafter = { path = "d" }\ndevice = "cuda"\n'
                    'target_device = "auto"\ngpu_memory_gb = 275\n'
                    '[pairs.cpu]\ntarget = { hub = "a/b" }\ndrafter = { path = "d" }\ngpu_memory_gb = 5\n')
    registry = load_registry(file)
    one, big, cpu = registry.get("p"), registry.get("big"), registry.get("cpu")
    assert memory_problem(one, [139.8]) is None
    assert memory_problem(one, [24.0]) == "needs about 67 GiB of GPU memory; its GPU here holds 24 GiB"
    assert "no CUDA GPU" in memory_problem(one, [])
    assert "needs about 275 GiB" in memory_problem(big, [139.8])
    assert memory_problem(big, [139.8, 139.8]) is None  # auto: the target spreads over both
    assert "all 2 GPUs hold 80 GiB" in memory_problem(one, [40.0, 40.0])
    assert memory_problem(cpu, []) is None  # a CPU pair needs no GPU


def test_pairs_says_what_a_gpu_pair_would_need(capsys):
    import json

    from dflash_core import cli
    from dflash_core.registry import local_gpu_memory_gb

    assert cli.main(["pairs", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["pairs"]}
    assert rows["kimi-k25"]["gpu_memory_gb"] > 2000 and not rows["kimi-k25"]["runnable"]
    assert rows["qwen3-8b"]["enable_thinking"] is False
    if not local_gpu_memory_gb():
        assert "needs CUDA" in rows["qwen35-27b"]["reason"] and "about 67 GiB" in rows["qwen35-27b"]["reason"]
    assert rows["smollm2-135m"]["runnable"]


def test_an_installed_package_ships_the_registry_and_a_checkout_reads_its_own(tmp_path):
    """A non-editable install has no project root: the build copies models.toml into the package
    (setup.py), and load_registry() finds it there through importlib.resources."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dflash_core.registry import default_registry_path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_MODELS_TOML"}
    # A checkout has no packaged copy: it reads the root file, the one users edit (checked below).
    assert not (root / "dflash_core" / "models.toml").exists()
    # Build the package as pip would (build_py is the step that lays out the installed files).
    built = tmp_path / "site"
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(built)], cwd=root, env=env,
                   check=True, capture_output=True)
    assert (built / "dflash_core" / "models.toml").read_bytes() == (root / "models.toml").read_bytes()
    # Import the built package from elsewhere, with no checkout on the path.
    probe = ("import json, dflash_core, dflash_core.registry as r; reg = r.load_registry(); "
             "print(json.dumps([dflash_core.__file__, str(reg.path), reg.default, sorted(reg.pairs)]))")
    out = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path[:0] = {[str(built)] + _site_paths()!r}; {probe}"],
                         cwd=tmp_path, env=env, check=True, capture_output=True, text=True).stdout
    module_file, path, default, pairs = json.loads(out)
    assert module_file.startswith(str(built)) and path == str(built / "dflash_core" / "models.toml")
    assert (default, pairs) == (load_registry(root / "models.toml").default, sorted(load_registry(root / "models.toml").pairs))
    if "DFLASH_MODELS_TOML" not in os.environ:
        assert default_registry_path() == root / "models.toml"


def _site_paths() -> list[str]:
    """The interpreter's third-party package folders (torch etc.) without the checkout, which an
    editable install puts on the path through a .pth file."""
    import site
    import sys

    return [p for p in sys.path if p.endswith("site-packages")] + site.getsitepackages()


def test_dtype_auto_is_resolved_for_this_machine_and_the_loaded_pair_names_it(smollm2_engine):
    """The CPU pairs ask for "auto": bfloat16 where oneDNN has a bf16 path here, else float32
    (an AVX2 CPU's bf16 matrices cost several times fp32's); the loaded pair reports which."""
    from dflash_core.kernels import native_bf16
    from dflash_core.loading import resolve_dtype

    assert load_registry().get("smollm2-135m").dtype == "auto"
    expected = "bfloat16" if native_bf16() else "float32"
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("float16", "cpu") == "float16" and resolve_dtype("bfloat16", "cuda") == "bfloat16"
    assert smollm2_engine.pair.dtype == expected
    assert str(smollm2_engine.target.runner.dtype) == f"torch.{expected}"
    assert smollm2_engine.describe()["dtype"] == expected
