"""The feature cache: the target's hidden states for every training token, computed once.

Training reads the target's features many times (several epochs, many anchors per sequence),
so one pass of the target writes them to disk and training memory-maps them. Layout of a cache
directory::

    index.json      layer ids, hidden size, and per sequence: offset, length, response start
    ids.npy         int32 token ids, all sequences back to back            (N,)
    features.npy    bf16 bits (int16) of the stored layers' outputs        (N, len(layer_ids) * H)

``features[:, j*H:(j+1)*H]`` is the residual stream after target layer ``layer_ids[j]`` (the
same definition the engine uses at inference).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm import tqdm

from ..target import TargetRunner
from .errors import TrainingError
from .selfdistill import Sample

INDEX = "index.json"


@dataclass
class SequenceRecord:
    id: str
    offset: int
    length: int
    response_start: int


class FeatureStore:
    """Read side of a feature cache (memory-mapped)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        meta = json.loads((self.directory / INDEX).read_text())
        self.layer_ids: list[int] = meta["layer_ids"]
        self.hidden_size: int = meta["hidden_size"]
        self.records = [SequenceRecord(**r) for r in meta["sequences"]]
        self.ids = np.load(self.directory / "ids.npy", mmap_mode="r")
        self.features = np.load(self.directory / "features.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self.records)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    def columns(self, layer_ids: Sequence[int]) -> list[int]:
        """Column indices of ``layer_ids`` inside the stored feature matrix."""
        missing = [i for i in layer_ids if i not in self.layer_ids]
        if missing:
            raise TrainingError(f"layers {missing} are not in the feature cache (it holds {self.layer_ids}); "
                                "add them to --feature-layers (the cache is then rebuilt)")
        h = self.hidden_size
        return [c for i in layer_ids for c in range(self.layer_ids.index(i) * h, (self.layer_ids.index(i) + 1) * h)]

    def sequence(self, index: int, layer_ids: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(ids (T,), features (T, F) bf16, response_start) of one sequence."""
        r = self.records[index]
        ids = torch.from_numpy(np.array(self.ids[r.offset : r.offset + r.length], dtype=np.int64))
        block = np.array(self.features[r.offset : r.offset + r.length])
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


def build_feature_cache(
    runner: TargetRunner,
    samples: list[Sample],
    layer_ids: Sequence[int],
    out_dir: str | Path,
    max_length: int = 1024,
    responses_dir: str | Path | None = None,
) -> FeatureStore:
    """Run the target over every sample once and write the cache.

    Samples whose features the generate stage already kept (for the same layers, in
    ``responses_dir``) are copied instead: the target runs only for the others.

    A complete cache for the same layers is reused, and extended when new samples were
    generated since (only they go through the target: more data costs only the new tokens).
    The new cache is written next to the old one and swapped in at the end, so an interruption
    leaves the previous cache intact."""
    out = Path(out_dir)
    kept = [s for s in samples if len(s.response_ids) >= 2]
    old: FeatureStore | None = None
    if (out / INDEX).is_file():
        old = FeatureStore(out)
        old_ids = {r.id for r in old.records}
        if old.layer_ids != list(layer_ids) or not old_ids <= {s.id for s in kept}:
            old = None  # other layers, or samples gone: rebuild from scratch
        else:
            kept = [s for s in kept if s.id not in old_ids]
            if not kept:
                return old
    out.mkdir(parents=True, exist_ok=True)
    lengths = [min(len(s.ids), max_length) for s in kept]
    # Where the old records end (an interrupted swap can leave longer files behind).
    start = max((r.offset + r.length for r in old.records), default=0) if old is not None else 0
    total = start + sum(lengths)
    width = len(layer_ids) * runner.hidden_size
    ids_mm = np.lib.format.open_memmap(out / "ids.next.npy", mode="w+", dtype=np.int32, shape=(total,))
    feat_mm = np.lib.format.open_memmap(out / "features.next.npy", mode="w+", dtype=np.int16, shape=(total, width))
    records = []
    if old is not None:
        records = [r.__dict__ for r in old.records]
        ids_mm[:start] = old.ids[:start]
        for a in range(0, start, 1 << 16):  # chunked: the old cache can exceed the free memory
            feat_mm[a : min(start, a + (1 << 16))] = old.features[a : min(start, a + (1 << 16))]
        del old
    stored = _StoredFeatures(Path(responses_dir) if responses_dir is not None else None, layer_ids, width)
    offset = start
    with tqdm(total=total - start, unit="tok", desc="target features", file=sys.stderr, dynamic_ncols=True,
              mininterval=5.0) as bar:
        for sample, length in zip(kept, lengths):
            ids = torch.tensor(sample.ids[:length], dtype=torch.long)
            rows = stored.rows(sample, length)
            if rows is None:
                runner.reset(length)
                out_t = runner.forward(ids, list(layer_ids), last_only=True)
                rows = out_t.features.to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy()
            ids_mm[offset : offset + length] = ids.numpy().astype(np.int32)
            feat_mm[offset : offset + length] = rows
            records.append(SequenceRecord(sample.id, offset, length, len(sample.prompt_ids)).__dict__)
            offset += length
            bar.update(length)
            bar.set_postfix(kept_from_generation=stored.reused, refresh=False)
    ids_mm.flush()
    feat_mm.flush()
    del ids_mm, feat_mm
    # The index goes last: until it is written, the old index describes a prefix of the new files.
    os.replace(out / "features.next.npy", out / "features.npy")
    os.replace(out / "ids.next.npy", out / "ids.npy")
    meta = {"layer_ids": list(layer_ids), "hidden_size": runner.hidden_size, "sequences": records}
    (out / "index.next.json").write_text(json.dumps(meta))
    os.replace(out / "index.next.json", out / INDEX)
    return FeatureStore(out)
