"""The whole training recipe, end to end, on a tiny random target that speaks SmolLM2's tokenizer."""

from __future__ import annotations

import json

import torch

from dflash_core.drafter import DFlashDrafter
from dflash_core.training.features import FeatureStore
from dflash_core.training.prompt_sources import Prompt, write_prompts
from dflash_core.training.recipe import STAGES, RecipeOptions, run_recipe
from dflash_core.training.selfdistill import SPENT_FILE, read_samples
from dflash_core.training.trainer import TrainSettings


def test_every_stage_runs_and_the_export_loads_back(tiny_chat_target, tmp_path):
    prompts = [Prompt(f"p{i}", "test", [{"role": "user", "content": f"Question number {i}: what is {i} + {i}?"}])
               for i in range(14)]
    write_prompts(prompts, tmp_path / "prompts.jsonl")
    settings = TrainSettings(num_layers=1, target_layer_ids=[0, 1], mask_token_id=7, anchors_per_sequence=4,
                             sequences_per_step=2, steps=4, sub_vocab=256, negatives=256, checkpoint_every=2,
                             eval_every=4, eval_sequences=2, validation_percent=10)
    options = RecipeOptions(work_dir=tmp_path / "work", out_dir=tmp_path / "drafter",
                            prompts_file=tmp_path / "prompts.jsonl", gen_batch_size=4, gen_max_new_tokens=12,
                            eval_prompts=1, eval_max_new_tokens=6, draft_vocab=128, command="test", settings=settings)
    result = run_recipe(tiny_chat_target, options, list(STAGES))

    log = json.loads((tmp_path / "work" / "recipe_log.json").read_text())
    assert set(log["stages"]) == set(STAGES) and all(v["seconds"] >= 0 for v in log["stages"].values())
    store = FeatureStore(tmp_path / "work" / "features")
    assert log["stages"]["prompts"]["train_prompts"] == len(store) and store.layer_ids == [0, 1]
    # A Llama-family target: answers come from the continuous-batching decoder, which kept the
    # features the features stage then copied.
    assert all(s.features and s.features["layers"] == [0, 1] for s in read_samples(tmp_path / "work" / "responses"))
    assert result["fit"]["steps"] == 4 and "valid_tau_proxy" in result["fit"]
    drafter = DFlashDrafter.from_pretrained(tmp_path / "drafter")
    assert drafter.config.target_layer_ids == [0, 1] and drafter.draft_vocab.numel() == 128
    info = json.loads((tmp_path / "drafter" / "training_info.json").read_text())
    assert info["steps"] == 4 and info["command"] == "test"
    assert set(result["evaluate"]) == {"tau_humaneval_b16", "tau_heldout_b16", "tau_humaneval_b8", "tau_humaneval_b16_t0.7"}
    assert all(tau >= 1.0 for tau in result["evaluate"].values())
    assert "tau HumanEval B=16" in (tmp_path / "drafter" / "README.md").read_text()

    # Run again with more steps: every finished stage is reused, the fit resumes where it stopped.
    # Forget the log's generate and fit times, as if those runs had been killed before logging:
    # the stages' own counts over all runs still give the recipe's full cost.
    spent = json.loads((tmp_path / "work" / "responses" / SPENT_FILE).read_text())["seconds"]
    for stage in ("generate", "fit"):
        del log["stages"][stage]
    (tmp_path / "work" / "recipe_log.json").write_text(json.dumps(log))
    settings.steps = 6
    again = run_recipe(tiny_chat_target, options, ["generate", "features", "fit"])
    assert again["fit"]["steps"] == 6
    relogged = json.loads((tmp_path / "work" / "recipe_log.json").read_text())["stages"]
    assert relogged["generate"]["seconds"] == spent and relogged["generate"]["tokens"] > 0
    assert relogged["fit"]["seconds"] == round(again["fit"]["elapsed_s"], 1)
    assert again["fit"]["elapsed_s"] > result["fit"]["elapsed_s"]
    assert len(FeatureStore(tmp_path / "work" / "features")) == len(store)
    assert len(list((tmp_path / "work" / "responses").glob("shard-*.jsonl"))) == 1
    assert torch.load(tmp_path / "work" / "fit" / "checkpoint.pt", weights_only=False)["step"] == 6
