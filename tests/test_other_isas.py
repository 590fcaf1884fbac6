"""Running as a CPU with fewer instructions than this one (dflash_core.isa_emulation): which sets,
the kernel cache kept apart, the CLI's check. The exactness tests themselves run that way in
test_as_<set>.py (an AMX Xeon runs them as an AVX-512 EPYC and as an AVX2 one would), so a kernel
path that breaks losslessness on another CPU fails here, not on a newcomer's machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_core import aoti_kernels, isa_emulation

ROOT = Path(__file__).resolve().parent.parent


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


def test_every_set_below_some_cpu_has_its_exactness_run_in_a_file_of_its_own():
    # One file per set, so that pytest-xdist (--dist loadfile) runs them in parallel.
    files = {p.stem for p in Path(__file__).parent.glob("test_as_*.py")}
    assert files == {"test_as_" + isa.replace("-", "_") for isa in isa_emulation.ISAS}
