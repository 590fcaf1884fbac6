"""Run the exactness tests in a subprocess as a CPU with fewer instructions than this one would
(dflash_core.isa_emulation), for the test_as_<set>.py files: one file per set, so that the
suite's workers run them side by side."""

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
                   "tests/test_speculative.py", "tests/test_weight_formats.py", "tests/test_int8_dot.py",
                   "tests/test_q4_dot.py", "tests/test_q4_layers.py", "tests/test_int8_rows.py",
                   "tests/test_dot_attention.py")


def exactness_tests_pass_as(isa: str, tmp_path: Path) -> None:
    """The exactness tests pass as ``isa``'s CPU, and no kernel they built uses AMX."""
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
