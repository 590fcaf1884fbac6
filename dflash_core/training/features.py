"""The feature cache: the target's hidden states for every training token, computed once.

Training reads the target's features many times (several epochs, many anchors per sequence),
so one pass of the target writes them to disk and training memory-maps them. Layout of a cache
directory::

    index.json                  layer ids, hidden size, the parts (their files, tokens and the
                                seconds their build took), and per sequence: its part, offset
                                within the part, length, response start
    part-NNNNN.ids.npy          int32 token ids of the part's sequences back to back       (n,)
    part-NNNNN.features.npy     bf16 bits (int16) of the stored layers' outputs    (n, len(layer_ids) * H)

``features[:, j*H:(j+1)*H]`` is the residual stream after target layer ``layer_ids[j]`` (the
same definition the engine uses at inference).

The cache grows by parts: a build writes one part at a time (``PART_TOKENS`` tokens) and lists it
in the index once it is complete, so an interrupted build loses only the part under way (on a
small CPU the whole pass takes hours: docs/TRAINING.md), and more data adds parts without copying
the old ones (a copy needs the disk twice over, and the cache of 6 M answer tokens is tens of GB). A cache from before parts (``ids.npy`` and
``features.npy``, no ``parts`` in the index) reads as one part.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

from ..target import TargetRunner
from .errors import TrainingError
from .selfdistill import Sample

INDEX = "index.json"
# Tokens per part: minutes of the target's pass on a small CPU, under a GB for SmolLM2's six layers.
PART_TOKENS = 1 << 17
# Rows the target's pass stacks from several sequences where it can (measured in docs/TRAINING.md).
STACK_TOKENS = 1024
_LEGACY_PART = {"ids": "ids.npy", "features": "features.npy"}


@dataclass
class SequenceRecord:
    id: str
    offset: int  # within its part
    length: int
    response_start: int
    part: int = 0


def _part_files(index: int) -> dict[str, Any]:
    return {"ids": f"part-{index:05d}.ids.npy", "features": f"part-{index:05d}.features.npy"}


class FeatureStore:
    """Read side of a feature cache (memory-mapped)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        meta = json.loads((self.directory / INDEX).read_text())
        self.layer_ids: list[int] = meta["layer_ids"]
        self.hidden_size: int = meta["hidden_size"]
        self.records = [SequenceRecord(**r) for r in meta["sequences"]]
        self.parts: list[dict[str, Any]] = meta.get("parts", [_LEGACY_PART])
        self._ids = [np.load(self.directory / part["ids"], mmap_mode="r") for part in self.parts]
        self._features = [np.load(self.directory / part["features"], mmap_mode="r") for part in self.parts]

    def __len__(self) -> int:
        return len(self.records)

    @property
    def num_tokens(self) -> int:
        return sum(r.length for r in self.records)

    @property
    def build_seconds(self) -> float | None:
        """The wall time of the target passes that wrote the cache, over every run that added a
        part (None for a cache from before parts, which did not record it)."""
        if any("seconds" not in part for part in self.parts):
            return None
        return round(sum(part["seconds"] for part in self.parts), 1)

    def columns(self, layer_ids: Sequence[int]) -> list[int]:
        """Column indices of ``layer_ids`` inside the stored feature matrix."""
        missing = [i for i in layer_ids if i not in self.layer_ids]
        if missing:
            raise TrainingError(f"layers {missing} are not in the feature cache (it holds {self.layer_ids}); "
                                "add them to --feature-layers (the cache is then rebuilt)")
        h = self.hidden_size
        return [c for i in layer_ids for c in range(self.layer_ids.index(i) * h, (self.layer_ids.index(i) + 1) * h)]

    def token_ids(self, index: int) -> np.ndarray:
        """The token ids (prompt and response) of one sequence, int32."""
        r = self.records[index]
        return np.asarray(self._ids[r.part][r.offset : r.offset + r.length])

    def sequence(self, index: int, layer_ids: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(ids (T,), features (T, F) bf16, response_start) of one sequence."""
        r = self.records[index]
        ids = torch.from_numpy(self.token_ids(index).astype(np.int64))
        block = np.array(self._features[r.part][r.offset : r.offset + r.length])
        feats = torch.from_numpy(block).view(torch.bfloat16)
        if layer_ids is not None and list(layer_ids) != self.layer_ids:
            h = self.hidden_size
            parts = [feats[:, self.layer_ids.index(i) * h : (self.layer_ids.index(i) + 1) * h] for i in layer_ids]
            feats = torch.cat(parts, dim=-1)
        return ids, feats, r.response_start


class _StoredFeatures:
    """Features the generate stage kept (``Sample.features``), read from its .features.bin files."""

    def __init__(self, folder: Path | None, layer_ids: Sequence[int], width: int) -> None:
        self.folder, self.layer_ids, self.width = folder, list(layer_ids), width
        self.files: dict[str, np.ndarray] = {}
        self.reused = 0

    def rows(self, sample: Sample, length: int) -> np.ndarray | None:
        info = sample.features
        if self.folder is None or not info or info.get("layers") != self.layer_ids:
            return None
        name = info["file"]
        if name not in self.files:
            path = self.folder / name
            complete_rows = path.stat().st_size // (2 * self.width) if path.is_file() else 0
            if complete_rows == 0:
                return None
            # Whole rows only: an interrupted write can leave a partial one at the end.
            self.files[name] = np.memmap(path, dtype=np.int16, mode="r", shape=(complete_rows, self.width))
        start = int(info["row"])
        block = self.files[name][start : start + length]
        if block.shape[0] < length:
            return None  # cut by an interruption: compute these with the target instead
        self.reused += 1
        return block


def _write_index(out: Path, layer_ids: Sequence[int], hidden_size: int, parts: list[dict[str, Any]],
                 records: list[dict[str, Any]]) -> None:
    meta = {"layer_ids": list(layer_ids), "hidden_size": hidden_size, "parts": parts, "sequences": records}
    (out / "index.next.json").write_text(json.dumps(meta))
    os.replace(out / "index.next.json", out / INDEX)


def _clear(out: Path) -> None:
    """Remove a cache that is rebuilt from scratch (other layers, samples gone): the index first,
    so an interruption never leaves an index naming files that are gone."""
    (out / INDEX).unlink(missing_ok=True)
    for path in out.glob("*.npy"):
        path.unlink()


def _chunks(lengths: list[int], part_tokens: int) -> list[tuple[int, int]]:
    """[start, end) ranges of samples, each of at least ``part_tokens`` tokens except the last."""
    chunks, first, tokens = [], 0, 0
    for i, length in enumerate(lengths):
        tokens += length
        if tokens >= part_tokens:
            chunks.append((first, i + 1))
            first, tokens = i + 1, 0
    if first < len(lengths):
        chunks.append((first, len(lengths)))
    return chunks


def _feature_rows(runner: TargetRunner, items: list[tuple[Sample, int]], layer_ids: Sequence[int],
                  stored: "_StoredFeatures", stack_tokens: int) -> Iterator[np.ndarray]:
    """The cache rows (bf16 bits) of each (sample, length) of ``items``, in order: those the
    generate stage kept are read, the others go through the target, several sequences per pass
    (about ``stack_tokens`` rows) where the runner can stack them (``FastTarget.stacked_features``)."""
    stack = None if getattr(runner, "compiled_layers", True) else getattr(runner, "stacked_features", None)
    ready: dict[int, np.ndarray] = {}
    pending: list[int] = []

    def run_pending() -> None:
        seqs = [torch.tensor(items[i][0].ids[: items[i][1]], dtype=torch.long) for i in pending]
        if stack is not None and len(seqs) > 1:
            outs = stack(seqs, list(layer_ids))
        else:
            outs = []
            for ids in seqs:
                runner.reset(ids.shape[0])
                outs.append(runner.forward(ids, list(layer_ids), last_only=True).features)
        for i, out in zip(pending, outs):
            ready[i] = out.to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy()
        pending.clear()

    waiting_tokens, next_out = 0, 0
    for i, (sample, length) in enumerate(items):
        rows = stored.rows(sample, length)
        if rows is not None:
            ready[i] = rows
        else:
            pending.append(i)
            waiting_tokens += length
            if waiting_tokens >= stack_tokens:
                run_pending()
                waiting_tokens = 0
        while next_out in ready:
            yield ready.pop(next_out)
            next_out += 1
    run_pending()
    while next_out in ready:
        yield ready.pop(next_out)
        next_out += 1


def build_feature_cache(
    runner: TargetRunner,
    samples: list[Sample],
    layer_ids: Sequence[int],
    out_dir: str | Path,
    max_length: int = 1024,
    responses_dir: str | Path | None = None,
    part_tokens: int = PART_TOKENS,
    stack_tokens: int = STACK_TOKENS,
    deadline: float | None = None,
) -> FeatureStore:
    """Run the target over every sample once and write the cache.

    With ``deadline`` (a ``time.time()``), no part is begun after it once one part is built: the
    cache holds the samples of the parts built, and a later build without it adds the rest.

    Samples whose features the generate stage already kept (for the same layers, in
    ``responses_dir``) are copied instead: the target runs only for the others.

    A cache for the same layers is reused, and extended when new samples were generated since, or
    when a build was interrupted (only the samples it lacks go through the target). Each part is
    written under a temporary name, renamed, and then listed in the index, so an interruption
    loses only the part under way."""
    out = Path(out_dir)
    kept = [s for s in samples if len(s.response_ids) >= 2]
    parts: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    if (out / INDEX).is_file():
        old = FeatureStore(out)
        if old.layer_ids != list(layer_ids) or not {r.id for r in old.records} <= {s.id for s in kept}:
            del old
            _clear(out)  # other layers, or samples gone: rebuild from scratch
        else:
            parts, records = list(old.parts), [r.__dict__ for r in old.records]
            del old
    done = {r["id"] for r in records}
    todo = [s for s in kept if s.id not in done]
    out.mkdir(parents=True, exist_ok=True)
    width = len(layer_ids) * runner.hidden_size
    lengths = [min(len(s.ids), max_length) for s in todo]
    stored = _StoredFeatures(Path(responses_dir) if responses_dir is not None else None, layer_ids, width)
    with tqdm(total=sum(lengths), unit="tok", desc="target features", file=sys.stderr, dynamic_ncols=True,
              mininterval=5.0) as bar:
        for first, end in _chunks(lengths, part_tokens):
            if deadline is not None and first > 0 and time.time() >= deadline:  # the first part is always built
                print(f"features: out of time after {sum(lengths[:first])} of {sum(lengths)} tokens; a build without "
                      "a deadline adds the rest", file=sys.stderr, flush=True)
                break
            files = _part_files(len(parts))  # a stale part of that number (never listed) is overwritten
            started = time.time()
            total = sum(lengths[first:end])
            ids_mm = np.lib.format.open_memmap(out / ("next." + files["ids"]), mode="w+", dtype=np.int32, shape=(total,))
            feat_mm = np.lib.format.open_memmap(out / ("next." + files["features"]), mode="w+", dtype=np.int16,
                                                shape=(total, width))
            new_records, offset = [], 0
            items = list(zip(todo[first:end], lengths[first:end]))
            for (sample, length), rows in zip(items, _feature_rows(runner, items, layer_ids, stored, stack_tokens)):
                ids = torch.tensor(sample.ids[:length], dtype=torch.long)
                ids_mm[offset : offset + length] = ids.numpy().astype(np.int32)
                feat_mm[offset : offset + length] = rows
                new_records.append(SequenceRecord(sample.id, offset, length, len(sample.prompt_ids), len(parts)).__dict__)
                offset += length
                bar.update(length)
                bar.set_postfix(kept_from_generation=stored.reused, refresh=False)
            ids_mm.flush()
            feat_mm.flush()
            del ids_mm, feat_mm
            for kind in ("ids", "features"):
                os.replace(out / ("next." + files[kind]), out / files[kind])
            # The index goes last: until it lists the part, the part's files are not part of the cache.
            parts.append({**files, "tokens": total, "seconds": round(time.time() - started, 1)})
            records.extend(new_records)
            _write_index(out, layer_ids, runner.hidden_size, parts, records)
    if not parts:
        _write_index(out, layer_ids, runner.hidden_size, parts, records)
    return FeatureStore(out)
