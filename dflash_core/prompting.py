"""From user text to prompt token ids, with the checks every front end shares.

A prompt becomes a user message in the target's chat template unless ``raw`` is asked for.
``enable_thinking`` (True/False) is handed to a template that has that switch (Qwen3-style); None
leaves the template's own default. A template without the switch refuses an explicit value rather
than ignore it silently.
Limits for public deployments come from the environment:

* ``DFLASH_MAX_PROMPT_CHARS`` (default 32,000) — longest prompt text accepted;
* ``DFLASH_MAX_PROMPT_TOKENS`` (default: the target's context) — longest tokenised prompt;
* ``DFLASH_MAX_NEW_TOKENS`` (default 2,048) — most tokens one request may generate.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .errors import PromptError, SettingsError

_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"environment variable {name}={raw!r} must be an integer") from None
    if value < 1:
        raise SettingsError(f"environment variable {name}={raw!r} must be >= 1")
    return value


def max_prompt_chars() -> int:
    return env_int("DFLASH_MAX_PROMPT_CHARS", 32_000)


def max_new_tokens_limit() -> int:
    return env_int("DFLASH_MAX_NEW_TOKENS", 2048)


def check_prompt_text(prompt: Any) -> str:
    """The prompt as a clean ``str``, or a ``PromptError`` saying what is wrong with it."""
    if not isinstance(prompt, str):
        raise PromptError(f"the prompt must be text, got {type(prompt).__name__}")
    if not prompt.strip():
        raise PromptError("the prompt is empty: type a question or an instruction")
    match = _LONE_SURROGATE.search(prompt)
    if match:
        raise PromptError(
            f"the prompt contains invalid Unicode (a lone surrogate U+{ord(match.group()):04X} at character "
            f"{match.start()}); remove it or paste the text again"
        )
    limit = max_prompt_chars()
    if len(prompt) > limit:
        raise PromptError(f"the prompt has {len(prompt):,} characters; the limit is {limit:,} (DFLASH_MAX_PROMPT_CHARS)")
    return prompt


def has_thinking_switch(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads ``enable_thinking`` (Qwen3-style thinking mode)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates
        template = " ".join(str(t) for t in template.values())
    return "enable_thinking" in str(template or "")


def thinking_kwargs(tokenizer: Any, enable_thinking: bool | None) -> dict[str, Any]:
    """The ``apply_chat_template`` keyword arguments for a thinking choice (None: none at all)."""
    if enable_thinking is None:
        return {}
    if not isinstance(enable_thinking, bool):
        raise SettingsError(f"enable_thinking = {enable_thinking!r}; allowed: true, false, or leave it unset")
    if not has_thinking_switch(tokenizer):
        raise SettingsError("this target's chat template has no thinking switch (enable_thinking): leave thinking "
                            "unset for it")
    return {"enable_thinking": enable_thinking}


def encode_prompt(
    tokenizer: Any, prompt: str, raw: bool = False, system: str | None = None, enable_thinking: bool | None = None
) -> list[int]:
    """Token ids for ``prompt``: a chat-templated user message, or the text as is (``raw``).
    ``enable_thinking``: the template's thinking switch (None: the template's default)."""
    prompt = check_prompt_text(prompt)
    if raw or not getattr(tokenizer, "chat_template", None):
        if enable_thinking is not None:
            raise SettingsError("thinking on/off applies to chat-templated prompts; this prompt is used as is "
                                "(raw, or a target without a chat template): leave thinking unset")
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return template_ids(tokenizer, messages, enable_thinking)
    ids = list(ids)
    if not ids:
        raise PromptError("the prompt encodes to no tokens")
    return ids


def template_ids(tokenizer: Any, messages: list[dict[str, str]], enable_thinking: bool | None = None) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ready for the next answer."""
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            **thinking_kwargs(tokenizer, enable_thinking))
    except SettingsError:
        raise
    except Exception as exc:  # jinja's TemplateError and the template's own raise_exception()
        raise PromptError(f"the target's chat template refused these messages: {exc}") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    if not ids:
        raise PromptError("the messages encode to no tokens")
    return ids


def check_fits_context(prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """Refuse a request whose prompt plus answer cannot fit the target's context window."""
    limit = min(context, env_int("DFLASH_MAX_PROMPT_TOKENS", context))
    if prompt_tokens > limit or prompt_tokens >= context:
        raise PromptError(
            f"the prompt is {prompt_tokens:,} tokens; the target accepts at most {min(limit, context - 1):,}: shorten it"
        )
    if prompt_tokens + max_new_tokens > context:
        raise PromptError(
            f"the prompt ({prompt_tokens:,} tokens) plus max_new_tokens ({max_new_tokens:,}) exceeds the target's "
            f"context of {context:,} tokens: shorten the prompt or lower max_new_tokens to at most "
            f"{context - prompt_tokens:,}"
        )


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """Ids that end generation: the tokenizer's EOS plus the model's generation-config EOS ids."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(i) for i in eos)
    return sorted(ids)
