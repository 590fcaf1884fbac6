"""Committed answer shards: format, cursor, resumption, refusals, and training from them alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash_core.drafter import DFlashDrafter
from dflash_core.training.errors import TrainingError
from dflash_core.training.features import FeatureStore
from dflash_core.training.gen_data import GenDataOptions, generate_shards
from dflash_core.training.prompt_sources import Prompt, split, write_prompts
from dflash_core.training.recipe import RecipeOptions, run_recipe
from dflash_core.training.selfdistill import chat_ids
from dflash_core.training.shards import (DataDir, ShardContent, read_samples, read_shard, select_shards,
                                          spread_selection, write_shard)
from dflash_core.training.trainer import TrainSettings


def _prompts(n: int, start: int = 0) -> list[Prompt]:
    return [Prompt(f"q{i}", f"test/{i % 3}", [{"role": "user", "content": f"Question {i}: what is {i} times {i}?"}])
            for i in range(start, start + n)]


def _options(tmp_path, **kw) -> GenDataOptions:
    base = dict(prompts_file=tmp_path / "prompts.jsonl", data_dir=tmp_path / "data", shard_prompts=4, slots=3,
                max_new_tokens=10)
    base.update(kw)
    return GenDataOptions(**base)


@pytest.mark.parametrize("vocab", [49152, 100_000])
def test_a_shard_round_trips_token_ids_exactly(tmp_path, vocab):
    big = vocab - 1
    content = ShardContent(ids=["a", "b"], prompt_ids=[[1, 2, 3], [big]], answer_ids=[[4, big, 0], []],
                           finished=[True, False], skipped=["c"], meta={"k": 1})
    write_shard(tmp_path / "s.npz", content, vocab)
    back = read_shard(tmp_path / "s.npz")
    assert back == content
    with np.load(tmp_path / "s.npz") as z:
        assert z["answer_ids"].dtype == (np.uint16 if vocab <= 65536 else np.int32)


def test_gen_data_appends_contiguous_shards_and_never_answers_twice(tiny_chat_target, tmp_path):
    prompts = _prompts(14)
    write_prompts(prompts, tmp_path / "prompts.jsonl")
    order = [p.id for p in split(prompts)[0]]
    first = generate_shards(tiny_chat_target, _options(tmp_path, max_answer_tokens=1))
    # A token budget of 1 stops new prompts once the first answer is in: that answer's shard holds
    # the prompts already started (the slots), no more.
    data = DataDir(tmp_path / "data")
    assert first["new_shards"] == ["shard-00000.npz"] and 1 <= data.cursor <= 3
    second = generate_shards(tiny_chat_target, _options(tmp_path))
    data = DataDir(tmp_path / "data")
    assert second["exhausted"] and data.cursor == len(order)
    # Shards tile the prompt order: each starts where the last ended, every prompt answered once.
    assert [s["first"] for s in data.shards] == [0] + [s["next"] for s in data.shards[:-1]]
    samples = read_samples(tmp_path / "data")
    assert [s.id for s in samples] == order
    assert data.manifest["totals"]["answer_tokens"] == sum(len(s.response_ids) for s in samples)
    meta = read_shard(tmp_path / "data" / "shard-00001.npz").meta
    assert meta["first"] == data.shards[1]["first"] and meta["machine"] and meta["wall_s"] >= 0
    assert meta["max_new_tokens"] == 10 and meta["device"] == "cpu"
    # The answers are the target's greedy answers (fp32: token for token what generate() gives).
    tok, model = tiny_chat_target.tokenizer, tiny_chat_target.model
    sample = samples[2]
    assert sample.prompt_ids == chat_ids(tok, prompts[[p.id for p in prompts].index(sample.id)].messages)
    out = model.generate(torch.tensor([sample.prompt_ids]), max_new_tokens=10, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert out[0, len(sample.prompt_ids):].tolist()[: len(sample.response_ids)] == sample.response_ids
    # Nothing left: a further run adds nothing.
    assert generate_shards(tiny_chat_target, _options(tmp_path))["new_shards"] == []
    # Appending prompts to the file continues after the cursor.
    write_prompts(prompts + _prompts(5, start=100), tmp_path / "prompts.jsonl")
    more = generate_shards(tiny_chat_target, _options(tmp_path))
    assert more["new_shards"] and {s.id for s in read_samples(tmp_path / "data")} >= {f"q{i}" for i in range(100, 105)} - {
        p.id for p in split(_prompts(5, start=100))[1]}


def test_a_killed_run_loses_only_the_shard_in_progress(tiny_chat_target, tmp_path, monkeypatch):
    write_prompts(_prompts(12), tmp_path / "prompts.jsonl")
    reference = generate_shards(tiny_chat_target, _options(tmp_path, data_dir=tmp_path / "reference"))
    calls = {"n": 0}
    original = DataDir.add_shard

    def killed_on_the_second(self, entry, order):
        calls["n"] += 1
        if calls["n"] == 2:  # the second shard is on disk, its manifest entry not yet
            raise KeyboardInterrupt
        original(self, entry, order)

    monkeypatch.setattr(DataDir, "add_shard", killed_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        generate_shards(tiny_chat_target, _options(tmp_path))
    monkeypatch.setattr(DataDir, "add_shard", original)
    assert len(DataDir(tmp_path / "data").shards) == 1
    generate_shards(tiny_chat_target, _options(tmp_path))
    got = [(s.id, s.response_ids) for s in read_samples(tmp_path / "data")]
    assert got == [(s.id, s.response_ids) for s in read_samples(tmp_path / "reference")]
    assert reference["exhausted"] and not list((tmp_path / "data").glob("*.tmp"))


def test_data_from_other_settings_or_an_edited_prompt_file_is_refused(tiny_chat_target, tmp_path):
    write_prompts(_prompts(8), tmp_path / "prompts.jsonl")
    generate_shards(tiny_chat_target, _options(tmp_path, max_answer_tokens=1))
    with pytest.raises(TrainingError, match="max_new_tokens"):
        generate_shards(tiny_chat_target, _options(tmp_path, max_new_tokens=11))
    write_prompts(list(reversed(_prompts(8))), tmp_path / "prompts.jsonl")
    with pytest.raises(TrainingError, match="only grow by appending"):
        generate_shards(tiny_chat_target, _options(tmp_path))
    (tmp_path / "data" / "shard-00000.npz").write_bytes(b"not a shard")
    with pytest.raises(TrainingError, match="restore it from git"):
        read_samples(tmp_path / "data")


def test_the_recipe_trains_from_committed_shards_alone(tiny_chat_target, tmp_path):
    write_prompts(_prompts(14), tmp_path / "prompts.jsonl")
    generate_shards(tiny_chat_target, _options(tmp_path))
    settings = TrainSettings(num_layers=1, target_layer_ids=[0, 1], mask_token_id=7, anchors_per_sequence=4,
                             sequences_per_step=2, steps=3, sub_vocab=256, negatives=256, checkpoint_every=2,
                             eval_every=3, eval_sequences=2, validation_percent=10)
    options = RecipeOptions(work_dir=tmp_path / "work", out_dir=tmp_path / "drafter", shards_dir=tmp_path / "data",
                            draft_vocab=64, command="test", settings=settings)
    result = run_recipe(tiny_chat_target, options, ["features", "fit", "export"])
    store = FeatureStore(tmp_path / "work" / "features")
    assert len(store) == len(read_samples(tmp_path / "data")) and result["fit"]["steps"] == 3
    assert (tmp_path / "work" / f"fit-{len(store)}" / "checkpoint.pt").is_file()
    assert DFlashDrafter.from_pretrained(tmp_path / "drafter").config.target_layer_ids == [0, 1]
    info = json.loads((tmp_path / "drafter" / "training_info.json").read_text())
    assert "committed shards" in info["data"]


def test_a_shard_selection_trains_on_those_shards_only_and_says_so(tiny_chat_target, tmp_path, capsys):
    from dflash_core import cli

    write_prompts(_prompts(14), tmp_path / "prompts.jsonl")
    generate_shards(tiny_chat_target, _options(tmp_path))
    shards = DataDir(tmp_path / "data").shards
    assert len(shards) >= 3
    settings = TrainSettings(num_layers=1, target_layer_ids=[0, 1], mask_token_id=7, anchors_per_sequence=4,
                             sequences_per_step=2, steps=1, sub_vocab=256, negatives=256, eval_every=1, eval_sequences=2,
                             validation_percent=10)
    options = RecipeOptions(work_dir=tmp_path / "work", out_dir=tmp_path / "drafter", shards_dir=tmp_path / "data",
                            shard_select="0:1,2:", draft_vocab=64, command="test", settings=settings)
    run_recipe(tiny_chat_target, options, ["features", "fit", "export"])
    chosen = read_samples(tmp_path / "data", selection="0:1,2:")
    ids = {s.id for s in chosen}
    assert ids == ({s.id for s in read_samples(tmp_path / "data", selection=":1")}
                   | {s.id for s in read_samples(tmp_path / "data", selection="2:")})
    assert len(FeatureStore(tmp_path / "work" / "features")) == len(chosen) < len(read_samples(tmp_path / "data"))
    used = [shards[0]] + shards[2:]
    info = json.loads((tmp_path / "drafter" / "training_info.json").read_text())
    assert (f"from {len(used)} committed shards of {tmp_path / 'data'} "
            f"({sum(s['answer_tokens'] for s in used)} answer tokens") in info["data"]
    counts = {}  # the prompts' sources, as the chosen shards count them, most first
    for shard in used:
        for source, n in shard["sources"].items():
            counts[source] = counts.get(source, 0) + n
    assert sum(counts.values()) == len(chosen) and set(counts) == {"test"}  # sources by family
    listed = ", ".join(f"{source} {n}" for source, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    assert f"{len(chosen)} prompts ({listed}) and the target's own greedy answers" in info["data"]
    for flags, message in (
        (["--shard-limit", "-1", "--shards", str(tmp_path / "data")], "--shard-limit -1: a number of shards (0: all), with --shards"),
        (["--shard-limit", "2"], "--shard-limit 2: a number of shards (0: all), with --shards"),
        (["--shard-select", ":2"], "--shard-select goes with --shards, and instead of --shard-limit"),
        (["--shard-select", ":2", "--shard-limit", "2", "--shards", str(tmp_path / "data")], "instead of --shard-limit"),
        (["--shard-select", "1-3", "--shards", str(tmp_path / "data")], "'1-3' is not a slice of the manifest's shards"),
        (["--shard-select", "::0", "--shards", str(tmp_path / "data")], "'::0' is not a slice"),
        (["--shard-select", "50:", "--shards", str(tmp_path / "data")], f"names none of the {len(shards)} shards"),
    ):
        args = ["train", "--target", tiny_chat_target.source.location, "--work-dir", str(tmp_path / "w"),
                "--out", str(tmp_path / "o"), *flags]
        assert cli.main(args) == 2
        assert message in capsys.readouterr().err


def test_select_shards_reads_python_slices_over_the_manifest_order():
    shards = [{"file": f"shard-{i:05d}.npz"} for i in range(10)]
    assert select_shards(shards, None) == select_shards(shards, "") == shards
    assert select_shards(shards, ":3") == shards[:3]
    assert select_shards(shards, "0:8:4, 6:") == [shards[i] for i in (0, 4, 6, 7, 8, 9)]  # in order, each once
    assert select_shards(shards, "-2:") == shards[-2:]


def test_a_spread_selection_thins_the_whole_range_to_a_token_budget():
    shards = [{"answer_tokens": 80, "prompt_tokens": 20} for _ in range(10)]
    assert spread_selection(shards, 1000) == "::1"
    assert spread_selection(shards, 999) == "::2"  # shards 0, 2, 4, 6, 8
    assert select_shards(shards, spread_selection(shards, 350)) == shards[::4]  # 0, 4, 8
    assert spread_selection(shards, 100) == "::10"
    with pytest.raises(TrainingError, match="the first shard alone holds 100 tokens, over the budget of 99"):
        spread_selection(shards, 99)


def test_a_fit_can_go_on_from_an_exported_drafter_and_refuses_one_of_another_shape(tiny_chat_target, tmp_path):
    write_prompts(_prompts(8), tmp_path / "prompts.jsonl")
    generate_shards(tiny_chat_target, _options(tmp_path))
    settings = TrainSettings(num_layers=1, target_layer_ids=[0, 1], mask_token_id=7, anchors_per_sequence=4,
                             sequences_per_step=2, steps=2, sub_vocab=256, negatives=256, eval_every=2, eval_sequences=2,
                             validation_percent=10)
    first = RecipeOptions(work_dir=tmp_path / "a", out_dir=tmp_path / "first", shards_dir=tmp_path / "data",
                          draft_vocab=0, command="test", settings=settings)
    run_recipe(tiny_chat_target, first, ["features", "fit", "export"])
    exported = DFlashDrafter.from_pretrained(tmp_path / "first")
    settings.init = f"drafter:{tmp_path / 'first'}"
    settings.steps = 0  # no step: the fit's drafter is the exported one, bf16 as it was saved
    second = RecipeOptions(work_dir=tmp_path / "b", out_dir=tmp_path / "second", shards_dir=tmp_path / "data",
                           draft_vocab=0, command="test", settings=settings)
    run_recipe(tiny_chat_target, second, ["features", "fit", "export"])
    again = DFlashDrafter.from_pretrained(tmp_path / "second")
    for name, tensor in exported.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    # The fit measures where it starts from, before any step, on its own validation split.
    log = [json.loads(line) for line in next((tmp_path / "b").glob("fit-*/train_log.jsonl")).read_text().splitlines()]
    assert [line["step"] for line in log] == [0] and "valid_tau_proxy" in log[0] and "loss" not in log[0]
    first_log = next((tmp_path / "a").glob("fit-*/train_log.jsonl")).read_text()
    assert '"step": 0' not in first_log  # a fit from random or target weights has nothing to measure first
    # More layers than the source grows it: the new layers start as identities (zero output
    # projections), so the grown drafter measures exactly what the source did before any step.
    settings.num_layers = 2
    third = RecipeOptions(work_dir=tmp_path / "c", out_dir=tmp_path / "third", shards_dir=tmp_path / "data",
                          draft_vocab=0, command="test", settings=settings)
    run_recipe(tiny_chat_target, third, ["features", "fit", "export"])
    grown = DFlashDrafter.from_pretrained(tmp_path / "third")
    assert len(grown.layers) == 2
    for name, tensor in exported.state_dict().items():
        assert torch.equal(grown.state_dict()[name], tensor), name
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        assert not grown.state_dict()[f"layers.1.{name}"].any(), name
    assert grown.state_dict()["layers.1.self_attn.q_proj.weight"].any()  # the rest drawn as a fresh layer's
    grown_log = [json.loads(line) for line in next((tmp_path / "c").glob("fit-*/train_log.jsonl")).read_text().splitlines()]
    assert grown_log[0]["valid_tau_proxy"] == log[0]["valid_tau_proxy"]
    # ... and a fit may not drop layers.
    settings.num_layers, settings.init = 1, f"drafter:{tmp_path / 'third'}"
    with pytest.raises(TrainingError, match=r"that drafter has 2 layers \(this fit: 1; a fit may add layers, not drop them\).*--num-layers"):
        run_recipe(tiny_chat_target, second, ["features", "fit"])
    settings.num_layers, settings.init = 1, "drafters"
    with pytest.raises(TrainingError, match="random, target or drafter:DIR"):
        run_recipe(tiny_chat_target, third, ["features", "fit"])


def test_features_gen_data_kept_spare_the_features_stage_its_target_passes(tiny_chat_target, tmp_path, monkeypatch):
    from dflash_core import cli

    write_prompts(_prompts(10), tmp_path / "prompts.jsonl")
    work = tmp_path / "work"
    code = cli.main(["gen-data", "--target", tiny_chat_target.source.location, "--prompts", str(tmp_path / "prompts.jsonl"),
                     "--data-dir", str(tmp_path / "data"), "--shard-prompts", "4", "--slots", "3",
                     "--max-new-tokens", "10", "--keep-features", "0,1", "--features-dir", str(work / "kept-features")])
    assert code == 0 and sorted(p.name for p in (work / "kept-features").glob("*.json"))[0] == "shard-00000.npz.features.json"
    calls = []
    forward = tiny_chat_target.runner.forward
    monkeypatch.setattr(tiny_chat_target.runner, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    settings = TrainSettings(num_layers=1, target_layer_ids=[0, 1], mask_token_id=7)
    options = RecipeOptions(work_dir=work, out_dir=tmp_path / "drafter", shards_dir=tmp_path / "data",
                            feature_layers=[0, 1], command="test", settings=settings)
    run_recipe(tiny_chat_target, options, ["features"])
    store = FeatureStore(work / "features")
    assert len(store) == len(read_samples(tmp_path / "data")) >= 8 and calls == []  # all copied
    # Each answer's rows are its own: the target's features of that sequence, to bf16 rounding.
    for i in (0, len(store) - 1):
        ids, feats, _ = store.sequence(i)
        tiny_chat_target.runner.reset(len(ids))
        expected = forward(ids, [0, 1], last_only=True).features
        torch.testing.assert_close(feats.float(), expected.float(), atol=0.05, rtol=0.02)


def test_the_recipe_without_answers_says_what_to_run(tiny_chat_target, tmp_path):
    options = RecipeOptions(work_dir=tmp_path / "work", out_dir=tmp_path / "d", shards_dir=tmp_path / "empty",
                            settings=TrainSettings(mask_token_id=7, target_layer_ids=[0, 1]))
    with pytest.raises(TrainingError, match="gen-data"):
        run_recipe(tiny_chat_target, options, ["features"])


@pytest.mark.parametrize("flags, message", [
    (["--slots", "0"], "--slots 0: must be at least 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
    (["--shard-prompts", "-3"], "--shard-prompts -3: must be at least 1"),
    (["--minutes", "0"], "--minutes 0.0: must be more than 0"),
    (["--keep-features", "1,2"], "--keep-features needs --features-dir"),
])
def test_gen_data_settings_no_run_can_use_are_one_line_errors_before_loading(tmp_path, capsys, flags, message):
    from dflash_core import cli

    write_prompts([Prompt("p0", "test", [{"role": "user", "content": "hi"}])], tmp_path / "prompts.jsonl")
    code = cli.main(["gen-data", "--target", str(tmp_path / "never-loaded"), "--prompts", str(tmp_path / "prompts.jsonl"),
                     "--data-dir", str(tmp_path / "data"), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"error: {message}") and "\n" not in err
    assert not (tmp_path / "data").exists()
