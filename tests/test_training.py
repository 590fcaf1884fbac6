"""Drafter training on tiny random targets: the mask, the loss going down, resume, export."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dflash_core.drafter import DFlashDrafter
from dflash_core.drafter_config import DrafterConfig
from dflash_core.speculative import GenerationConfig, collect, stream
from dflash_core.target import FastTarget
from dflash_core.testing import tiny_target
from dflash_core.training.errors import TrainingError
from dflash_core.training.features import FeatureStore, build_feature_cache
from dflash_core.training.objective import fused_linear_cross_entropy, make_batch, naive_training_mask, training_mask
from dflash_core.training.selfdistill import Sample
from dflash_core.training.trainer import Trainer, TrainSettings, block_phase, cosine_lr, length_grouped_order


def test_training_mask_is_exactly_the_per_block_construction():
    gen = torch.Generator().manual_seed(0)
    for block_size, anchors_per_seq, context in ((4, 3, 20), (8, 5, 40), (16, 2, 33)):
        anchors = torch.stack([torch.randperm(context - 2, generator=gen)[:anchors_per_seq].sort().values + 1 for _ in range(3)])
        fast = training_mask(anchors, context, block_size)
        assert torch.equal(fast, naive_training_mask(anchors, context, block_size))
        # Spot-check the semantics, not just the two implementations against each other.
        row = block_size + 1  # block 1, slot 1
        anchor = int(anchors[0, 1])
        assert fast[0, 0, row, :anchor].all() and not fast[0, 0, row, anchor:context].any()
        assert fast[0, 0, row, context + block_size : context + 2 * block_size].all()
        assert not fast[0, 0, row, context : context + block_size].any()


def test_batch_labels_are_the_tokens_at_each_slots_position():
    ids = torch.arange(100, 140)
    feats = torch.zeros(40, 8)
    batch = make_batch([(ids, feats, 10)], 6, 4, mask_token_id=3, generator=torch.Generator().manual_seed(1))
    anchors = batch.block_pos.view(6, 4)[:, 0]
    assert (anchors >= 10).all()
    for b, anchor in enumerate(anchors.tolist()):
        assert batch.block_ids[0, b * 4] == 100 + anchor
        assert batch.block_ids[0, b * 4 + 1 : b * 4 + 4].eq(3).all()
        for k in range(1, 4):
            want = 100 + anchor + k if anchor + k < 40 else -100
            assert batch.labels[0, b, k - 1] == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cross_entropy_equals_the_plain_log_softmax_form(dtype):
    """Loss, gradient and argmax hits of the chunked CE against log_softmax over all rows at once
    (chunks of 7 over 50 rows: a partial last chunk; zero weights where a label is invalid)."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(50, 16, generator=g) * 2).requires_grad_()
    head = torch.randn(300, 16, generator=g).to(dtype)
    labels = torch.randint(300, (50,), generator=g)
    labels[:10] = (x.detach().to(dtype) @ head.t()).float()[:10].argmax(-1)  # some rows right, so hits vary
    weights = torch.rand(50, generator=g)
    weights[[3, 17]] = 0.0
    loss, hits = fused_linear_cross_entropy(x, head, labels, weights, chunk=7)
    loss.backward()
    grad = x.grad.clone()
    x.grad = None
    logits = (x.to(dtype) @ head.t()).float()
    plain = -(torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0] * weights).sum()
    plain.backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    assert torch.allclose(loss, plain.detach(), **tol)
    assert torch.allclose(grad, x.grad, **tol)
    assert torch.equal(hits, logits.argmax(-1) == labels) and 10 <= int(hits.sum()) < 50
    assert grad[[3, 17]].abs().max() == 0  # a weightless row gets no gradient


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A tiny target, its own greedy answers to 40 prompts, and their feature cache."""
    model = tiny_target("llama", vocab=96, layers=4, seed=3)
    runner = FastTarget(model)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(40):
        prompt = torch.randint(4, 96, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen).tolist()
        out = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=40, block_size=1).validated(16)))
        samples.append(Sample(f"s{i}", prompt, out.token_ids, False))
    root = tmp_path_factory.mktemp("tiny-train")
    store = build_feature_cache(runner, samples, [1, 3], root / "features")
    return model, runner, store, root


def make_trainer(setup, work, draft_vocab=0, **overrides):
    model, runner, store, _ = setup
    settings = TrainSettings(
        num_layers=1, target_layer_ids=[1, 3], block_size=8, mask_token_id=3, anchors_per_sequence=16,
        sequences_per_step=4, steps=40, lr=3e-3, sub_vocab=64, gamma=4.0, eval_every=1000, checkpoint_every=5,
        eval_sequences=4, validation_percent=10, init_std=0.05,
    )
    for k, v in overrides.items():
        setattr(settings, k, v)
    config = DrafterConfig.for_target(model.config, num_layers=1, mask_token_id=3, block_size=8, target_layer_ids=[1, 3])
    return Trainer(settings, store, model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach(),
                   model.model.norm.weight.detach(), config, work, target_model=model, draft_vocab=draft_vocab)


def test_feature_cache_holds_the_targets_layer_outputs(tiny_setup):
    model, runner, store, _ = tiny_setup
    ids, feats, start = store.sequence(0)
    runner.reset(len(ids))
    out = runner.forward(ids, [1, 3])
    # The cache was built with several sequences per pass (stacked_features): the same math over
    # more rows, which may round differently by a bf16 step.
    torch.testing.assert_close(out.features.to(torch.bfloat16).float(), feats.float(), atol=1e-2, rtol=1e-2)
    assert 3 <= start < len(ids)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_stacked_features_are_each_sequences_own(family):
    """Several sequences in one pass give each the features it gets alone, in order."""
    model = tiny_target(family, vocab=96, layers=4, seed=5)
    runner = FastTarget(model)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(4, 96, (n,), generator=gen) for n in (1, 7, 30, 2, 19)]  # unequal on purpose
    stacked = runner.stacked_features(seqs, [0, 2])
    assert [f.shape for f in stacked] == [(len(s), 2 * 64) for s in seqs]
    for ids, feats in zip(seqs, stacked):
        runner.reset(len(ids))
        torch.testing.assert_close(feats, runner.forward(ids, [0, 2]).features, atol=2e-5, rtol=1e-4)
    # The deepest wanted layer ends the pass; its features do not depend on the layers above it.
    torch.testing.assert_close(runner.stacked_features(seqs, [2])[2], stacked[2][:, 64:], atol=1e-6, rtol=1e-6)


def _samples_of(store):
    return [Sample(r.id, store.token_ids(i)[: r.response_start].tolist(), store.token_ids(i)[r.response_start :].tolist(),
                   False) for i, r in enumerate(store.records)]


def _same_cache(a, b):
    assert [r.id for r in a.records] == [r.id for r in b.records]
    for i in range(len(a)):
        (ids_a, feats_a, start_a), (ids_b, feats_b, start_b) = a.sequence(i), b.sequence(i)
        assert torch.equal(ids_a, ids_b) and start_a == start_b
        # Sequences stacked with other neighbours in one pass may round differently by a bf16 step.
        torch.testing.assert_close(feats_a.float(), feats_b.float(), atol=1e-2, rtol=1e-2)


class _Interrupted(Exception):
    """A build stopped from outside (a killed process), raised by the counting runner."""


def _counting(runner, monkeypatch, fail_after=None):
    """The lengths of the sequences the target runs, one pass each or several stacked."""
    calls = []
    forward, stacked = runner.forward, runner.stacked_features

    def check(more):  # killed before the sequence number ``fail_after`` + 1 is done
        if fail_after is not None and len(calls) + more > fail_after:
            raise _Interrupted("interrupted")

    def counted(ids, *a, **k):
        check(1)
        calls.append(len(ids))
        return forward(ids, *a, **k)

    def counted_stack(seqs, *a, **k):
        check(len(seqs))
        calls.extend(len(s) for s in seqs)
        return stacked(seqs, *a, **k)

    monkeypatch.setattr(runner, "forward", counted)
    monkeypatch.setattr(runner, "stacked_features", counted_stack)
    return calls


def test_more_samples_extend_the_feature_cache_as_a_fresh_build_would(tiny_setup, tmp_path, monkeypatch):
    model, runner, full, _ = tiny_setup
    samples = _samples_of(full)
    build_feature_cache(runner, samples[:25], [1, 3], tmp_path)
    calls = _counting(runner, monkeypatch)
    extended = build_feature_cache(runner, samples, [1, 3], tmp_path)
    assert len(calls) == 15  # only the new samples went through the target
    _same_cache(extended, full)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "index.json", "part-00000.features.npy", "part-00000.ids.npy", "part-00001.features.npy", "part-00001.ids.npy"]
    assert build_feature_cache(runner, samples, [1, 3], tmp_path).num_tokens == full.num_tokens and len(calls) == 15
    rebuilt = build_feature_cache(runner, samples[:10], [1, 3], tmp_path)  # samples gone: rebuilt, not extended
    assert len(rebuilt) == 10 and len(calls) == 25
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json", "part-00000.features.npy", "part-00000.ids.npy"]


def test_an_interrupted_feature_build_keeps_its_finished_parts(tiny_setup, tmp_path, monkeypatch):
    model, runner, full, _ = tiny_setup
    samples = _samples_of(full)
    part = full.num_tokens // 8  # about eight parts
    calls = _counting(runner, monkeypatch, fail_after=22)
    with pytest.raises(_Interrupted):
        build_feature_cache(runner, samples, [1, 3], tmp_path, part_tokens=part)
    kept = FeatureStore(tmp_path)
    assert 0 < len(kept) <= 22 and len(kept.parts) >= 2  # whole parts only: the one under way is lost
    monkeypatch.undo()  # the process restarted: a runner that no longer fails
    calls = _counting(runner, monkeypatch)
    resumed = build_feature_cache(runner, samples, [1, 3], tmp_path, part_tokens=part)
    assert len(calls) == len(samples) - len(kept)  # only what the index lacked went through the target
    _same_cache(resumed, full)
    # The stage's time counts the killed run's finished parts too.
    assert resumed.parts[: len(kept.parts)] == kept.parts and resumed.build_seconds >= kept.build_seconds >= 0
    assert sum(p["tokens"] for p in resumed.parts) == resumed.num_tokens


def test_a_feature_build_out_of_time_keeps_the_parts_it_built_and_a_later_one_adds_the_rest(tiny_setup, tmp_path,
                                                                                             monkeypatch):
    # scripts/gpu_train.py gives the features at most half of what is left, so that the fit has time.
    model, runner, full, _ = tiny_setup
    samples = _samples_of(full)
    part = full.num_tokens // 8  # about eight parts
    first = build_feature_cache(runner, samples, [1, 3], tmp_path, part_tokens=part, deadline=0.0)
    assert len(first.parts) == 1 and 0 < len(first) < len(samples)  # one part, then out of time
    calls = _counting(runner, monkeypatch)
    rest = build_feature_cache(runner, samples, [1, 3], tmp_path, part_tokens=part)
    assert len(calls) == len(samples) - len(first)
    _same_cache(rest, full)


def test_a_cache_from_before_parts_is_read_and_extended(tiny_setup, tmp_path, monkeypatch):
    model, runner, full, _ = tiny_setup
    samples = _samples_of(full)
    old = build_feature_cache(runner, samples[:30], [1, 3], tmp_path / "new")
    # The layout before parts: one ids.npy and one features.npy, offsets into them, no "parts".
    records, ids, feats, offset = [], [], [], 0
    for i, r in enumerate(old.records):
        ids.append(old.token_ids(i))
        feats.append(old.sequence(i)[1].view(torch.int16).numpy())
        records.append({"id": r.id, "offset": offset, "length": r.length, "response_start": r.response_start})
        offset += r.length
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    np.save(legacy / "ids.npy", np.concatenate(ids))
    np.save(legacy / "features.npy", np.concatenate(feats))
    (legacy / "index.json").write_text(json.dumps({"layer_ids": [1, 3], "hidden_size": old.hidden_size,
                                                   "sequences": records}))
    _same_cache(FeatureStore(legacy), old)
    assert FeatureStore(legacy).build_seconds is None  # it did not record its time
    calls = _counting(runner, monkeypatch)
    _same_cache(build_feature_cache(runner, samples, [1, 3], legacy), full)
    assert len(calls) == 10


@pytest.mark.parametrize("first, second", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_the_fit_runs_in_either_precision_and_resumes_across_them(tiny_setup, tmp_path, first, second):
    trainer = make_trainer(tiny_setup, tmp_path, compute_dtype=first, steps=10)
    losses = [trainer.train_step()["loss"] for _ in range(5)]
    assert all(math.isfinite(x) for x in losses)
    assert trainer.head_full.dtype == getattr(torch, first)
    trainer.save_checkpoint()
    # Another machine's precision: the fp32 state resumes, and the step count carries on.
    resumed = make_trainer(tiny_setup, tmp_path, compute_dtype=second, steps=10)
    assert resumed.step == 5 and resumed.head_full.dtype == getattr(torch, second)
    assert math.isfinite(resumed.train_step()["loss"])
    assert all(p.dtype == torch.float32 for p in resumed.drafter.parameters())


def test_a_few_steps_lower_the_loss(tiny_setup, tmp_path):
    trainer = make_trainer(tiny_setup, tmp_path)
    losses = [trainer.train_step()["loss"] for _ in range(40)]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


def test_resuming_from_a_checkpoint_continues_the_same_run(tiny_setup, tmp_path):
    straight = make_trainer(tiny_setup, tmp_path / "a", steps=10)
    straight.run(progress=False)
    interrupted = make_trainer(tiny_setup, tmp_path / "b", steps=10, checkpoint_every=5)
    for _ in range(5):
        interrupted.train_step()
    interrupted.save_checkpoint()
    interrupted.train_step()  # work after the checkpoint is lost by the "crash"
    with open(interrupted.log_file, "a") as fh:  # ... and so is its log line
        fh.write(json.dumps({"step": 6, "loss": 99.0}) + "\n")
    resumed = make_trainer(tiny_setup, tmp_path / "b", steps=10, checkpoint_every=5)
    assert resumed.step == 5
    resumed.run(progress=False)
    logged = [json.loads(line)["step"] for line in resumed.log_file.read_text().splitlines()]
    assert logged == sorted(set(logged)) and 99.0 not in [json.loads(l)["loss"] for l in resumed.log_file.read_text().splitlines()]
    a = straight.unwrapped().state_dict()
    b = resumed.unwrapped().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_finished_fit_resumed_on_a_longer_schedule_goes_on_where_it_stopped(tiny_setup, tmp_path):
    # `make train-bundled`'s second leg: the step count is free on resume, so a finished fit goes
    # on from its last step with the longer schedule's learning rate and curriculum, and its data
    # continues the same order (the sequences a step takes do not depend on the step count).
    schedule = dict(block_schedule="4:0.5,8:0.5", warmup_fraction=0.1)
    first = make_trainer(tiny_setup, tmp_path / "legs", steps=6, **schedule)
    first.run(progress=False)
    last_lr = json.loads(first.log_file.read_text().splitlines()[-1])["lr"]
    second = make_trainer(tiny_setup, tmp_path / "legs", steps=12, **schedule)
    assert second.step == 6
    second.run(progress=False)
    records = [json.loads(line) for line in second.log_file.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    for r in records[6:]:  # logged after the step: step k ran at cosine_lr(k - 1)
        assert r["lr"] == pytest.approx(cosine_lr(r["step"] - 1, second.settings), abs=1e-5)
        assert r["block"] == block_phase(r["step"] - 1, second.settings)[0]
    assert records[6]["lr"] > 2 * last_lr  # the learning rate restarts from the short schedule's floor
    assert [second._sequences_for_step(k) for k in range(6, 12)] == [first._sequences_for_step(k) for k in range(6, 12)]


def test_a_fit_out_of_time_before_its_pace_is_measured_ends_at_its_budget(tiny_setup, tmp_path):
    # scripts/gpu_train.py gives the fit what the earlier stages left: where that is spent before
    # the first re-plan (after 10 steps), the fit ends there, its last step evaluated and kept.
    trainer = make_trainer(tiny_setup, tmp_path, steps=40)
    result = trainer.run(progress=False, time_budget_s=0.0)
    assert result["steps"] == trainer.step == 1 and trainer.checkpoint_path.is_file()
    last = json.loads(trainer.log_file.read_text().splitlines()[-1])
    assert last["step"] == 1 and "valid_tau_proxy" in last
    # Within its budget, the run takes its steps as planned.
    planned = make_trainer(tiny_setup, tmp_path / "planned", steps=6)
    assert planned.run(progress=False, time_budget_s=3600.0)["steps"] == 6


def test_training_is_deterministic_given_a_seed(tiny_setup, tmp_path):
    one = make_trainer(tiny_setup, tmp_path / "one", steps=6)
    two = make_trainer(tiny_setup, tmp_path / "two", steps=6)
    one.run(progress=False)
    two.run(progress=False)
    a, b = one.unwrapped().state_dict(), two.unwrapped().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = make_trainer(tiny_setup, tmp_path / "three", steps=6, seed=1)
    other.run(progress=False)
    assert not all(torch.equal(a[k], other.unwrapped().state_dict()[k]) for k in a)


@pytest.mark.parametrize("count,group_steps", [(203, 4), (64, 8), (10, 50), (7, 1)])
def test_length_grouped_order_is_a_permutation_whose_steps_hold_like_lengths(count, group_steps):
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(5, 900, (count,), generator=gen).tolist()
    per_step = 4
    order = length_grouped_order(lengths, per_step, group_steps, torch.Generator().manual_seed(2))
    assert sorted(order) == list(range(count))
    size = per_step * group_steps
    for start in range(0, count, size):  # a group holds the same indices as the plain shuffle's slice
        plain = length_grouped_order(lengths, per_step, 0, torch.Generator().manual_seed(2))
        assert sorted(order[start : start + size]) == sorted(plain[start : start + size])
    for k in range(0, count - count % per_step, per_step):  # full steps are length-sorted runs of their group
        step = [lengths[i] for i in order[k : k + per_step]]
        group_start = k // size * size
        group = sorted((lengths[i] for i in order[group_start : group_start + size]), reverse=True)
        assert any(group[j : j + per_step] == sorted(step, reverse=True) for j in range(0, len(group), per_step))
    if count % per_step:  # the short step is the last one
        tail = order[count - count % per_step :]
        group = sorted((lengths[i] for i in order[(count - 1) // size * size :]), reverse=True)
        assert sorted((lengths[i] for i in tail), reverse=True) == group[-len(tail):]


def test_length_grouping_pads_less_and_still_sees_every_sequence_once_an_epoch(tiny_setup, tmp_path):
    plain = make_trainer(tiny_setup, tmp_path / "plain", steps=8)
    grouped = make_trainer(tiny_setup, tmp_path / "grouped", steps=8, length_group_steps=4)
    per_epoch = len(plain.train_idx) // 4
    assert per_epoch >= 4

    def padded_rows(trainer):
        return sum(4 * max(trainer.store.records[i].length for i in trainer._sequences_for_step(k))
                   for k in range(per_epoch))

    epoch = [i for k in range(per_epoch) for i in grouped._sequences_for_step(k)]
    assert len(epoch) == len(set(epoch)) == per_epoch * 4 and set(epoch) <= set(grouped.train_idx)
    assert padded_rows(grouped) < padded_rows(plain)
    assert grouped._sequences_for_step(per_epoch) != grouped._sequences_for_step(0)  # a new epoch, a new order
    grouped.run(progress=False)  # and the fit runs on it
    assert grouped.step == 8


def test_resume_with_other_settings_is_refused(tiny_setup, tmp_path):
    first = make_trainer(tiny_setup, tmp_path, steps=2)
    first.run(progress=False)
    with pytest.raises(ValueError, match="other settings"):
        make_trainer(tiny_setup, tmp_path, steps=2, lr=1e-2)


def test_export_with_a_draft_vocabulary_keeps_the_frequent_tokens_and_round_trips(tiny_setup, tmp_path):
    from dflash_core.training.export import export_drafter

    trainer = make_trainer(tiny_setup, tmp_path / "work", steps=2)
    trainer.run(progress=False)
    drafter = trainer.drafter_for_export(draft_vocab=10)
    assert trainer.unwrapped().draft_vocab is None  # the trainer's own drafter is untouched
    store = tiny_setup[2]
    counts = torch.zeros(96, dtype=torch.long)
    for i in trainer.train_idx:
        ids, _, start = store.sequence(i, [1])
        counts += torch.bincount(ids[start:], minlength=96)
    kept = drafter.draft_vocab
    assert kept.numel() == 10 and counts[kept].min() >= counts[[t for t in range(96) if t not in kept.tolist()]].max()
    out = export_drafter(drafter, tmp_path / "export", {"target": "tiny", "steps": 2})
    assert torch.equal(DFlashDrafter.from_pretrained(out).draft_vocab, kept)
    assert trainer.drafter_for_export(draft_vocab=0).draft_vocab is None


def test_the_exact_draft_vocabulary_softmax_scores_the_draft_vocabulary_alone(tiny_setup, tmp_path):
    trainer = make_trainer(tiny_setup, tmp_path / "work", draft_vocab=12, ce_vocab="draft", steps=30)
    batch, _ = trainer._batch(trainer._sequences_for_step(0), torch.Generator().manual_seed(0))
    rows, to_sub = trainer._candidates(batch, torch.Generator().manual_seed(0))
    draft = trainer.draft_tokens
    assert draft.numel() == 12 and torch.equal(rows, trainer.head_full[draft])
    assert torch.equal(to_sub[draft], torch.arange(12)) and int((to_sub >= 0).sum()) == 12
    labels = batch.labels[batch.labels >= 0]
    assert bool((to_sub[labels] < 0).any())  # some labels lie outside: they are skipped, not scored
    first = [trainer.train_step()["ce"] for _ in range(5)]
    for _ in range(20):
        last = trainer.train_step()["ce"]
    assert last < sum(first) / len(first)


def test_evaluation_over_the_draft_vocabulary_is_what_the_exported_drafter_could_propose(tiny_setup, tmp_path):
    whole = make_trainer(tiny_setup, tmp_path / "whole", draft_vocab=96, steps=3)
    whole.run(progress=False)
    report = whole.evaluate()
    assert report["valid_acc_draft"] == report["valid_acc"]  # every token is a draft token: the same argmax
    assert report["valid_tau_proxy_draft"] == report["valid_tau_proxy"]
    small = make_trainer(tiny_setup, tmp_path / "small", draft_vocab=4, steps=3)
    small.run(progress=False)
    report = small.evaluate()
    # A slot can only be right where its label is one of the four draft tokens: the same blocks
    # evaluate() draws (its generator, its chunks of sequences).
    st, gen = small.settings, torch.Generator().manual_seed(12345)
    idx = small.valid_idx[: st.eval_sequences]
    labels = [small._batch(idx[i : i + st.sequences_per_step], gen)[0].labels
              for i in range(0, len(idx), st.sequences_per_step)]
    inside = sum(torch.isin(x, small.draft_tokens).sum((0, 1)) for x in labels)
    valid = sum((x >= 0).sum((0, 1)) for x in labels)
    share = (inside / valid.clamp_min(1)).tolist()
    assert all(a <= c + 1e-6 for a, c in zip(report["valid_acc_draft"], share)) and min(share) < 1
    assert "valid_acc_draft" not in make_trainer(tiny_setup, tmp_path / "none", steps=3).evaluate()
    with pytest.raises(TrainingError, match="--draft-vocab"):
        make_trainer(tiny_setup, tmp_path / "bad", ce_vocab="draft")
    with pytest.raises(TrainingError, match="sampled or draft"):
        make_trainer(tiny_setup, tmp_path / "bad2", ce_vocab="exact")


def test_exported_drafter_loads_back_through_the_engine_with_identical_logits(tiny_setup, tmp_path):
    from dflash_core.training.export import export_drafter

    trainer = make_trainer(tiny_setup, tmp_path / "work", steps=3)
    trainer.run(progress=False)
    out = export_drafter(trainer.unwrapped(), tmp_path / "export", {"target": "tiny", "steps": 3})
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == [1, 3]
    loaded = DFlashDrafter.from_pretrained(out, dtype=torch.bfloat16)
    original = trainer.unwrapped().to(torch.bfloat16).eval()
    noise = torch.randn(1, 8, 64, dtype=torch.bfloat16)
    ctx = torch.randn(1, 20, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        a = original(noise, torch.arange(20, 28), ctx, torch.arange(20))
        b = loaded(noise, torch.arange(20, 28), ctx, torch.arange(20))
    assert torch.equal(a, b)
    assert (out / "README.md").read_text().count("DFlash drafter") >= 1


def test_blockwise_training_attention_equals_the_dense_mask():
    """The fast training path computes exactly what the dense mask specifies."""
    from dflash_core.testing import tiny_drafter
    from dflash_core.drafter import BlockLayout

    model = tiny_target("llama")
    drafter = tiny_drafter(model, layers=2, block_size=8)
    gen = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(4, 96, (n,), generator=gen), torch.randn(n, 128, generator=gen), 5) for n in (30, 41)]
    batch = make_batch(seqs, 4, 8, mask_token_id=3, generator=gen)
    noise = model.model.embed_tokens(batch.block_ids)
    with torch.no_grad():
        dense = drafter(noise, batch.block_pos, batch.context, batch.context_pos, mask=batch.mask())
        fast = drafter(noise, batch.block_pos, batch.context, batch.context_pos, mask=BlockLayout(batch.anchors, 8))
    assert torch.allclose(dense, fast, atol=1e-5)


def test_block_size_curriculum_keeps_the_cost_per_step_constant():
    from dflash_core.training.trainer import block_phase

    st = TrainSettings(steps=100, block_size=16, anchors_per_sequence=32, block_schedule="4:0.5,8:0.2,16:0.3", gamma=7.0)
    assert block_phase(0, st) == (4, 128, 1.75)
    assert block_phase(49, st)[0] == 4
    assert block_phase(50, st)[:2] == (8, 64)
    assert block_phase(70, st)[:2] == (16, 32)
    assert block_phase(99, st) == (16, 32, 7.0)
    assert block_phase(5, TrainSettings(steps=10, block_size=16, anchors_per_sequence=32)) == (16, 32, 7.0)


def test_training_with_a_curriculum_runs_and_learns(tiny_setup, tmp_path):
    trainer = make_trainer(tiny_setup, tmp_path, steps=30, block_schedule="2:0.5,8:0.5", anchors_per_sequence=8)
    losses = [trainer.train_step()["loss"] for _ in range(30)]
    assert trainer.step == 30 and all(l == l for l in losses)
