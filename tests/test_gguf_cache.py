"""The converted-GGUF cache when two processes convert the same file at once (a studio and a
CLI, or two test workers, on a fresh machine)."""

from __future__ import annotations

import pytest

from dflash_core import loading
from dflash_core.registry import load_registry


@pytest.mark.slow
def test_a_conversion_another_process_finished_meanwhile_is_kept_and_ours_is_cleaned_away(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    gguf = loading.resolve_gguf(load_registry().get("smollm2-135m").target)
    out = loading._gguf_cache_dir(gguf)

    def rival_finishes(message: str) -> None:  # said as our conversion begins
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_text("the rival's, perhaps being read")

    assert loading.converted_gguf_dir(gguf, rival_finishes) == out
    assert (out / "model.safetensors").read_text() == "the rival's, perhaps being read"
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no half-copy left behind
