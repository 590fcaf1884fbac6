"""``gen-data``: add answer shards to a data directory, within a time budget, resumably.

The answers come from the generate stage's own decoders (``batched_decode.greedy_decode_stream``
for Llama-family targets, ``selfdistill``'s batched ``generate()`` otherwise); this module only
decides which prompts come next and writes what comes back as shards (``shards.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import console
from ..hardware import hardware_summary
from ..loading import LoadedTarget
from ..target import FastTarget
from .batched_decode import Answer, greedy_decode_stream
from .errors import TrainingError
from .prompt_sources import Prompt, read_prompts, summarize
from .selfdistill import _hf_generate_batches, chat_ids
from .shards import DataDir, ShardContent, prompt_order, shard_name, write_shard


@dataclass
class GenDataOptions:
    prompts_file: Path
    data_dir: Path
    minutes: float | None = None  # this run's wall-clock budget (None: until the prompts run out)
    max_answer_tokens: int | None = None  # or stop once this run has produced this many answer tokens
    shard_prompts: int = 256  # prompts per shard: ~2.5 min of this machine, all a killed run can lose
    slots: int = 64  # rows decoded together (a GPU takes hundreds)
    max_new_tokens: int = 256
    max_prompt_tokens: int = 640
    # Keep the target's features of these layers while generating (GPU runs: the fit then needs no
    # second target pass); they go to ``features_dir``, never to the committed data.
    feature_layers: Sequence[int] = ()
    features_dir: Path | None = None

    def check(self) -> None:
        """Refuse settings no run can use, before a target is loaded (``gen-data`` flags)."""
        counts = {"--shard-prompts": self.shard_prompts, "--slots": self.slots, "--max-new-tokens": self.max_new_tokens,
                  "max_prompt_tokens": self.max_prompt_tokens, "--max-tokens": self.max_answer_tokens}
        for flag, value in counts.items():
            if value is not None and value < 1:
                raise TrainingError(f"{flag} {value}: must be at least 1")
        if self.minutes is not None and not self.minutes > 0:
            raise TrainingError(f"--minutes {self.minutes}: must be more than 0 (leave it out to run until done)")


def target_key(target: LoadedTarget) -> str:
    """A name for the target that is the same wherever its file lies (a GGUF copied to a GPU machine)."""
    source = target.source
    return Path(source.gguf_file or source.location).name


def data_settings(target: LoadedTarget, options: GenDataOptions) -> dict[str, Any]:
    template = getattr(target.tokenizer, "chat_template", None) or ""
    return {
        "target": target_key(target),
        "prompts_file": options.prompts_file.name,
        "max_new_tokens": options.max_new_tokens,
        "max_prompt_tokens": options.max_prompt_tokens,
        "chat_template": hashlib.sha1(str(template).encode()).hexdigest()[:12],
    }


class _Feed:
    """Hands a shard's prompts to a decoder in order, counting how many it took (the cursor's step)."""

    def __init__(self, tokenizer: Any, chunk: list[Prompt], max_prompt_tokens: int, stop: Callable[[], bool]) -> None:
        self.tokenizer, self.chunk, self.limit, self.stop = tokenizer, chunk, max_prompt_tokens, stop
        self.taken = 0
        self.skipped: list[str] = []
        self.prompt_ids: dict[str, list[int]] = {}

    def __iter__(self) -> Iterator[tuple[str, list[int]]]:
        for prompt in self.chunk:
            if self.stop():
                return
            ids = chat_ids(self.tokenizer, prompt.messages)
            self.taken += 1
            if len(ids) > self.limit:
                self.skipped.append(prompt.id)
                continue
            self.prompt_ids[prompt.id] = ids
            yield prompt.id, ids


def _answers(target: LoadedTarget, feed: _Feed, options: GenDataOptions, stop: Callable[[], bool]) -> Iterator[Answer]:
    eos = target.tokenizer.eos_token_id
    if isinstance(target.runner, FastTarget):
        # Stops mid-shard: no new prompt starts once the budget is spent, answers under way finish.
        yield from greedy_decode_stream(
            target.runner, iter(feed), options.max_new_tokens, eos, slots=options.slots,
            max_prompt_tokens=options.max_prompt_tokens, stop=stop, layer_ids=list(options.feature_layers),
        )
        return
    # Other models: transformers generate() in batches; the budget is checked between shards only.
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else eos
    todo = [(Prompt(pid, "", []), ids) for pid, ids in feed]
    yield from _hf_generate_batches(target.model, todo, options.slots, options.max_new_tokens, eos, pad, lambda: False)


def generate_shards(target: LoadedTarget, options: GenDataOptions) -> dict[str, Any]:
    """Answer the next prompts of ``options.prompts_file`` into new shards of ``options.data_dir``.

    Returns this run's counts and the data directory's totals; ``exhausted`` says every prompt
    of the file is answered (more data then needs more prompts appended to it)."""
    options.check()
    data = DataDir(options.data_dir)
    data.check_settings(data_settings(target, options))
    order = prompt_order(read_prompts(options.prompts_file))
    order_ids = [p.id for p in order]
    data.check_order(order_ids)
    data.directory.mkdir(parents=True, exist_ok=True)
    started = time.time()
    deadline = started + options.minutes * 60 if options.minutes is not None else None
    produced = 0
    new_shards: list[str] = []
    vocab = int(target.config.vocab_size)
    keep = bool(options.feature_layers) and isinstance(target.runner, FastTarget)
    if options.feature_layers and options.features_dir is None:
        raise ValueError("feature_layers needs a features_dir")

    def stop() -> bool:
        return ((deadline is not None and time.time() >= deadline)
                or (options.max_answer_tokens is not None and produced >= options.max_answer_tokens))

    while data.cursor < len(order) and not stop():
        first = data.cursor
        chunk = order[first : first + options.shard_prompts]
        feed = _Feed(target.tokenizer, chunk, options.max_prompt_tokens, stop)
        name = shard_name(len(data.shards))
        shard_started = time.time()
        answers: dict[str, Answer] = {}
        rows: dict[str, int] = {}
        features_bin = options.features_dir / (name + ".features.bin") if keep else None
        with contextlib.ExitStack() as files:
            fh = None
            if features_bin is not None:
                features_bin.parent.mkdir(parents=True, exist_ok=True)
                fh = files.enter_context(open(features_bin, "wb"))
            row = 0
            for answer in _answers(target, feed, options, stop):
                if fh is not None and answer.features is not None:
                    block = answer.features.to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy()
                    fh.write(block.tobytes())
                    rows[str(answer.key)] = row
                    row += block.shape[0]
                    answer.features = None  # written: free the memory
                answers[str(answer.key)] = answer
                produced += len(answer.response)
        if feed.taken == 0:
            break
        answered = [p for p in chunk[: feed.taken] if p.id in answers]
        wall = time.time() - shard_started
        content = ShardContent(
            ids=[p.id for p in answered], prompt_ids=[feed.prompt_ids[p.id] for p in answered],
            answer_ids=[answers[p.id].response for p in answered], finished=[answers[p.id].finished for p in answered],
            skipped=feed.skipped, meta={},
        )
        answer_tokens = sum(len(a) for a in content.answer_ids)
        entry = {
            "file": name, "first": first, "next": first + feed.taken, "answers": len(answered),
            "skipped": len(feed.skipped), "answer_tokens": answer_tokens,
            "prompt_tokens": sum(len(p) for p in content.prompt_ids), "wall_s": round(wall, 1),
            "tokens_per_s": round(answer_tokens / max(wall, 1e-9), 1),
            "device": str(target.runner.device), "dtype": str(target.runner.dtype).replace("torch.", ""),
            "slots": options.slots, "decoder": "continuous" if isinstance(target.runner, FastTarget) else "generate",
            "decoding": "greedy", "machine": hardware_summary(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "sources": summarize(answered), **data.manifest["data"],
        }
        content.meta = dict(entry)
        entry["bytes"] = write_shard(data.directory / name, content, vocab)
        if features_bin is not None:
            (options.features_dir / (name + ".features.json")).write_text(
                json.dumps({"file": features_bin.name, "layers": list(options.feature_layers), "rows": rows}))
        data.add_shard(entry, order_ids)
        new_shards.append(name)
        console.log(f"gen-data: {name} prompts [{first}, {entry['next']}) of {len(order)}: {entry['answers']} answers, "
                    f"{answer_tokens} tokens in {wall:.0f} s ({entry['tokens_per_s']:.0f} tok/s)")
    exhausted = data.cursor >= len(order)
    if exhausted:
        console.log(f"gen-data: all {len(order)} training prompts of {options.prompts_file} are answered; more data needs "
                    "more prompts appended to that file")
    return {"new_shards": new_shards, "new_answer_tokens": produced, "seconds": round(time.time() - started, 1),
            "cursor": data.cursor, "prompts": len(order), "exhausted": exhausted, "totals": data.manifest["totals"]}
