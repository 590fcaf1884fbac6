"""Timing DFlash against its peers, interleaved per prompt so that machine drift cancels.

Methods (all greedy unless a temperature is given; all on the same loaded target weights):

* ``dflash`` — the engine with the pair's drafter;
* ``ar`` — the same engine, block size 1 (the target alone, our own loop);
* ``hf_generate`` — transformers ``model.generate()``, what most users run today;
* ``prompt_lookup`` — transformers prompt-lookup decoding (``prompt_lookup_num_tokens``);
* ``hf_dflash`` — transformers' own DFlash loop (``generate(speculation_type="dflash")``) with the
  pair's drafter converted to its assistant class (``hf_export.py``; see ``hf_dflash.py``);
* ``llama_cpp`` — llama.cpp on the same GGUF file (``llama_cpp_peer.py``; ``make peers``), the
  only method not on our loaded weights;
* ``dflash_adaptive`` — DFlash verifying only the drafts worth their measured cost;
* ``dflash_tree`` / ``dflash_tree_adaptive`` — DFlash verifying a tree of the drafter's likeliest
  continuations (``tree.py``), of the block's size or of the size worth its cost;
* ``dflash_lookup``, ``dflash_lookup_adaptive``, ``dflash_tree_lookup``,
  ``dflash_tree_lookup_adaptive`` — the same with prompt lookup's guess verified in the same pass
  (``lookup.py``).

The engine's methods are the named variants of ``request.VARIANTS``, each run as a ``Request``
through ``Engine.resolve`` (the checks every front end gets, the context's included); the peers
get the prompt ids and settings it resolves.

Timing lives here, not in the loop: each method is timed end to end (prefill included) with a
CUDA synchronisation on GPUs (``torch.cuda.Event`` pairs), ``perf_counter`` on CPUs. The order of
the methods rotates from prompt to prompt, after a warm-up of every method.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from ..engine import Engine
from ..request import VARIANTS, Request, Resolved
from ..speculative import GenerationResult, collect
from .prompts import BenchPrompt

PEERS = ("hf_generate", "prompt_lookup", "hf_dflash", "llama_cpp")  # what a user might run instead of us
METHODS = tuple(VARIANTS) + PEERS


@dataclass
class MethodRun:
    method: str
    tokens: list[int]
    seconds: float  # end to end, prefill included
    decode_seconds: float | None = None  # after the first token (engine methods, hf_dflash and llama_cpp)
    result: GenerationResult | None = None
    acceptance_lengths: list[int] | None = None  # a peer's own DFlash cycles (hf_dflash)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("nan")

    @property
    def lengths(self) -> list[int] | None:
        """Acceptance length of each drafted cycle (ours or a peer's); None for methods without."""
        return self.result.acceptance_lengths if self.result is not None else self.acceptance_lengths


@dataclass
class PromptRecord:
    index: int
    prompt_tokens: int
    runs: dict[str, MethodRun] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)  # what every method was given


