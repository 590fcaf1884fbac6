"""The bench command: interleaved methods, results.json with the required keys, an HTML report."""

from __future__ import annotations

import json

import pytest

from dflash_core import cli

pytestmark = pytest.mark.slow


def test_bench_writes_results_and_report(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Say hello.", "Count to three.", "Name a fruit.")))
    out = tmp_path / "bench"
    code = cli.main(["bench", "--pair", "smollm2-135m-random", "--prompts", str(prompts), "--limit", "2",
                     "--max-new-tokens", "12", "--block-size", "4", "--out", str(out),  # 4: cheaper verifies, same checks
                     "--methods", "dflash,ar,hf_generate,prompt_lookup,dflash_adaptive,dflash_tree,dflash_tree_adaptive,"
                     "dflash_lookup,dflash_tree_lookup_adaptive"])
    assert code == 0, capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    summary = data["summary"]
    for key in ("tau", "speedup_vs_ar", "speedup_vs_hf_generate", "speedup_vs_prompt_lookup", "lossless",
                "acceptance_histogram", "mean_draft_ms", "mean_verify_ms", "tokens_per_s", "tau_adaptive",
                "tau_tree", "speedup_dflash_tree_vs_ar", "tau_tree_adaptive", "speedup_dflash_tree_adaptive_vs_ar",
                "tau_lookup", "speedup_dflash_lookup_vs_ar", "tau_tree_lookup_adaptive", "fastest_variant",
                "fastest_variant_vs_ar", "fastest_variant_vs_hf_generate", "fastest_variant_vs_prompt_lookup"):
        assert key in summary, key
    fastest = summary["fastest_variant"]
    assert summary["tokens_per_s"][fastest] == max(v for m, v in summary["tokens_per_s"].items() if m.startswith("dflash"))
    assert summary["fastest_variant_vs_ar"] == pytest.approx(summary["tokens_per_s"][fastest] / summary["tokens_per_s"]["ar"], rel=1e-3)
    assert summary["lossless"] is True
    assert len(data["prompts"]) == 2
    assert all(p["dflash_equals_ar"] for p in data["prompts"])
    assert set(data["prompts"][0]["methods"]) == {"dflash", "ar", "hf_generate", "prompt_lookup", "dflash_adaptive",
                                                  "dflash_tree", "dflash_tree_adaptive", "dflash_lookup",
                                                  "dflash_tree_lookup_adaptive"}
    assert "plotly" in (out / "report.html").read_text()
    assert "speedup vs AR" in (out / "summary.md").read_text()

    # bench-report turns the run into the BENCHMARKS page, figures read from results.json
    page = tmp_path / "BENCHMARKS.md"
    assert cli.main(["bench-report", str(out), "--out", str(page)]) == 0
    text = page.read_text()
    assert f"| {summary['tau']:.2f} | {summary['tokens_per_s']['ar']:.2f} | {summary['tokens_per_s']['dflash']:.2f} |" in text
    assert "(`make benchmarks` runs them all, then writes this page)" in text
    # a page of other runs names the command that makes it
    assert cli.main(["bench-report", str(out), "--out", str(page), "--made-by", "make benchmarks-bars"]) == 0
    assert "(`make benchmarks-bars` runs them all" in page.read_text()
    assert cli.main(["bench-report", str(tmp_path / "missing"), "--out", str(page)]) == 2


def test_bench_sampling_rules_side_by_side(tmp_path):
    out = tmp_path / "bench"
    code = cli.main(["bench", "--pair", "smollm2-135m-random", "--prompts", "heldout", "--limit", "1",
                     "--max-new-tokens", "8", "--temperature", "0.7", "--rules", "match,pq", "--methods", "dflash,ar",
                     "--out", str(out), "--warmup", "0"])
    assert code == 0
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert summary["lossless"] is None  # sampling: outputs differ by design; distribution tests cover it
    assert "tau_pq" in summary and summary["tau"] is not None


def test_bench_refuses_bad_prompt_files(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    assert cli.main(["bench", "--prompts", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "'prompt' field" in capsys.readouterr().err


def test_a_greedy_variant_that_differs_from_ar_is_reported_by_name():
    from dflash_core.bench.runner import MethodRun, PromptRecord, summarize
    from dflash_core.speculative import GenerationResult

    def run(name: str, tokens: list[int], seconds: float) -> MethodRun:
        return MethodRun(name, tokens, seconds, result=GenerationResult(tokens, "length"))

    def record(index: int, tree_tokens: list[int]) -> PromptRecord:
        r = PromptRecord(index, 5)
        r.runs = {"ar": run("ar", [1, 2, 3], 1.0), "dflash": run("dflash", [1, 2, 3], 0.5),
                  "dflash_tree": run("dflash_tree", tree_tokens, 0.4)}
        return r

    same = summarize([record(0, [1, 2, 3]), record(1, [1, 2, 3])], block_size=16, temperature=0.0)
    assert same["lossless"] is True and same["mismatched_by_method"] == {}
    differs = summarize([record(0, [1, 2, 3]), record(1, [1, 2, 4])], block_size=16, temperature=0.0)
    assert differs["lossless"] is False
    assert differs["mismatched_prompts"] == [1] and differs["mismatched_by_method"] == {"dflash_tree": [1]}


def test_peer_summary_keys_ratios_and_where_peers_part_from_ar():
    """hf_dflash's tau comes from its own cycles; llama.cpp ratios are of decode speeds (prefill
    excluded); a peer that parts from AR is reported with the first token where it does."""
    from dflash_core.bench.runner import MethodRun, PromptRecord, summarize
    from dflash_core.speculative import GenerationResult

    r = PromptRecord(0, 5)
    r.runs = {"ar": MethodRun("ar", [1, 2, 3, 4, 5], 1.0, decode_seconds=0.8, result=GenerationResult([1, 2, 3, 4, 5], "length")),
              "dflash": MethodRun("dflash", [1, 2, 3, 4, 5], 0.5, decode_seconds=0.4, result=GenerationResult([1, 2, 3, 4, 5], "length")),
              "hf_dflash": MethodRun("hf_dflash", [1, 2, 3, 4, 5], 2.0, decode_seconds=1.6, acceptance_lengths=[1, 3]),
              "llama_cpp": MethodRun("llama_cpp", [1, 2, 9, 4, 5], 0.6, decode_seconds=0.2)}
    s = summarize([r], block_size=16, temperature=0.0)
    assert s["tau_hf_dflash"] == 2.0
    assert s["speedup_vs_hf_dflash"] == pytest.approx(4.0)
    assert s["decode_tokens_per_s"]["llama_cpp"] == pytest.approx(20.0)
    assert s["speedup_vs_llama_cpp"] == {"ar": pytest.approx(0.25), "dflash": pytest.approx(0.5), "hf_dflash": pytest.approx(0.125)}
    assert s["median_prompt_ratio_vs_llama_cpp"] == {"ar": pytest.approx(0.25), "dflash": pytest.approx(0.5),
                                                     "hf_dflash": pytest.approx(0.125)}
    assert s["fastest_variant"] == "dflash" and s["fastest_variant_vs_llama_cpp"] == pytest.approx(0.5)
    assert s["llama_cpp_differs_from_ar"] == {0: 2} and s["llama_cpp_compared_prompts"] == 1
    assert s["hf_dflash_differs_from_ar"] == {}
    assert s["lossless"] is True  # peers are not our variants: their differences are reported, not failures


def test_a_prompt_that_stalled_moves_the_median_ratio_to_llama_cpp_little():
    """On a shared machine one prompt can lose seconds to another tenant: the totals' ratio moves
    with it, the median over prompts of the per-prompt ratios hardly does."""
    from dflash_core.bench.runner import MethodRun, PromptRecord, summarize

    records = []
    for index, llama_decode in enumerate([0.5, 0.5, 10.0]):  # the third prompt's llama.cpp stalled
        r = PromptRecord(index, 5)
        r.runs = {"ar": MethodRun("ar", [1] * 11, 1.2, decode_seconds=1.0),
                  "llama_cpp": MethodRun("llama_cpp", [1] * 11, llama_decode + 0.1, decode_seconds=llama_decode)}
        records.append(r)
    s = summarize(records, block_size=16, temperature=0.0)
    assert s["speedup_vs_llama_cpp"]["ar"] == pytest.approx(11.0 / 3.0, abs=1e-4)  # 30 tokens in 3 s against 30 in 11 s
    assert s["median_prompt_ratio_vs_llama_cpp"] == {"ar": pytest.approx(0.5)}
    from dflash_core.bench.report import _peer_lines

    assert "| ar | 10.0 | 3.6667 | 0.5 |" in _peer_lines(s)


def test_llama_cpp_method_without_llama_cpp_python_names_the_make_target(monkeypatch):
    import sys

    from dflash_core.bench.llama_cpp_peer import LlamaCppPeer, PeerUnavailableError
    from dflash_core.errors import DFlashError

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what an environment without the extra sees
    with pytest.raises(PeerUnavailableError, match=r"make peers.*pip install -e '\.\[peers\]'") as info:
        LlamaCppPeer("model.gguf", threads=1)
    assert isinstance(info.value, DFlashError)


def test_partings_name_the_token_and_both_numerics_margins(smollm2_engine):
    """A peer that parts from AR is explained at the first differing token: both numerics score
    the AR token far above an unlikely one; a peer that only stops early has no margin to give;
    an equal peer is not listed."""
    from dflash_core.bench.partings import partings
    from dflash_core.bench.runner import MethodRun, PromptRecord
    from dflash_core.request import Request
    from dflash_core.speculative import collect

    engine = smollm2_engine
    resolved = engine.resolve(Request(prompt="Name a fruit.", max_new_tokens=6, block_size=1))
    ar = collect(engine.stream_ids(resolved.prompt_ids, resolved.config)).token_ids
    unlikely = 7  # an unused special token, never the argmax
    record = PromptRecord(0, len(resolved.prompt_ids), prompt_ids=list(resolved.prompt_ids))
    record.runs = {"ar": MethodRun("ar", ar, 1.0), "hf_dflash": MethodRun("hf_dflash", ar[:3] + [unlikely] + ar[4:], 1.0),
                   "llama_cpp": MethodRun("llama_cpp", ar[:4], 1.0), "hf_generate": MethodRun("hf_generate", list(ar), 1.0)}
    found = partings(engine, [record])
    parted = found["hf_dflash_vs_ar"][0]
    assert parted["at"] == 3 and parted["reference_token"] == ar[3] and parted["peer_token"] == unlikely
    assert parted["margins"]["ours"] > 5 and parted["margins"]["transformers"] > 5
    assert found["llama_cpp_vs_ar"] == {0: {"at": 4, "margins": None}}
    assert found["hf_generate_vs_ar"] == {} and found["hf_dflash_vs_hf_generate"][0]["at"] == 3


def test_tau_on_shared_text_counts_only_the_prompts_where_transformers_text_equals_ours():
    from dflash_core.bench.runner import MethodRun, PromptRecord, summarize
    from dflash_core.speculative import CycleEvent, GenerationResult

    def cycle(index: int, accepted: int) -> CycleEvent:
        return CycleEvent(index, index, [9] * 3, [1.0] * 3, [9] * 4, accepted, 9, [9] * (accepted + 1), 0.0, 0.0, 0)

    def record(index: int, hf_tokens: list[int], hf_lengths: list[int]) -> PromptRecord:
        ours = GenerationResult([1, 2, 3, 4, 5], "length", [cycle(0, 0), cycle(1, 2), cycle(2, 0)])
        r = PromptRecord(index, 5)
        r.runs = {"dflash": MethodRun("dflash", [1, 2, 3, 4, 5], 1.0, result=ours),
                  "hf_dflash": MethodRun("hf_dflash", hf_tokens, 1.0, acceptance_lengths=hf_lengths)}
        return r

    s = summarize([record(0, [1, 2, 3, 4, 5], [3, 2]), record(1, [1, 2, 8, 4, 5], [1, 1, 1])], block_size=4, temperature=0.0)
    assert s["tau_on_shared_text"] == {"prompts": [0], "ours": 2.0, "hf_dflash": 2.5}
    assert summarize([record(1, [1, 2, 8], [1])], block_size=4, temperature=0.0)["tau_on_shared_text"] is None


def test_the_report_lists_each_parting_with_its_margins():
    from dflash_core.bench.report import _peer_lines

    summary = {"partings": {"hf_dflash_vs_ar": {"3": {"at": 0, "reference_token": 11, "peer_token": 12,
                                                      "margins": {"ours": 0.125, "transformers": -0.0625}}},
                            "llama_cpp_vs_ar": {"1": {"at": 40, "margins": None}}, "hf_generate_vs_ar": {}}}
    text = "\n".join(_peer_lines(summary))
    assert "hf_dflash vs ar: 1, llama_cpp vs ar: 1, hf_generate vs ar: 0" in text
    assert "| hf_dflash vs ar | 3 | 0 | 11 / 12 | 0.125 | -0.0625 |" in text
    assert "| llama_cpp vs ar | 1 | 40 | one text ends first | – | – |" in text


def test_full_vocab_drafts_turns_the_draft_vocabulary_off_and_the_settings_say_so(tmp_path):
    """The bundled drafter drafts over its 8,192-token draft vocabulary; transformers' assistant
    cannot, so the hf_dflash comparison on equal terms turns ours off too."""
    settings = {}
    for flag in ([], ["--full-vocab-drafts"]):
        out = tmp_path / ("full" if flag else "reduced")
        assert cli.main(["bench", "--prompts", "heldout", "--limit", "1", "--max-new-tokens", "6", "--warmup", "0",
                         "--methods", "dflash,ar", "--out", str(out), *flag]) == 0
        data = json.loads((out / "results.json").read_text())
        settings[bool(flag)] = data["settings"]["draft_vocab"]
        assert data["summary"]["lossless"] is True
    assert settings == {False: 8192, True: None}


def test_the_benchmarks_page_names_the_pair_of_a_run_on_another_pair():
    """docs/BENCHMARKS.md holds the default pair's runs and issue 18's run on the int8 pair: the
    latter's title says so, the others' stay as they were."""
    from dflash_core.bench.report import benchmarks_markdown

    def run(pair: str) -> dict:
        settings = {"prompts": "humaneval", "limit": 20, "offset": 0, "block_size": 16, "temperature": 0.0, "rules": ["match"],
                    "max_new_tokens": 256, "pair": pair, "command": "python -m dflash_core bench", "dtype": "float32",
                    "runner": "fast", "threads": 2, "warmup": True}
        return {"settings": settings, "summary": {"tokens_per_s": {"ar": 1.0}, "decode_tokens_per_s": {"ar": 1.0}}}

    page = benchmarks_markdown([run("smollm2-135m"), run("smollm2-135m-int8")])
    assert "## humaneval (20 prompts), block 16, greedy, 256 new tokens\n" in page
    assert "## humaneval (20 prompts), block 16, greedy, 256 new tokens, pair smollm2-135m-int8\n" in page
