"""scripts/compare_fits.py: which committed answers its feature cache takes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dflash_core.training.selfdistill import Sample

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "compare_fits.py"
_spec = importlib.util.spec_from_file_location("compare_fits", SCRIPT)
compare_fits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_fits)


def _samples() -> list[Sample]:
    kept = {"file": "shard-00001.npz.features.bin", "row": 0, "layers": [1]}
    return [Sample(f"a{i}", [1] * 3, [2] * 5, True, kept if i % 2 else None) for i in range(6)]


def test_only_answers_with_kept_features_unless_the_target_runs():
    samples = _samples()
    assert [s.id for s in compare_fits.pick_samples(samples, None, target_pass=False)] == ["a1", "a3", "a5"]
    assert compare_fits.pick_samples(samples, None, target_pass=True) == samples


def test_the_cap_stops_before_the_answer_that_would_pass_it():
    samples = _samples()  # 8 tokens each, prompts included
    assert [s.id for s in compare_fits.pick_samples(samples, 24, target_pass=True)] == ["a0", "a1", "a2"]
    assert [s.id for s in compare_fits.pick_samples(samples, 23, target_pass=True)] == ["a0", "a1"]
    assert [s.id for s in compare_fits.pick_samples(samples, 16, target_pass=False)] == ["a1", "a3"]
    assert compare_fits.pick_samples(samples, 7, target_pass=True) == []
