"""Adaptive verification's costs cached on disk (dflash_core/calibration.py): measured once per
machine and pair, reused after a spot check, measured again when the spot check fails."""

from __future__ import annotations

import json

import pytest

from dflash_core.testing import tiny_target
from dflash_core import calibration
from dflash_core.target import FastTarget


@pytest.fixture()
def runner(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_checked", set())
    return FastTarget(tiny_target("llama"))


def test_costs_are_measured_once_then_reused_after_a_spot_check(runner, monkeypatch):
    key = calibration.machine_key(runner, "tiny", 16)
    measured = []

    def measure(values):
        measured.append(values)
        return values

    assert calibration.cached_costs(key, "verify", runner, lambda: measure([1.0, 2.0])) == [1.0, 2.0]
    assert calibration.cached_costs(key, "tree", runner, lambda: measure([0.5, 0.25])) == [0.5, 0.25]
    assert json.loads(calibration.cache_file().read_text())[key] == {"verify": [1.0, 2.0], "tree": [0.5, 0.25]}
    # A new process: the entry is spot-checked once, then used without measuring.
    checks = []
    monkeypatch.setattr(calibration, "_checked", set())
    monkeypatch.setattr(calibration, "spot_check", lambda target, costs: checks.append(costs) or True)
    assert calibration.cached_costs(key, "verify", runner, lambda: measure([9.0])) == [1.0, 2.0]
    assert calibration.cached_costs(key, "tree", runner, lambda: measure([9.0])) == [0.5, 0.25]
    assert checks == [[1.0, 2.0]] and len(measured) == 2
    # The machine changed (the spot check fails): measured again, and the old tree figures go.
    monkeypatch.setattr(calibration, "_checked", set())
    monkeypatch.setattr(calibration, "spot_check", lambda target, costs: False)
    assert calibration.cached_costs(key, "verify", runner, lambda: measure([3.0, 4.0])) == [3.0, 4.0]
    assert json.loads(calibration.cache_file().read_text())[key] == {"verify": [3.0, 4.0]}
    # Another pair, block size or runner is another entry.
    assert calibration.machine_key(runner, "tiny", 8) != key != calibration.machine_key(runner, "other", 16)
    # So are other kernels, and whole compiled layers on them.
    runner.kernels = "aoti"
    matrices = calibration.machine_key(runner, "tiny", 16)
    runner.compiled_layers = True
    assert len({key, matrices, calibration.machine_key(runner, "tiny", 16)}) == 3


def test_the_spot_check_measures_the_runner(runner):
    from dflash_core.speculative import measure_verify_costs

    costs = measure_verify_costs(runner, 16, context=32, repeats=2)
    assert len(costs) == 16 and all(c > 0 for c in costs)
    # Figures a thousand times off are what no noise explains: the spot check refuses them.
    assert not calibration.spot_check(runner, [c * 1000 for c in costs])
    assert not calibration.spot_check(runner, [c / 1000 for c in costs])


def test_an_unreadable_cache_is_measured_around(runner):
    calibration.cache_file().write_text("{not json")
    key = calibration.machine_key(runner, "tiny", 16)
    assert calibration.cached_costs(key, "verify", runner, lambda: [1.0]) == [1.0]
    assert json.loads(calibration.cache_file().read_text()) == {key: {"verify": [1.0]}}


def test_a_rebuilt_kernel_library_is_another_key(runner, monkeypatch):
    """Pairs on the project's own C++ kernels key their costs by the kernels' build: a changed
    kernel is measured anew, whatever the spot check's two passes say."""
    from dflash_core import int8_dot

    assert "csrc=" not in calibration.machine_key(runner, "p", 16)  # bf16 on oneDNN: none of ours
    monkeypatch.setattr(runner, "weight_format", "w4a8", raising=False)
    before = calibration.machine_key(runner, "p", 16)
    assert "csrc=" in before
    monkeypatch.setattr(int8_dot, "build_digest", lambda source: "changed")
    assert calibration.machine_key(runner, "p", 16) != before
