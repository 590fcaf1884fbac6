"""The exactness tests as on CPUs with fewer instructions than this one (dflash_core.isa_emulation):
an AMX Xeon runs them as an AVX-512 EPYC and as an AVX2 one would, so a kernel path that breaks
losslessness on another CPU fails here, not on a newcomer's machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_core import aoti_kernels, isa_emulation

ROOT = Path(__file__).resolve().parent.parent
# Every test whose kernels or rounding depend on the instruction set: the probes, the compiled
# layers, attention and drafter, the packed matrices, and greedy lossless decoding of chains and
# trees on every family (the fallbacks after a failed build depend on none: left out).
EXACTNESS_TESTS = ("tests/test_aoti_layers.py", "tests/test_aoti_attention.py", "tests/test_aoti_drafter.py",
                   "tests/test_aoti_kernels.py", "tests/test_kernels.py", "tests/test_tree.py",
                   "tests/test_speculative.py")


def test_only_known_sets_are_emulated_and_below_this_cpu(monkeypatch):
    with pytest.raises(ValueError, match="unknown instruction set 'sse2'"):
        isa_emulation.environment("sse2")
    import torch

    # Every CPU with AVX-512 can run as an AVX2 one; only an AVX2 CPU (or less) has nothing below it.
    assert ("avx2" in isa_emulation.emulable()) == (torch.backends.cpu.get_cpu_capability() == "AVX512")
    monkeypatch.setenv(isa_emulation.VARIABLE, "avx2")
    assert isa_emulation.emulable() == []  # an emulated CPU hides the real one


def test_kernels_built_for_an_emulated_cpu_are_cached_apart_from_this_cpus(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv(isa_emulation.VARIABLE, raising=False)
    native = aoti_kernels._machine()
    for name, value in isa_emulation.environment("avx2").items():
        monkeypatch.setenv(name, value)
    assert aoti_kernels._machine() != native


def test_the_cli_runs_as_the_cpu_its_environment_names_and_refuses_one_it_cannot():
    import torch

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("a CPU without AVX2 cannot run as one that has it")
    printed = subprocess.run([sys.executable, "-m", "dflash_core.isa_emulation", "avx2"], capture_output=True, text=True,
                             check=True).stdout.split()
    env = {**os.environ, **dict(assignment.split("=", 1) for assignment in printed)}
    result = subprocess.run([sys.executable, "-m", "dflash_core", "pairs"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "running as a CPU with avx2 only" in result.stderr
    env[isa_emulation.VARIABLE] = "avx512-no-amx"  # but PyTorch was told avx2: the check refuses
    result = subprocess.run([sys.executable, "-m", "dflash_core", "pairs"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "emulating avx512-no-amx: PyTorch runs AVX2" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("isa", list(isa_emulation.ISAS))
def test_the_exactness_tests_pass_as_on_a_cpu_with_fewer_instructions(isa, tmp_path):
    if isa not in isa_emulation.emulable():
        pytest.skip(f"this CPU cannot run as {isa} (only as instruction sets below its own)")
    env = {**os.environ, **isa_emulation.environment(isa), "DFLASH_CACHE_DIR": str(tmp_path / "cache")}
    for name in [n for n in env if n.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))]:
        env.pop(name)  # the inner run is a plain pytest, on this worker's share of the cores
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not failed",
         "--basetemp", str(tmp_path / "inner"), *EXACTNESS_TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and " failed" not in result.stdout, tail
    if aoti_kernels.available():  # the inner run built its kernels for the emulated CPU: none uses AMX
        built = list(tmp_path.rglob("*.so"))
        assert built, tail
        assert not [p.name for p in built if b"ldtilecfg" in _disassembly(p)]


def _disassembly(library: Path) -> bytes:
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, check=True).stdout
