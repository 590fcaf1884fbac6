"""The training loop: resumable, deterministic for a seed, and ``accelerate``-ready.

It reads a feature cache (``features.py``), draws anchors per sequence with a generator seeded
by ``(seed, step)`` (so a resumed run draws exactly what the uninterrupted one would have), and
updates only the drafter: the target's embedding and LM head are shared and frozen. Under
``accelerate launch`` each process takes its own share of every step's sequences and gradients
are averaged; on one CPU it is a plain loop.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..drafter import BlockLayout, DFlashDrafter, init_drafter_weights
from ..drafter_config import DrafterConfig
from ..loading import resolve_dtype, torch_dtype
from .errors import TrainingError
from .features import FeatureStore
from .objective import Batch, compute_loss, make_batch, slot_weights


@dataclass
class TrainSettings:
    """Hyper-parameters; each default says why it is what it is."""

    num_layers: int = 2  # drafting is paid every cycle on a CPU: few layers
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 8, 15, 22, 27])  # spread over depth
    block_size: int = 16  # what the published drafters use and the engine verifies
    mask_token_id: int = -1  # -1: the recipe picks an unused token (loading.choose_mask_token_id)
    anchors_per_sequence: int = 64  # blocks per sequence per step (recipe: up to 512)
    sequences_per_step: int = 4  # several sequences: larger matmuls, smoother gradients
    length_group_steps: int = 0  # >0: each epoch's shuffled order is cut into groups of this many
    # steps, each group sorted by length before it is cut into steps (whose order is shuffled):
    # a step's context is padded to its longest sequence, so sequences of like length waste less
    # of it (``length_grouped_order``); 0: a plain shuffle
    block_schedule: str = ""  # curriculum, e.g. "4:0.45,8:0.25,16:0.3" = B=4 for 45% of the steps,
    # then 8, then 16. Compute grows with blocks x slots, and tau is decided by the first slots:
    # small blocks early train slot 1 on 4x more anchors per step (measured: held-out slot-1
    # accuracy 0.29 after 5 minutes at B=4 against 0.09 at B=16). Anchors per sequence scale as
    # anchors_per_sequence * block_size / B, so every step costs the same.
    steps: int = 2000
    lr: float = 6e-4  # DFlash recipe
    min_lr_ratio: float = 0.05
    warmup_fraction: float = 0.04  # DFlash recipe: 4% warm-up, then cosine
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    gamma: float = 7.0  # slot decay for B=16 (recipe: 7; 5 for B=10; 4 for B=8)
    sub_vocab: int = 4096  # most frequent response tokens: always in the softmax of the CE/KL losses
    negatives: int = 4096  # + this many random vocabulary rows per step (+ every label of the step),
    # so that tokens never seen as labels are still pushed down: the drafter runs with the full head
    ce_vocab: str = "sampled"  # sampled: the softmax above | draft: an exact softmax over the draft
    # vocabulary the exported drafter proposes from (the trainer's ``draft_vocab``), nothing else;
    # labels outside it are skipped, as the exported drafter can never propose them
    ce_weight: float = 1.0
    kl_weight: float = 0.0
    reg_weight: float = 0.0
    init: str = "random"  # random | target (copy target layers, see warm_start) | drafter:DIR (go on
    # training an exported drafter on new data, see continue_from)
    attention_bias: bool = False  # q/k/v/o biases (Qwen3's attention_bias): a learnable constant
    # query/key component lets attention become positional (attend to the anchor, the last
    # context positions) from the first steps, which a content-only projection must discover
    init_std: float = 0.02
    seed: int = 0
    checkpoint_every: int = 250
    eval_every: int = 250
    eval_sequences: int = 48
    validation_percent: int = 2  # sequences held out from training for the per-slot accuracy
    # The matrices' precision (the weights and optimizer stay fp32): "auto" is bf16 where the device
    # multiplies bf16 natively (``loading.resolve_dtype``), else fp32; an AVX2-only CPU runs bf16
    # autocast on a generic path many times slower than fp32 (measured in docs/TRAINING.md).
    compute_dtype: str = "auto"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def block_phase(step: int, settings: TrainSettings) -> tuple[int, int, float]:
    """(block size, anchors per sequence, gamma) at ``step`` under the curriculum."""
    phases = []
    for item in filter(None, (x.strip() for x in settings.block_schedule.split(","))):
        size, _, share = item.partition(":")
        phases.append((int(size), float(share)))
    block = settings.block_size
    if phases:
        total = sum(share for _, share in phases)
        edge = 0.0
        for size, share in phases:
            edge += share / total
            block = size
            if step < edge * settings.steps:
                break
    anchors = max(1, settings.anchors_per_sequence * settings.block_size // block)
    gamma = settings.gamma * block / settings.block_size  # 7 at B=16 -> 3.5 at 8 (recipe: 7, 5 at 10, 4 at 8)
    return block, anchors, gamma


def cosine_lr(step: int, settings: TrainSettings) -> float:
    warm = max(1, int(settings.steps * settings.warmup_fraction))
    if step < warm:
        return settings.lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, settings.steps - warm))
    floor = settings.lr * settings.min_lr_ratio
    return floor + (settings.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def split_validation(store: FeatureStore, percent: int) -> tuple[list[int], list[int]]:
    import hashlib

    train, valid = [], []
    for i, rec in enumerate(store.records):
        bucket = int(hashlib.sha1(("valid:" + rec.id).encode()).hexdigest()[:8], 16) % 100
        (valid if bucket < percent else train).append(i)
    return train, valid


def length_grouped_order(lengths: Sequence[int], per_step: int, group_steps: int,
                         generator: torch.Generator) -> list[int]:
    """A permutation of ``range(len(lengths))`` read ``per_step`` at a time, one step after another.

    ``group_steps <= 0``: a plain shuffle. Otherwise the shuffle is cut into groups of
    ``group_steps * per_step`` indices; each group is sorted by length and cut into steps, and the
    steps of a group are shuffled, so a step holds sequences of like length while the groups, and
    which sequences share a group, stay random (the sampler of transformers' ``group_by_length``).
    Only the last group can end in a short step, and it stays last, so step ``k`` is always the
    slice ``[k * per_step, (k + 1) * per_step)``."""
    perm = torch.randperm(len(lengths), generator=generator)
    if group_steps <= 0 or per_step <= 1:
        return perm.tolist()
    lens = torch.as_tensor(list(lengths), dtype=torch.long)
    size = per_step * group_steps
    order: list[torch.Tensor] = []
    for start in range(0, len(perm), size):
        group = perm[start : start + size]
        group = group[torch.argsort(lens[group], descending=True, stable=True)]
        steps = list(group.split(per_step))
        tail = [steps.pop()] if steps[-1].numel() < per_step else []
        order.extend(steps[i] for i in torch.randperm(len(steps), generator=generator).tolist())
        order.extend(tail)
    return torch.cat(order).tolist()


def frequent_tokens(store: FeatureStore, indices: list[int], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent response tokens of the training sequences (sorted ids)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in indices:
        r = store.records[i]
        ids = torch.from_numpy(store.token_ids(i)[r.response_start :].astype("int64"))
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    size = min(size, vocab_size)
    return torch.topk(counts, size).indices.sort().values


def _tau_proxy(accuracy: list[float]) -> float:
    """Expected acceptance length if slot k were accepted independently with probability
    ``accuracy[k]``: a cheap proxy to watch (the engine measures the real tau)."""
    tau, run = 1.0, 1.0
    for p in accuracy:
        run *= p
        tau += run
    return round(tau, 3)


def warm_start(drafter: DFlashDrafter, target_model: torch.nn.Module, source_layers: list[int]) -> None:
    """Copy target decoder layers into the drafter (q/k norms start as identity) and pass the
    deepest selected feature through ``fc``."""
    layers = target_model.model.layers
    with torch.no_grad():
        for dl, si in zip(drafter.layers, source_layers):
            tl = layers[si]
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(dl.self_attn, name).weight.copy_(getattr(tl.self_attn, name).weight.float())
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(dl.mlp, name).weight.copy_(getattr(tl.mlp, name).weight.float())
            dl.input_layernorm.weight.copy_(tl.input_layernorm.weight.float())
            dl.post_attention_layernorm.weight.copy_(tl.post_attention_layernorm.weight.float())
        h = drafter.config.hidden_size
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -h:].copy_(torch.eye(h))
        # The first copied layer then sees the context as the target's own layer did: the
        # deepest selected feature, normalised with that layer's input norm.
        drafter.hidden_norm.weight.copy_(layers[source_layers[0]].input_layernorm.weight.float())


DRAFTER_INIT = "drafter:"


def continue_from(drafter: DFlashDrafter, directory: str | Path) -> None:
    """Start the fit from an exported drafter's weights (a new schedule on new data, where a
    checkpoint's resume would go on with its own), refusing one of another shape.

    A fit with more layers than the source grows it: the source's layers come first, and each new
    layer's output projections (attention's o_proj, the MLP's down_proj) start at zero, so the new
    layers add nothing to the residual stream and the grown drafter drafts exactly as the source
    did at step 0; the fit then trains them in (the data showed the drafter underfitting, not
    overfitting: docs/TRAINING.md)."""
    source = DFlashDrafter.from_pretrained(directory)
    ours, theirs = drafter.config, source.config
    differs = [f"{name} {getattr(theirs, name)} (this fit: {getattr(ours, name)})"
               for name in ("hidden_size", "block_size", "mask_token_id", "target_layer_ids")
               if getattr(ours, name) != getattr(theirs, name)]
    if ours.qwen3.intermediate_size != theirs.qwen3.intermediate_size:
        differs.append(f"intermediate_size {theirs.qwen3.intermediate_size} (this fit: {ours.qwen3.intermediate_size})")
    if len(source.layers) > len(drafter.layers):
        differs.append(f"{len(source.layers)} layers (this fit: {len(drafter.layers)}; a fit may add layers, not drop them)")
    if differs:
        raise TrainingError(f"--init {DRAFTER_INIT}{directory}: that drafter has {', '.join(differs)}; "
                            "give the fit its settings (--num-layers, --target-layer-ids, --mask-token-id, --block-size)")
    # strict=False: the grown fit's extra layers are absent from the source; anything else missing is a bug
    missing, unexpected = drafter.load_state_dict(source.state_dict(), strict=False)  # into the fit's fp32 parameters
    grown = range(len(source.layers), len(drafter.layers))
    assert not unexpected and all(any(key.startswith(f"layers.{i}.") for i in grown) for key in missing), (missing, unexpected)
    with torch.no_grad():
        for i in grown:
            for projection in (drafter.layers[i].self_attn.o_proj, drafter.layers[i].mlp.down_proj):
                projection.weight.zero_()
                if projection.bias is not None:
                    projection.bias.zero_()


class Trainer:
    def __init__(
        self,
        settings: TrainSettings,
        store: FeatureStore,
        embed_weight: torch.Tensor,  # (V, H) target input embedding (frozen)
        head_weight: torch.Tensor,  # (V, H) target LM head (frozen)
        final_norm_weight: torch.Tensor,  # (H,) target final norm (frozen)
        drafter_config: DrafterConfig,
        work_dir: str | Path,
        target_model: torch.nn.Module | None = None,
        device: str = "cpu",
        draft_vocab: int = 0,  # the exported drafter's vocabulary (most frequent response tokens; 0: all)
    ) -> None:
        from accelerate import Accelerator

        if settings.mask_token_id < 0:
            raise TrainingError("TrainSettings.mask_token_id must be set (the recipe picks one for the target)")
        if settings.ce_vocab not in ("sampled", "draft"):
            raise TrainingError(f"ce_vocab {settings.ce_vocab!r}: choose sampled or draft")
        if settings.ce_vocab == "draft" and not draft_vocab:
            raise TrainingError("ce_vocab 'draft' is an exact softmax over the draft vocabulary: set --draft-vocab N (N > 0)")
        self.settings = settings
        self.store = store
        self.work = Path(work_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.accelerator = Accelerator(cpu=device == "cpu")
        self.device = self.accelerator.device
        self.compute_dtype = torch_dtype(resolve_dtype(settings.compute_dtype, str(self.device)))
        self.rank = self.accelerator.process_index
        self.world = self.accelerator.num_processes
        torch.manual_seed(settings.seed)
        self.final_norm_weight = final_norm_weight.float().to(self.device)
        self.eps = float(drafter_config.qwen3.rms_norm_eps)
        self.embed = embed_weight.to(self.device, self.compute_dtype)
        self.train_idx, self.valid_idx = split_validation(store, settings.validation_percent)
        self.vocab_size = int(head_weight.shape[0])
        self.frequent = frequent_tokens(store, self.train_idx, settings.sub_vocab, self.vocab_size)
        self.draft_tokens = (frequent_tokens(store, self.train_idx, draft_vocab, self.vocab_size)
                             if draft_vocab else None)
        self.head_full = head_weight.to(self.device, self.compute_dtype)

        self.column_ids = list(settings.target_layer_ids)
        need_final = settings.kl_weight > 0 or settings.reg_weight > 0
        last = store.layer_ids[-1]
        self.final_layer = last if need_final else None
        if need_final and last != (drafter_config.num_target_layers or last + 1) - 1:
            raise TrainingError("KL / regression losses need the target's last layer in the feature cache: "
                                "add it to --feature-layers, or set --kl-weight 0 --reg-weight 0")

        drafter = DFlashDrafter(drafter_config)
        init_drafter_weights(drafter, std=settings.init_std, seed=settings.seed)
        with torch.no_grad():
            drafter.norm.weight.copy_(final_norm_weight.float())
        if settings.init == "target":
            if target_model is None:
                raise TrainingError("init='target' needs the target model")
            n = settings.num_layers
            src = list(range(int(target_model.config.num_hidden_layers) - n, int(target_model.config.num_hidden_layers)))
            warm_start(drafter, target_model, src)
        elif settings.init.startswith(DRAFTER_INIT):
            continue_from(drafter, settings.init.removeprefix(DRAFTER_INIT))
        elif settings.init != "random":
            raise TrainingError(f"--init {settings.init!r}: random, target or {DRAFTER_INIT}DIR (an exported drafter)")
        decay, no_decay = [], []
        for name, p in drafter.named_parameters():
            (no_decay if p.dim() < 2 else decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=settings.lr, betas=(0.9, 0.95), eps=1e-8,
        )
        self.drafter, self.optimizer = self.accelerator.prepare(drafter, optimizer)
        self.step = 0
        self._epoch_order: tuple[int, list[int]] = (-1, [])  # (epoch, its order of train_idx)
        self.log_file = self.work / "train_log.jsonl"
        self.elapsed = 0.0
        self._resume()

    # ---------------------------------------------------------------------------- checkpoints
    @property
    def checkpoint_path(self) -> Path:
        return self.work / "checkpoint.pt"

    def _resume(self) -> None:
        if not self.checkpoint_path.is_file():
            return
        state = torch.load(self.checkpoint_path, map_location="cpu", weights_only=False)
        saved = state["settings"]
        # The compute precision may differ between the machines a fit is resumed on: the state is fp32.
        free = ("steps", "checkpoint_every", "eval_every", "compute_dtype")
        mismatched = {k for k in saved if k not in free and saved[k] != getattr(self.settings, k)}
        if mismatched:
            raise TrainingError(
                f"{self.checkpoint_path} was written with other settings ({sorted(mismatched)}); "
                "use another --work-dir or the same settings"
            )
        self.accelerator.unwrap_model(self.drafter).load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.elapsed = float(state.get("elapsed", 0.0))
        self._truncate_log()

    def _truncate_log(self) -> None:
        """Drop log lines written after the checkpoint: the resumed run writes those steps again."""
        if not (self.accelerator.is_main_process and self.log_file.is_file()):
            return
        kept = [line for line in self.log_file.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= self.step]
        self.log_file.write_text("".join(line + "\n" for line in kept))

    def save_checkpoint(self) -> None:
        if not self.accelerator.is_main_process:
            return
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save({
            "drafter": self.accelerator.unwrap_model(self.drafter).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "elapsed": self.elapsed,
            "settings": self.settings.to_json(),
        }, tmp)
        os.replace(tmp, self.checkpoint_path)  # atomic: an interruption never leaves half a file

    # ------------------------------------------------------------------------------- batches
    def _sequences_for_step(self, step: int) -> list[int]:
        s = self.settings.sequences_per_step
        per_epoch = max(1, len(self.train_idx) // s)
        epoch, slot = divmod(step, per_epoch)
        if self._epoch_order[0] != epoch:
            gen = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + epoch)
            lengths = [self.store.records[i].length for i in self.train_idx]
            self._epoch_order = (epoch, length_grouped_order(lengths, s, self.settings.length_group_steps, gen))
        picks = self._epoch_order[1][slot * s : (slot + 1) * s]
        mine = picks[self.rank :: self.world] or picks[:1]
        return [self.train_idx[i] for i in mine]

    def _batch(self, indices: list[int], generator: torch.Generator, block_size: int | None = None,
               anchors: int | None = None) -> tuple[Batch, torch.Tensor | None]:
        seqs = [self.store.sequence(i, self.column_ids) for i in indices]
        batch = make_batch(seqs, anchors or self.settings.anchors_per_sequence, block_size or self.settings.block_size,
                           self.settings.mask_token_id, generator)
        final = None
        if self.final_layer is not None:
            finals = [self.store.sequence(i, [self.final_layer])[1] for i in indices]
            t = batch.context.shape[1]
            raw = torch.zeros(len(finals), t, finals[0].shape[1], dtype=torch.bfloat16)
            for j, f in enumerate(finals):
                raw[j, : f.shape[0]] = f
            x = raw.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            final = (x * self.final_norm_weight.cpu()).to(self.compute_dtype)
        return batch, final

    def _candidates(self, batch: Batch, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The vocabulary rows this step's softmax runs over: the frequent tokens, every label of
        the step, and random negatives (a sampled softmax; see ``TrainSettings.negatives``), or
        exactly the draft vocabulary (``ce_vocab`` "draft")."""
        if self.settings.ce_vocab == "draft":
            candidates = self.draft_tokens
        else:
            labels = batch.labels[batch.labels >= 0].unique()
            negatives = torch.randint(self.vocab_size, (self.settings.negatives,), generator=generator)
            candidates = torch.unique(torch.cat((self.frequent, labels, negatives)))
        to_sub = torch.full((self.vocab_size,), -1, dtype=torch.long)
        to_sub[candidates] = torch.arange(candidates.shape[0])
        return self.head_full[candidates.to(self.device)], to_sub.to(self.device)

    def _autocast(self) -> Any:
        """bf16 autocast where the matrices run in bf16; in fp32 everything already is."""
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype,
                              enabled=self.compute_dtype != torch.float32)

    def _forward(self, batch: Batch) -> torch.Tensor:
        noise = F.embedding(batch.block_ids.to(self.device), self.embed)
        return self.drafter(
            noise, batch.block_pos.to(self.device), batch.context.to(self.device, self.compute_dtype),
            batch.context_pos.to(self.device),
            mask=BlockLayout(batch.anchors.to(self.device), batch.block_size),
        )

    # ---------------------------------------------------------------------------------- steps
    def train_step(self) -> dict[str, float]:
        st = self.settings
        for group in self.optimizer.param_groups:
            group["lr"] = cosine_lr(self.step, st)
        gen = torch.Generator().manual_seed(st.seed * 7919 + self.step)
        block, anchors, gamma = block_phase(self.step, st)
        batch, final = self._batch(self._sequences_for_step(self.step), gen, block, anchors)
        weights = slot_weights(block, gamma).to(self.device)
        head_rows, to_sub = self._candidates(batch, gen)
        self.drafter.train()
        with self._autocast():
            hidden = self._forward(batch)
            parts = compute_loss(
                hidden, batch, head_rows, to_sub, weights,
                None if final is None else final.to(self.device),
                st.ce_weight, st.kl_weight, st.reg_weight,
            )
        self.optimizer.zero_grad(set_to_none=True)
        self.accelerator.backward(parts.total)
        grad_norm = self.accelerator.clip_grad_norm_(self.drafter.parameters(), st.clip_norm)
        self.optimizer.step()
        self.step += 1
        acc = (parts.slot_correct / parts.slot_count.clamp_min(1)).tolist()
        return {"loss": float(parts.total.detach()), "ce": parts.ce, "kl": parts.kl, "reg": parts.reg,
                "grad_norm": float(grad_norm), "acc1": acc[0], "acc_mean": sum(acc) / len(acc),
                "lr": self.optimizer.param_groups[0]["lr"], "block": block}

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Per-slot top-1 accuracy on held-out sequences, fixed anchors: over the full vocabulary,
        and with a draft vocabulary also over it alone, as the exported drafter proposes."""
        st = self.settings
        self.drafter.eval()
        correct = torch.zeros(st.block_size - 1)
        correct_draft = torch.zeros(st.block_size - 1)
        count = torch.zeros(st.block_size - 1)
        draft_head = None if self.draft_tokens is None else self.head_full[self.draft_tokens.to(self.device)]
        idx = self.valid_idx[: st.eval_sequences]
        gen = torch.Generator().manual_seed(12345)
        for i in range(0, len(idx), st.sequences_per_step):
            batch, _ = self._batch(idx[i : i + st.sequences_per_step], gen)
            with self._autocast():
                hidden = self._forward(batch)
            s, a, km1 = batch.labels.shape
            slots = hidden.view(s, a, km1 + 1, -1)[:, :, 1:]
            pred = F.linear(slots.to(self.compute_dtype), self.head_full).argmax(-1).cpu()
            valid = batch.labels >= 0
            correct += ((pred == batch.labels) & valid).sum((0, 1)).float()
            count += valid.sum((0, 1)).float()
            if draft_head is not None:
                pred = self.draft_tokens[F.linear(slots.to(self.compute_dtype), draft_head).argmax(-1).cpu()]
                correct_draft += ((pred == batch.labels) & valid).sum((0, 1)).float()
        acc = (correct / count.clamp_min(1)).tolist()
        result = {"valid_acc": [round(x, 4) for x in acc], "valid_tau_proxy": _tau_proxy(acc)}
        if draft_head is not None:
            acc = (correct_draft / count.clamp_min(1)).tolist()
            result.update(valid_acc_draft=[round(x, 4) for x in acc], valid_tau_proxy_draft=_tau_proxy(acc))
        return result

    def _replan(self, time_budget_s: float, run_started: float, first_step: int) -> None:
        """Set the step count so the run ends within ``time_budget_s`` at the pace measured so far.

        The learning-rate schedule and the block curriculum read ``settings.steps`` at every
        step, so a re-plan early in the run only stretches or shrinks them."""
        st = self.settings
        spent = time.time() - run_started
        per_step = spent / max(1, self.step - first_step)
        # 5% margin for the evaluations and the last checkpoint, which the pace so far underweights.
        st.steps = max(self.step + 1, self.step + int((time_budget_s - spent) * 0.95 / per_step))

    def run(self, progress: bool = True, time_budget_s: float | None = None) -> dict[str, Any]:
        """Train up to ``settings.steps``; with ``time_budget_s``, the step count is re-planned
        from the measured pace (after 10, 50 and 200 steps of this run) to end within it, and a
        run found past its budget after any step (slow steps before the first re-plan, or a
        pace that changed) ends at that step."""
        st = self.settings
        last_eval: dict[str, Any] = {}
        run_started, first_step = time.time(), self.step
        bar = tqdm(total=st.steps, initial=self.step, desc="train drafter", file=sys.stderr,
                   dynamic_ncols=True, mininterval=5.0, disable=not progress or not self.accelerator.is_main_process)
        started = time.time() - self.elapsed
        if self.step == 0 and st.init.startswith(DRAFTER_INIT):
            # Where a drafter trained on starts from, on this data's validation split: what the new
            # data and steps add is measured against it.
            last_eval = self.evaluate()
            self._log({"step": 0, "elapsed_s": 0.0, **last_eval})
        while self.step < st.steps:
            metrics = self.train_step()
            self.elapsed = time.time() - started
            if time_budget_s is not None:
                if time.time() - run_started >= time_budget_s:
                    st.steps = self.step  # out of time: this step is the last, evaluated and checkpointed
                elif self.step - first_step in (10, 50, 200):
                    self._replan(time_budget_s, run_started, first_step)
                bar.total = st.steps
            record = {"step": self.step, "elapsed_s": round(self.elapsed, 1), **{k: round(v, 5) for k, v in metrics.items()}}
            if self.step % st.eval_every == 0 or self.step == st.steps:
                last_eval = self.evaluate()
                record.update(last_eval)
            self._log(record)
            if self.step % st.checkpoint_every == 0 or self.step == st.steps:
                self.save_checkpoint()
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc1=f"{metrics['acc1']:.2f}",
                            acc=f"{metrics['acc_mean']:.2f}",
                            val_tau=last_eval.get("valid_tau_proxy_draft", last_eval.get("valid_tau_proxy", "-")))
        bar.close()
        return {"steps": self.step, "elapsed_s": self.elapsed, **last_eval}

    def _log(self, record: dict[str, Any]) -> None:
        if self.accelerator.is_main_process:
            with open(self.log_file, "a") as fh:
                fh.write(json.dumps(record) + "\n")

    def unwrapped(self) -> DFlashDrafter:
        return self.accelerator.unwrap_model(self.drafter)

    def drafter_for_export(self, draft_vocab: int = 0) -> DFlashDrafter:
        """A copy of the trained drafter, proposing from the ``draft_vocab`` most frequent
        response tokens of the training data (0: the whole vocabulary)."""
        drafter = copy.deepcopy(self.unwrapped())
        if draft_vocab:
            drafter.set_draft_vocab(frequent_tokens(self.store, self.train_idx, draft_vocab, self.vocab_size))
        return drafter
