"""A conversation (a list of ``{role, content}`` messages) to prompt token ids through the
target's chat template: what the OpenAI server's chat requests and the bench's multi-turn
records (mt-bench) share. A single prompt text goes through ``prompting.encode_prompt``."""

from __future__ import annotations

from typing import Any

from .errors import PromptError, SettingsError
from .prompting import check_prompt_text


def encode_messages(tokenizer: Any, messages: list[dict[str, str]], thinking: bool | None = None) -> list[int]:
    """Token ids of ``messages`` through the target's chat template, ready for the next answer."""
    # The conversation's text gets the checks a single prompt gets (empty, invalid Unicode, length).
    check_prompt_text("\n".join(m["content"] for m in messages))
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if not template:
        raise PromptError("this target has no chat template, so it cannot take a conversation: send the prompt "
                          "text as is instead (/v1/completions, or a 'prompt' record)")
    kwargs: dict[str, Any] = {}
    if thinking is not None:
        # Qwen3-style templates switch thinking with ``enable_thinking``; a template without the
        # switch would silently ignore it, so say so instead.
        if "enable_thinking" not in template:
            raise SettingsError("thinking: this target's chat template has no thinking switch (enable_thinking); "
                                "leave thinking out")
        kwargs["enable_thinking"] = thinking
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    except Exception as exc:  # jinja's TemplateError and the template's own raise_exception()
        raise PromptError(f"the target's chat template refused these messages: {exc}") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    if not ids:
        raise PromptError("the messages encode to no tokens")
    return ids
