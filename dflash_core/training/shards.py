"""Committed training data: the target's answers as compressed token-id shards, plus a manifest.

A data directory (``assets/data/smollm2-answers``) grows over many runs, on any machine::

    manifest.json     what the data is (target, prompt file, generation settings), the cursor
                      into the prompt order, and one entry per shard (its prompt range, counts,
                      wall time, machine, device)
    shard-00000.npz   one run's answers to a contiguous range of the prompt order

A shard holds flat int arrays (``uint16`` when the vocabulary fits, else ``int32``) of every prompt
and answer with their lengths, the prompt ids, whether each answer ended with EOS, the ids of
prompts skipped as too long, and its own metadata as JSON: it describes itself without the
manifest. Prompts are answered in a fixed order (the prompt file's training split, in file order)
and the manifest's ``cursor`` says how far: shard ``k`` covers prompts ``[first, next)`` of that
order, so nothing is ever answered twice and a prompt file may grow by appending. A shard is
written under a temporary name and renamed, then the manifest is replaced the same way: a killed
run loses at most the shard it was writing.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .errors import TrainingError
from .prompt_sources import Prompt
from .selfdistill import Sample

FORMAT = "dflash-answers/1"
MANIFEST = "manifest.json"
# What must be equal for two runs to add to the same data (the answers depend on them).
DATA_SETTINGS = ("target", "prompts_file", "max_new_tokens", "max_prompt_tokens", "chat_template")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.npz"


def ids_digest(ids: Sequence[str]) -> str:
    """A fingerprint of an ordered list of prompt ids (detects a prompt file edited, not appended)."""
    h = hashlib.sha1()
    for i in ids:
        h.update(i.encode("utf-8", "surrogatepass") + b"\n")
    return h.hexdigest()


@dataclass
class ShardContent:
    """One shard's records, in the order the prompts were taken."""

    ids: list[str]
    prompt_ids: list[list[int]]
    answer_ids: list[list[int]]
    finished: list[bool]
    skipped: list[str]  # prompts of the shard's range too long to answer (they count towards the cursor)
    meta: dict[str, Any]


def _flat(rows: list[list[int]], dtype: type) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(r) for r in rows], dtype=np.int32)
    flat = np.fromiter((t for r in rows for t in r), dtype=np.int64, count=int(lengths.sum()))
    return flat.astype(dtype), lengths


def _rows(flat: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    ends = np.cumsum(lengths)
    return [flat[e - n : e].astype(np.int64).tolist() for n, e in zip(lengths.tolist(), ends.tolist())]


def write_shard(path: Path, content: ShardContent, vocab_size: int) -> int:
    """Write ``content`` to ``path`` atomically; returns the file's size in bytes."""
    # Token ids below 65,536 (SmolLM2: 49,152) take two bytes before compression.
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    prompts, prompt_lengths = _flat(content.prompt_ids, dtype)
    answers, answer_lengths = _flat(content.answer_ids, dtype)
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer, prompt_ids=prompts, prompt_lengths=prompt_lengths, answer_ids=answers,
        answer_lengths=answer_lengths, finished=np.array(content.finished, dtype=bool),
        ids=np.array(content.ids, dtype=np.str_), skipped=np.array(content.skipped, dtype=np.str_),
        meta=np.array(json.dumps(content.meta)),
    )
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, path)
    return len(buffer.getvalue())