class Timer:
    """Wall time of a callable; CUDA events when the device is a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return out, start.elapsed_time(end) / 1000.0
        began = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - began


class Bench:
    """``request``: the settings every method runs with (its prompt and variant are the bench's to set)."""

    def __init__(self, engine: Engine, request: Request, methods: tuple[str, ...] = METHODS,
                 prompt_lookup_tokens: int = 10, rules: tuple[str, ...] = ("match",)) -> None:
        self.engine = engine
        self.request = request
        self.methods = methods
        self.prompt_lookup_tokens = prompt_lookup_tokens
        self.rules = rules
        self.timer = Timer(engine.target.runner.device)
        self._assistant: Any = None  # transformers' DFlash assistant, converted on first use
        self._llama: Any = None  # the llama.cpp peer, loaded on first use

    def asked(self, prompt: BenchPrompt) -> Request:
        """The bench's request for one prompt: a plain prompt exactly as ``generate --prompt``
        encodes it, a conversation through the chat template."""
        return replace(self.request, prompt=prompt.text, messages=None if prompt.text is not None else prompt.messages)

    # ------------------------------------------------------------------------------- peers
    def _hf_dflash_run(self, asked: Resolved) -> MethodRun:
        from ..hf_export import to_hf_assistant
        from .hf_dflash import hf_dflash_generate

        if self._assistant is None:
            self._assistant = to_hf_assistant(self.engine.drafter)
        result, seconds = self.timer(lambda: hf_dflash_generate(
            self.engine.target.model, self._assistant, asked.prompt_ids, asked.config.max_new_tokens,
            self.engine.stop_ids, asked.config.temperature))
        return MethodRun("hf_dflash", result.token_ids, seconds, result.decode_seconds,
                         acceptance_lengths=result.acceptance_lengths)

    def _llama_cpp_run(self, asked: Resolved) -> MethodRun:
        from ..loading import resolve_gguf
        from .llama_cpp_peer import LlamaCppPeer, PeerUnavailableError

        if asked.config.temperature > 0:
            raise PeerUnavailableError("the llama_cpp bench method is greedy only (temperature 0)")
        if self._llama is None:
            source = self.engine.pair.target
            if source.kind != "gguf":
                raise PeerUnavailableError(f"the llama_cpp bench method runs the pair's GGUF file; pair "
                                           f"{self.engine.pair.name!r} has a {source.kind} target")
            self._llama = LlamaCppPeer(resolve_gguf(source), threads=torch.get_num_threads())
        run = self._llama.generate(asked.prompt_ids, asked.config.max_new_tokens, self.engine.stop_ids)
        return MethodRun("llama_cpp", run.token_ids, run.seconds, run.decode_seconds)

    # ---------------------------------------------------------------------------- methods
    def _engine_run(self, request: Request, name: str) -> MethodRun:
        resolved = self.engine.resolve(request)
        result, seconds = self.timer(lambda: collect(self.engine.stream_ids(resolved.prompt_ids, resolved.config)))
        return MethodRun(name, result.token_ids, seconds, result.decode_s, result)

    def _hf_run(self, asked: Resolved, lookup: bool) -> MethodRun:
        model = self.engine.target.model
        device = self.engine.target.runner.device
        ids = asked.prompt_ids
        input_ids = torch.tensor([ids], device=device)
        kwargs: dict[str, Any] = {
            "max_new_tokens": asked.config.max_new_tokens, "eos_token_id": self.engine.stop_ids,
            "pad_token_id": self.engine.stop_ids[0] if self.engine.stop_ids else None,
            "attention_mask": torch.ones_like(input_ids),
        }
        if asked.config.temperature > 0:
            kwargs.update(do_sample=True, temperature=asked.config.temperature)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if lookup:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup_tokens

        def run() -> list[int]:
            with torch.inference_mode():
                out = model.generate(input_ids, **kwargs)
            return out[0, len(ids):].tolist()

        tokens, seconds = self.timer(run)
        return MethodRun("prompt_lookup" if lookup else "hf_generate", tokens, seconds)

    def run_method(self, method: str, asked: Request) -> list[MethodRun]:
        """``method`` on the prompt of ``asked`` (see ``asked``): one run, or one per acceptance rule."""
        if method in VARIANTS:
            chosen = VARIANTS[method]
            # Trees and lookup verify with the match rule only (pq would need multi-candidate
            # rejection); AR has no drafts to accept.
            rules = ("match",) if chosen.autoregressive or chosen.tree or chosen.lookup else self.rules
            # The record's name is the method asked for ("dflash_pq_tree" for rule pq), whatever
            # the block size makes of it.
            return [self._engine_run(replace(asked, variant=method, rule=rule),
                                     method if rule == "match" else f"dflash_{rule}" + method.removeprefix("dflash"))
                    for rule in rules]
        if method not in PEERS:
            raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
        resolved = self.engine.resolve(asked)
        if method == "hf_dflash":
            return [self._hf_dflash_run(resolved)]
        if method == "llama_cpp":
            return [self._llama_cpp_run(resolved)]
        return [self._hf_run(resolved, lookup=method == "prompt_lookup")]

    # ------------------------------------------------------------------------------- driver
    def run(self, prompts: Sequence[str | BenchPrompt], warmup: int = 1,
            log: Callable[[str], None] | None = None) -> list[PromptRecord]:
        """One ``PromptRecord`` per answered turn: a multi-turn item (MT-Bench) gives one per
        turn, each later turn asked after the model's own answer to the one before (the AR
        answer when AR is measured, else the first method's; greedy, they are all the same)."""
        items = [BenchPrompt.of(p) if isinstance(p, str) else p for p in prompts]
        for item in items[:warmup]:
            for method in self.methods:  # compile caches, allocators, lazy inits: not timed
                self.run_method(method, self.asked(item))
        records: list[PromptRecord] = []
        total = sum(item.turns for item in items)
        for item in items:
            conversation = item
            for turn in range(item.turns):
                if turn:
                    conversation = BenchPrompt(conversation.messages + [
                        {"role": "assistant", "content": answer},
                        {"role": "user", "content": item.follow_ups[turn - 1]}])
                asked = self.asked(conversation)
                index = len(records)
                prompt_ids = self.engine.resolve(asked).prompt_ids
                record = PromptRecord(index, len(prompt_ids), prompt_ids=list(prompt_ids))
                order = self.methods[index % len(self.methods):] + self.methods[: index % len(self.methods)]
                for method in order:
                    for run in self.run_method(method, asked):
                        record.runs[run.method] = run
                records.append(record)
                reference = record.runs.get("ar") or record.runs[self.methods[0]]
                answer = self.engine.decode(reference.tokens)
                if log:
                    parts = " ".join(f"{m}={r.tokens_per_s:.1f}" for m, r in record.runs.items())
                    tau = record.runs.get("dflash").result.tau if "dflash" in record.runs else float("nan")
                    log(f"[{index + 1}/{total}] tok/s {parts} tau={tau:.2f}")
        return records


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b and b == b and a == a else None


def fastest_variant(tokens_per_s: dict[str, float], decode_tokens_per_s: dict[str, float] | None = None) -> dict[str, Any]:
    """The fastest DFlash variant of a run and its speed against each peer (the variants are
    settings a user can pick); empty when the run measured no DFlash variant. Against llama.cpp
    the ratio is of decode speeds (prefill excluded, as llama.cpp users measure it) when given."""
    measured = {m: v for m, v in tokens_per_s.items() if (m == "dflash" or m.startswith("dflash_")) and v == v}
    if not measured:
        return {}
    best = max(measured, key=measured.get)
    out = {"fastest_variant": best, **{f"fastest_variant_vs_{peer}": _ratio(measured[best], tokens_per_s.get(peer, float("nan")))
                                       for peer in ("ar", "hf_generate", "prompt_lookup", "hf_dflash")}}
    decode = decode_tokens_per_s or {}
    out["fastest_variant_vs_llama_cpp"] = _ratio(decode.get(best, float("nan")), decode.get("llama_cpp", float("nan")))
    return out


def _median_prompt_ratios(records: list[PromptRecord], methods: list[str], peer: str) -> dict[str, float | None]:
    """Per method, the median over prompts of its decode tokens/s over ``peer``'s on that prompt."""
    def decode_speed(run: MethodRun) -> float:
        return max(len(run.tokens) - 1, 0) / run.decode_seconds if run.decode_seconds else float("nan")

    out: dict[str, float | None] = {}
    for m in methods:
        ratios = [decode_speed(r.runs[m]) / decode_speed(r.runs[peer]) for r in records if m in r.runs and peer in r.runs]
        ratios = [x for x in ratios if math.isfinite(x)]
        out[m] = round(statistics.median(ratios), 4) if ratios else None
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs part (the shorter length if one is a prefix
    of the other); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(records: list[PromptRecord], block_size: int, temperature: float) -> dict[str, Any]:
    """Aggregate throughput (total tokens / total time per method), ratios, tau, losslessness."""
    methods = sorted({m for r in records for m in r.runs})
    totals = {m: (sum(len(r.runs[m].tokens) for r in records if m in r.runs),
                  sum(r.runs[m].seconds for r in records if m in r.runs)) for m in methods}
    tps = {m: (t / s if s > 0 else float("nan")) for m, (t, s) in totals.items()}
    summary: dict[str, Any] = {"prompts": len(records), "tokens_per_s": {m: round(v, 3) for m, v in tps.items()}}
    # Decode speed, prefill excluded: tokens after the first over the time from the first to the
    # last, for the methods that time their first token (engine methods, hf_dflash, llama_cpp).
    timed = [m for m in methods if all(r.runs[m].decode_seconds is not None for r in records if m in r.runs)]
    decode_totals = {m: (sum(max(len(r.runs[m].tokens) - 1, 0) for r in records if m in r.runs),
                         sum(r.runs[m].decode_seconds for r in records if m in r.runs)) for m in timed}
    dtps = {m: (t / s if s > 0 else float("nan")) for m, (t, s) in decode_totals.items()}
    summary["decode_tokens_per_s"] = {m: round(v, 3) for m, v in dtps.items()}
    histogram = [0] * block_size
    draft_s = verify_s = 0.0
    cycles = 0
    lengths: list[int] = []
    for r in records:
        run = r.runs.get("dflash")
        if run is None or run.result is None:
            continue
        for c in run.result.cycles:
            if c.drafted:
                lengths.append(c.accept_len)
                histogram[min(c.accept_len, block_size) - 1] += 1
            draft_s += c.draft_s
            verify_s += c.verify_s
            cycles += 1
    summary["tau"] = round(sum(lengths) / len(lengths), 4) if lengths else None
    for variant in [m for m in methods if m.startswith("dflash_")]:
        variant_lengths = [c.accept_len for r in records if variant in r.runs for c in r.runs[variant].result.cycles if c.drafted]
        summary[f"tau_{variant.removeprefix('dflash_')}"] = round(sum(variant_lengths) / len(variant_lengths), 4) if variant_lengths else None
        summary[f"speedup_{variant}_vs_ar"] = _ratio(tps.get(variant, float("nan")), tps.get("ar", float("nan")))
    summary["acceptance_histogram"] = histogram
    summary["mean_draft_ms"] = round(1000 * draft_s / cycles, 3) if cycles else None
    summary["mean_verify_ms"] = round(1000 * verify_s / cycles, 3) if cycles else None
    d = tps.get("dflash", float("nan"))
    summary["speedup_vs_ar"] = _ratio(d, tps.get("ar", float("nan")))
    summary["speedup_vs_hf_generate"] = _ratio(d, tps.get("hf_generate", float("nan")))
    summary["speedup_vs_prompt_lookup"] = _ratio(d, tps.get("prompt_lookup", float("nan")))
    summary["ar_vs_hf_generate"] = _ratio(tps.get("ar", float("nan")), tps.get("hf_generate", float("nan")))
    # transformers' own DFlash loop with the same drafter: its tau and our speed against it.
    hf_lengths = [n for r in records if "hf_dflash" in r.runs for n in (r.runs["hf_dflash"].lengths or [])]
    summary["tau_hf_dflash"] = round(sum(hf_lengths) / len(hf_lengths), 4) if hf_lengths else None
    summary["speedup_vs_hf_dflash"] = _ratio(d, tps.get("hf_dflash", float("nan")))
    # Where its text equals ours, both loops drafted from the same contexts with the same drafter,
    # so the two taus should agree there (left: its full-vocabulary drafts, the end of the budget).
    shared = [r for r in records if "hf_dflash" in r.runs and "dflash" in r.runs
              and r.runs["hf_dflash"].tokens == r.runs["dflash"].tokens]
    ours_shared = [c.accept_len for r in shared for c in r.runs["dflash"].result.cycles if c.drafted]
    theirs_shared = [n for r in shared for n in (r.runs["hf_dflash"].lengths or [])]
    summary["tau_on_shared_text"] = ({"prompts": [r.index for r in shared],
                                      "ours": round(sum(ours_shared) / len(ours_shared), 4),
                                      "hf_dflash": round(sum(theirs_shared) / len(theirs_shared), 4)}
                                     if ours_shared and theirs_shared and temperature == 0 else None)
    # llama.cpp on the same GGUF: every method's decode speed against it (prefill excluded).
    llama = dtps.get("llama_cpp")
    summary["speedup_vs_llama_cpp"] = ({m: _ratio(v, llama) for m, v in dtps.items() if m != "llama_cpp"}
                                       if llama is not None else None)
    # The same per prompt, then the median: one prompt that stalled on a shared machine (seconds
    # lost to another tenant) moves the totals' ratio a lot and this one little.
    summary["median_prompt_ratio_vs_llama_cpp"] = (_median_prompt_ratios(records, [m for m in timed if m != "llama_cpp"], "llama_cpp")
                                                   if llama is not None else None)
    summary.update(fastest_variant(tps, dtps))
    # Greedy, every DFlash variant (chain, adaptive, tree) must reproduce the AR output exactly.
    variants = [m for m in methods if m == "dflash" or m.startswith("dflash_")]
    by_variant = {v: [r.index for r in records if v in r.runs and "ar" in r.runs and r.runs[v].tokens != r.runs["ar"].tokens]
                  for v in variants}
    mismatches = sorted({i for indices in by_variant.values() for i in indices})
    summary["lossless_checked"] = temperature == 0 and bool(variants) and "ar" in methods
    summary["lossless"] = (not mismatches) if summary["lossless_checked"] else None
    summary["mismatched_prompts"] = mismatches
    summary["mismatched_by_method"] = {v: i for v, i in by_variant.items() if i} if summary["lossless_checked"] else None
    hf_diff = [r.index for r in records if "hf_generate" in r.runs and "ar" in r.runs and r.runs["hf_generate"].tokens != r.runs["ar"].tokens]
    summary["ar_differs_from_hf_generate"] = hf_diff if temperature == 0 else None
    # Peers on other numerics part from our greedy AR at near-ties: where (prompt -> first token
    # index that differs). hf_dflash runs transformers' forward on our weights; llama_cpp runs Q4_1
    # natively where we run it dequantized.
    for peer in ("hf_dflash", "llama_cpp"):
        parted = {r.index: first_difference(r.runs[peer].tokens, r.runs["ar"].tokens)
                  for r in records if peer in r.runs and "ar" in r.runs}
        compared = temperature == 0 and bool(parted)
        summary[f"{peer}_differs_from_ar"] = {i: at for i, at in parted.items() if at is not None} if compared else None
        summary[f"{peer}_compared_prompts"] = len(parted) if compared else None
    return summary
