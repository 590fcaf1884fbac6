"""The ``llama_cpp`` peer: llama.cpp (through llama-cpp-python) on the same GGUF file.

What a CPU user runs instead of us. It gets exactly the prompt token ids our engine encodes (the
chat template applied by our tokenizer; ``tests/test_llama_cpp_peer.py`` checks that llama.cpp's
own tokenizer gives the same ids for the templated text), greedy decoding (temperature 0, top-k 1,
no repetition penalty), and the bench's thread count. llama.cpp computes Q4_1 natively while we run
the GGUF dequantized, so its greedy text may part from ours at near-ties: the bench counts how often.

Timing: ``seconds`` is end to end (prefill included, like every other method); ``decode_seconds``
runs from the first generated token to the last, so the prefill is excluded there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..errors import DFlashError

INSTALL_HINT = "run `make peers` (or `pip install -e '.[peers]'`; it builds llama-cpp-python from source once)"


class PeerUnavailableError(DFlashError):
    """A bench peer that cannot run here (not installed, or the target is not a GGUF file)."""


def import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:
        raise PeerUnavailableError(f"the llama_cpp bench method needs llama-cpp-python, which is not installed: "
                                   f"{INSTALL_HINT}") from exc
    return llama_cpp


@dataclass
class LlamaCppRun:
    token_ids: list[int]
    seconds: float  # end to end: prefill and decode
    decode_seconds: float  # first generated token to the last (prefill excluded)


class LlamaCppPeer:
    """One llama.cpp context on ``gguf``, reused for every prompt (reset between prompts, so no
    prompt's prefill is served from the previous one's cache)."""

    def __init__(self, gguf: str | Path, threads: int, n_ctx: int = 4096) -> None:
        llama_cpp = import_llama_cpp()
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   verbose=False)

    def tokenize_templated(self, text: str) -> list[int]:
        """llama.cpp's own ids for an already templated text (special tokens parsed, no BOS added:
        the template writes its own)."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> LlamaCppRun:
        if len(prompt_ids) + max_new_tokens > self.llm.n_ctx():
            raise PeerUnavailableError(f"llama_cpp: {len(prompt_ids)} prompt + {max_new_tokens} new tokens exceed its "
                                       f"context of {self.llm.n_ctx()}")
        self.llm.reset()
        stops = set(stop_ids)
        tokens: list[int] = []
        began = time.perf_counter()
        first = began
        # Greedy: llama-cpp-python samples with llama.cpp's greedy sampler when temp == 0; top_k 1 and
        # repeat_penalty 1.0 make sure no other sampler stage changes the argmax.
        for token in self.llm.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                       repeat_penalty=1.0, reset=True):
            if not tokens:
                first = time.perf_counter()
            tokens.append(int(token))
            # Our loop stops on a stop id and emits it (as transformers' generate does), so keep it too.
            if token in stops or len(tokens) >= max_new_tokens:
                break
        end = time.perf_counter()
        return LlamaCppRun(tokens, end - began, end - first)
