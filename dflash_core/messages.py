"""A conversation (a list of ``{role, content}`` messages) to prompt token ids through the
target's chat template: what the OpenAI server's chat requests and the bench's multi-turn
records (mt-bench) share. A single prompt text goes through ``prompting.encode_prompt``."""

from __future__ import annotations

from typing import Any

from .errors import PromptError
from .prompting import check_prompt_text, template_ids


def encode_messages(tokenizer: Any, messages: list[dict[str, str]], thinking: bool | None = None) -> list[int]:
    """Token ids of ``messages`` through the target's chat template, ready for the next answer."""
    # The conversation's text gets the checks a single prompt gets (empty, invalid Unicode, length).
    check_prompt_text("\n".join(m["content"] for m in messages))
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if not template:
        raise PromptError("this target has no chat template, so it cannot take a conversation: send the prompt "
                          "text as is instead (/v1/completions, or a 'prompt' record)")
    return template_ids(tokenizer, messages, thinking)