def read_answers(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A shard's answers alone, as stored: every answer's token ids in a row, and their lengths."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return z["answer_ids"], z["answer_lengths"]
    except (OSError, ValueError, KeyError) as exc:
        raise TrainingError(f"{path} is not a readable answer shard ({exc}); restore it from git "
                            f"(`git checkout -- {path}`) or remove it and its manifest entry") from exc


def read_shard(path: Path) -> ShardContent:
    try:
        with np.load(path, allow_pickle=False) as z:
            return ShardContent(
                ids=[str(x) for x in z["ids"]], prompt_ids=_rows(z["prompt_ids"], z["prompt_lengths"]),
                answer_ids=_rows(z["answer_ids"], z["answer_lengths"]), finished=z["finished"].tolist(),
                skipped=[str(x) for x in z["skipped"]], meta=json.loads(str(z["meta"])),
            )
    except (OSError, ValueError, KeyError) as exc:
        raise TrainingError(f"{path} is not a readable answer shard ({exc}); restore it from git "
                            f"(`git checkout -- {path}`) or remove it and its manifest entry") from exc


class DataDir:
    """The manifest of a data directory (read, checked against new runs, replaced atomically)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        path = self.directory / MANIFEST
        if path.is_file():
            try:
                self.manifest: dict[str, Any] = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise TrainingError(f"{path} is not valid JSON ({exc}); restore it from git") from exc
            if self.manifest.get("format") != FORMAT:
                raise TrainingError(f"{path} has format {self.manifest.get('format')!r}; this version reads {FORMAT}")
        else:
            self.manifest = {"format": FORMAT, "data": None, "cursor": 0, "consumed_digest": ids_digest([]),
                             "totals": {}, "shards": []}

    @property
    def cursor(self) -> int:
        return int(self.manifest["cursor"])

    @property
    def shards(self) -> list[dict[str, Any]]:
        return self.manifest["shards"]

    def check_settings(self, data: dict[str, Any]) -> None:
        """Adopt ``data`` (the settings the answers depend on) or refuse settings that differ."""
        known = self.manifest.get("data")
        if known is None:
            self.manifest["data"] = {k: data[k] for k in DATA_SETTINGS}
            return
        changed = [k for k in DATA_SETTINGS if known.get(k) != data.get(k)]
        if changed:
            detail = ", ".join(f"{k}: {known.get(k)!r} there, {data.get(k)!r} now" for k in changed)
            raise TrainingError(f"{self.directory} holds answers generated with other settings ({detail}); "
                                "use the same settings or another data directory")

    def check_order(self, order: Sequence[str]) -> None:
        """The prompts already consumed must still come first, in the same order."""
        cursor = self.cursor
        if len(order) < cursor or ids_digest(order[:cursor]) != self.manifest["consumed_digest"]:
            raise TrainingError(
                f"the prompt file no longer starts with the {cursor} prompts {self.directory} has answered "
                "(it was edited or reordered); a prompt file may only grow by appending prompts"
            )

    def add_shard(self, entry: dict[str, Any], order: Sequence[str]) -> None:
        """Record a shard already on disk and move the cursor to its end (manifest replaced atomically)."""
        self.shards.append(entry)
        self.manifest["cursor"] = entry["next"]
        self.manifest["consumed_digest"] = ids_digest(order[: entry["next"]])
        totals: dict[str, float] = {}
        for shard in self.shards:
            for key in ("answers", "skipped", "answer_tokens", "prompt_tokens", "wall_s", "bytes"):
                totals[key] = totals.get(key, 0) + shard[key]
        totals["wall_s"] = round(totals["wall_s"], 1)
        self.manifest["totals"] = totals
        self.save()

    def save(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / MANIFEST
        tmp = path.with_name(MANIFEST + ".tmp")
        tmp.write_text(json.dumps(self.manifest, indent=1) + "\n")
        os.replace(tmp, path)


def prompt_order(prompts: list[Prompt]) -> list[Prompt]:
    """The fixed order prompts are answered in: the training split, in file order.

    The committed prompt file is already shuffled, so every run's range mixes all sources."""
    from .prompt_sources import split

    return split(prompts)[0]


def select_shards(shards: Sequence[dict[str, Any]], selection: str | None) -> list[dict[str, Any]]:
    """The manifest entries a selection names: comma-separated Python slices over the manifest's
    order (``":157"`` the first 157, ``"0:157:4,157:"`` every fourth of those and all after), each
    shard once, in manifest order; ``None`` or ``""`` selects every shard.

    A drafter trained on a selection stays reproducible while gen-data appends shards, and a
    selection can mix older data with newer sources without a feature cache of everything."""
    if not selection:
        return list(shards)
    chosen: set[int] = set()
    for part in selection.split(","):
        fields = part.strip().split(":")
        try:
            if len(fields) not in (2, 3):
                raise ValueError(part)
            bounds = [int(f) if f.strip() else None for f in fields]
            if len(bounds) == 3 and bounds[2] is not None and bounds[2] < 1:
                raise ValueError(part)
        except ValueError:
            raise TrainingError(f"shard selection {selection!r}: {part.strip()!r} is not a slice of the manifest's "
                                "shards; write START:STOP or START:STOP:STEP (Python's slices, STEP >= 1), "
                                "comma-separated, e.g. 0:157:4,157:") from None
        chosen.update(range(len(shards))[slice(*bounds)])
    if not chosen:
        raise TrainingError(f"shard selection {selection!r} names none of the {len(shards)} shards")
    return [shards[i] for i in sorted(chosen)]


def spread_selection(shards: Sequence[dict[str, Any]], max_tokens: int) -> str:
    """A selection (``select_shards``' syntax) of every k-th shard, k the smallest step whose
    shards hold at most ``max_tokens`` tokens, answers with their prompts: the data's whole range,
    thinned to what a feature cache of that size holds (~7 KB a token with the recipe's layers)."""
    def tokens(chosen: Sequence[dict[str, Any]]) -> int:
        return sum(s["answer_tokens"] + s["prompt_tokens"] for s in chosen)

    for step in range(1, len(shards) + 1):
        if tokens(shards[::step]) <= max_tokens:
            return f"::{step}"
    raise TrainingError(f"the first shard alone holds {tokens(shards[:1])} tokens, over the budget of {max_tokens}")


def read_samples(directory: str | Path, features_dir: str | Path | None = None,
                 selection: str | None = None) -> list[Sample]:
    """Every answer of the shards the manifest lists (those ``selection`` names, if given: see
    ``select_shards``), as training samples.

    With ``features_dir``, answers whose target features were kept while generating point at
    them (``<shard>.features.json`` there maps a prompt id to its first row), so the features
    stage copies them instead of running the target."""
    data = DataDir(directory)
    samples: list[Sample] = []
    for entry in select_shards(data.shards, selection):
        content = read_shard(data.directory / entry["file"])
        kept: dict[str, Any] = {"rows": {}}
        if features_dir is not None:
            index = Path(features_dir) / (entry["file"] + ".features.json")
            if index.is_file():
                kept = json.loads(index.read_text())
        for pid, prompt, answer, done in zip(content.ids, content.prompt_ids, content.answer_ids, content.finished):
            features = None
            if pid in kept["rows"]:
                features = {"file": kept["file"], "row": kept["rows"][pid], "layers": kept["layers"]}
            samples.append(Sample(pid, prompt, answer, bool(done), features))
    return samples
