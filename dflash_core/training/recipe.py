"""The training recipe as resumable stages: prompts -> generate -> features -> fit -> export -> evaluate.

Each stage writes into the work directory and is skipped (or resumed) when its output already
exists, so an interrupted ``python -m dflash_core train ...`` picks up where it stopped.
``recipe_log.json`` records each stage's wall time, so the whole recipe's cost is measured.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import console
from ..drafter_config import DrafterConfig
from ..loading import LoadedTarget, choose_mask_token_id
from ..hardware import hardware_summary
from .errors import TrainingError
from .export import export_drafter
from .features import FeatureStore, build_feature_cache
from .gen_data import GenDataOptions, generate_shards
from .prompt_sources import build_prompt_set, read_prompts, split, summarize, write_prompts
from .selfdistill import generate_responses, read_samples
from .shards import DataDir, select_shards
from .shards import read_samples as read_shard_samples
from .trainer import Trainer, TrainSettings

STAGES = ("prompts", "generate", "features", "fit", "export", "evaluate")
# Key of a stage's result that holds its wall time over all runs, interrupted ones included.
STAGE_TOTAL = "stage_total_s"


@dataclass
class RecipeOptions:
    work_dir: Path
    out_dir: Path
    prompts_file: Path | None = None
    gen_batch_size: int = 64
    gen_max_new_tokens: int = 256
    gen_time_budget_s: float | None = None
    gen_token_budget: int | None = None
    gen_max_prompts: int | None = None
    feature_layers: list[int] | None = None  # default: the drafter's layers (+ the last layer for kl/reg)
    eval_prompts: int = 40
    eval_max_new_tokens: int = 256
    draft_vocab: int = 8192  # most frequent response tokens the exported drafter proposes from (0 = all)
    # Committed answer shards (``shards.py``): the generate stage appends shards there instead of
    # writing ``responses/``, and the features stage reads them.
    shards_dir: Path | None = None
    # Which shards to train on (``shards.select_shards``: ":157" is the bundled drafter's data, while
    # gen-data adds more); None: all.
    shard_select: str | None = None
    gen_shard_prompts: int = 256
    fit_time_budget_s: float | None = None  # re-plan the step count so the fit ends within this
    features_time_budget_s: float | None = None  # begin no part of the feature cache after this, once one is built
    command: str = ""
    settings: TrainSettings = field(default_factory=TrainSettings)


class RecipeLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {"stages": {}}

    def record(self, stage: str, elapsed: float, extra: dict[str, Any] | None = None,
               total: float | None = None) -> None:
        """Add ``elapsed`` to the stage's time, or set it to ``total`` where the stage keeps its
        own count over runs (generate, fit): a run that was killed never reaches this line."""
        entry = self.data["stages"].get(stage, {"seconds": 0.0})
        entry.update({k: v for k, v in (extra or {}).items() if k != "seconds"})
        entry["seconds"] = round(total if total is not None else entry["seconds"] + elapsed, 1)
        self.data["stages"][stage] = entry
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")

    @property
    def total_seconds(self) -> float:
        return sum(v["seconds"] for v in self.data["stages"].values())


def _timed(log: RecipeLog, stage: str, fn: Callable[[], dict[str, Any] | None]) -> dict[str, Any]:
    started = time.time()
    extra = fn() or {}
    total = extra.pop(STAGE_TOTAL, None)
    log.record(stage, time.time() - started, {k: v for k, v in extra.items() if isinstance(v, (int, float, str, list))},
               total)
    return extra


def run_recipe(target: LoadedTarget, options: RecipeOptions, stages: list[str]) -> dict[str, Any]:
    work = options.work_dir
    work.mkdir(parents=True, exist_ok=True)
    log = RecipeLog(work / "recipe_log.json")
    settings = options.settings
    cfg = target.config
    num_layers = int(cfg.num_hidden_layers)
    if settings.mask_token_id < 0:
        settings.mask_token_id = choose_mask_token_id(target.tokenizer, int(cfg.vocab_size))
    layers = sorted(set(options.feature_layers or settings.target_layer_ids))
    if (settings.kl_weight or settings.reg_weight) and num_layers - 1 not in layers:
        layers.append(num_layers - 1)
    prompts_path = work / "prompts.jsonl.gz"
    result: dict[str, Any] = {}

    if "prompts" in stages:
        def do_prompts() -> dict[str, Any]:
            if options.prompts_file is not None:
                prompts = read_prompts(options.prompts_file)
            elif prompts_path.is_file():
                prompts = read_prompts(prompts_path)
            else:
                prompts = build_prompt_set(settings.seed)
            write_prompts(prompts, prompts_path)
            train, held = split(prompts)
            console.log(f"prompts: {len(train)} for training, {len(held)} held out; sources {summarize(train)}")
            return {"train_prompts": len(train), "held_out": len(held)}
        _timed(log, "prompts", do_prompts)

    # Features the generate stage kept while writing shards (never committed: they are large).
    kept_features = work / "kept-features"
    if "generate" in stages and options.shards_dir is not None:
        def do_generate_shards() -> dict[str, Any]:
            minutes = options.gen_time_budget_s / 60 if options.gen_time_budget_s is not None else None
            stats = generate_shards(target, GenDataOptions(
                prompts_file=options.prompts_file or prompts_path, data_dir=options.shards_dir, minutes=minutes,
                max_answer_tokens=options.gen_token_budget, shard_prompts=options.gen_shard_prompts,
                slots=options.gen_batch_size, max_new_tokens=options.gen_max_new_tokens,
                feature_layers=layers, features_dir=kept_features,
            ))
            console.log(f"generate: {stats}")
            return {"new_answer_tokens": stats["new_answer_tokens"], "new_shards": len(stats["new_shards"]),
                    "answer_tokens": stats["totals"].get("answer_tokens", 0)}
        _timed(log, "generate", do_generate_shards)
    elif "generate" in stages:
        def do_generate() -> dict[str, Any]:
            train, _ = split(read_prompts(prompts_path))
            if options.gen_max_prompts:
                train = train[: options.gen_max_prompts]
            stats = generate_responses(
                target.model, target.tokenizer, train, work / "responses",
                batch_size=options.gen_batch_size, max_new_tokens=options.gen_max_new_tokens,
                token_budget=options.gen_token_budget, time_budget_s=options.gen_time_budget_s,
                runner=target.runner, feature_layers=layers,
            )
            console.log(f"generate: {stats}")
            # A finished stage run again adds nothing: keep the rate its real run measured.
            kept = stats if stats["new_tokens"] else {"tokens": stats["tokens"]}
            return {**kept, STAGE_TOTAL: stats["spent_s"]}
        _timed(log, "generate", do_generate)

    if "features" in stages:
        def do_features() -> dict[str, Any]:
            if options.shards_dir is not None:
                samples = read_shard_samples(options.shards_dir, kept_features, options.shard_select)
                where, kept = options.shards_dir, kept_features
            else:
                samples = read_samples(work / "responses")
                where = kept = work / "responses"
            if not samples:
                raise TrainingError(f"no answers in {where}: run the generate stage (or `make gen-data`) first")
            budget = options.features_time_budget_s
            store = build_feature_cache(target.runner, samples, layers, work / "features", responses_dir=kept,
                                        deadline=None if budget is None else time.time() + budget)
            console.log(f"features: {len(store)} sequences, {store.num_tokens} tokens, layers {store.layer_ids}")
            stats: dict[str, Any] = {"sequences": len(store), "tokens": store.num_tokens}
            if store.build_seconds is not None:  # the parts' own times: runs that were killed count too
                stats[STAGE_TOTAL] = store.build_seconds
            return stats
        _timed(log, "features", do_features)

    trainer = None
    if "fit" in stages or "export" in stages:
        store = FeatureStore(work / "features")
        drafter_config = DrafterConfig.for_target(
            cfg, num_layers=settings.num_layers, mask_token_id=settings.mask_token_id,
            block_size=settings.block_size, target_layer_ids=list(settings.target_layer_ids),
            attention_bias=settings.attention_bias,
        )
        runner = target.runner
        final_norm = target.model.model.norm.weight.detach()
        embed = target.model.get_input_embeddings().weight.detach()
        # Shards grow between runs: a fit per data size, so new data gets a fresh fit while the
        # feature cache above is extended, not rebuilt.
        fit_dir = work / (f"fit-{len(store)}" if options.shards_dir is not None else "fit")
        trainer = Trainer(settings, store, embed, runner.lm_head_weight.detach(), final_norm, drafter_config, fit_dir,
                          target_model=target.model, device="cpu" if runner.device.type == "cpu" else str(runner.device),
                          draft_vocab=options.draft_vocab)

    if "fit" in stages:
        def do_fit() -> dict[str, Any]:
            fitted = trainer.run(time_budget_s=options.fit_time_budget_s)
            return {**fitted, STAGE_TOTAL: fitted["elapsed_s"]}
        result["fit"] = _timed(log, "fit", do_fit)
        console.log(f"fit: {result['fit']}")

    if "export" in stages:
        def do_export() -> dict[str, Any]:
            stages_log = log.data["stages"]
            tokens = stages_log.get("features", {}).get("tokens", "?")
            sources, origin = "journal-prompts, chatterbot-corpus, chitchat-dataset, third-party code stubs, templates", ""
            if options.shards_dir is not None:
                used = select_shards(DataDir(options.shards_dir).shards, options.shard_select)
                counts: Counter[str] = Counter()
                for shard in used:
                    counts.update(shard.get("sources", {}))
                sources = ", ".join(f"{source} {n}" for source, n in counts.most_common())
                origin = (f", from {len(used)} committed shards of {options.shards_dir} "
                          f"({sum(s['answer_tokens'] for s in used)} answer tokens, "
                          f"{sum(s['wall_s'] for s in used) / 60:.0f} min of generation)")
            data = (f"{tokens} tokens: {stages_log.get('features', {}).get('sequences', '?')} prompts "
                    f"({sources}) and the target's own greedy answers to them{origin}")
            info = {
                "target": target.name,
                "data": data,
                "steps": trainer.step,
                "wall_time": f"{log.total_seconds / 60:.1f} min for the whole recipe so far",
                "hardware": hardware_summary(),
                "settings": settings.to_json(),
                "command": options.command,
            }
            drafter = trainer.drafter_for_export(options.draft_vocab)
            if drafter.draft_vocab is not None:
                info["draft_vocabulary"] = f"{drafter.draft_vocab.numel()} most frequent response tokens (draft_vocab.json)"
            export_drafter(drafter, options.out_dir, info)
            console.log(f"export: {options.out_dir}")
            return {}
        _timed(log, "export", do_export)

    if "evaluate" in stages:
        from .evaluate import evaluate_drafter

        def do_evaluate() -> dict[str, Any]:
            measured = evaluate_drafter(target, options.out_dir, options.eval_prompts, options.eval_max_new_tokens)
            console.log(f"evaluate: {measured}")
            return measured
        result["evaluate"] = _timed(log, "evaluate", do_evaluate)

    result["recipe_minutes"] = round(log.total_seconds / 60, 1)
    return result
