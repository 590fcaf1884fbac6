"""The llama_cpp bench peer on the real GGUF (runs where `make peers` installed llama-cpp-python)."""

from __future__ import annotations

import json

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (`make peers` installs it)")

from dflash_core import cli  # noqa: E402
from dflash_core.bench.llama_cpp_peer import LlamaCppPeer  # noqa: E402
from dflash_core.loading import resolve_gguf  # noqa: E402
from dflash_core.messages import encode_messages  # noqa: E402
from dflash_core.registry import load_registry  # noqa: E402

pytestmark = pytest.mark.slow

PAIR = "smollm2-135m-random"


@pytest.fixture(scope="module")
def peer() -> LlamaCppPeer:
    return LlamaCppPeer(resolve_gguf(load_registry().get(PAIR).target), threads=2, n_ctx=512)


def test_the_prompt_tokens_are_the_same_as_llama_cpp_would_build_from_the_gguf_template(smollm2_engine, peer):
    """Our chat template + tokenizer and llama.cpp's (the GGUF's own template, rendered as
    llama-cpp-python's chat handler does, tokenized by llama.cpp) give the same ids."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    meta = peer.llm.metadata
    formatter = Jinja2ChatFormatter(template=meta["tokenizer.chat_template"], eos_token="<|im_end|>",
                                    bos_token="<|im_start|>", add_generation_prompt=True)
    for messages in ([{"role": "user", "content": "Write a Python function that reverses a list."}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three fruits!"}]):
        text = formatter(messages=messages).prompt
        assert peer.tokenize_templated(text) == encode_messages(smollm2_engine.tokenizer, messages)


def test_greedy_and_capped(smollm2_engine, peer):
    ids = encode_messages(smollm2_engine.tokenizer, [{"role": "user", "content": "Count from one to twenty."}])
    first, again = peer.generate(ids, 12, smollm2_engine.stop_ids), peer.generate(ids, 12, smollm2_engine.stop_ids)
    assert first.token_ids == again.token_ids and len(first.token_ids) == 12  # deterministic, never over budget
    assert 0 < first.decode_seconds < first.seconds  # prefill excluded from the decode time


def test_bench_llama_cpp_beside_ours(tmp_path):
    out = tmp_path / "bench"
    code = cli.main(["bench", "--pair", PAIR, "--prompts", "humaneval", "--limit", "1", "--max-new-tokens", "8",
                     "--methods", "ar,dflash,llama_cpp", "--warmup", "0", "--out", str(out)])
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    summary = data["summary"]
    assert set(summary["speedup_vs_llama_cpp"]) == {"ar", "dflash"}
    assert summary["speedup_vs_llama_cpp"]["ar"] == pytest.approx(
        summary["decode_tokens_per_s"]["ar"] / summary["decode_tokens_per_s"]["llama_cpp"], rel=1e-3)
    assert summary["fastest_variant_vs_llama_cpp"] is not None
    assert summary["llama_cpp_compared_prompts"] == 1 and isinstance(summary["llama_cpp_differs_from_ar"], dict)
    assert data["settings"]["llama_cpp_python"] == llama_cpp.__version__
    assert 0 < data["prompts"][0]["methods"]["llama_cpp"]["tokens"] <= 8
    assert "llama.cpp" in (out / "summary.md").read_text()
