"""Chat prompts: `{"messages": [...]}` rendered with the tokenizer's own chat template, ending with the assistant's
turn (as OpenAI-style servers do), for every place a prompt enters: prompt files, Triton preprocessing.

A drafter predicts the target's output on the kind of data it was trained on. DFlash's Qwen3 drafters were
trained with thinking disabled, and thinking-mode traffic lowers their acceptance, so a template that reads
`enable_thinking` gets `enable_thinking: false` unless the caller's chat-template arguments set it.

Standalone (no other dflash_trt import): the Triton repository carries a copy next to its Python models. Errors
are ValueError with the user's message; callers add where the prompt came from.
"""

from __future__ import annotations

import json
from typing import Any

THINKING_FLAG = "enable_thinking"


def parse_template_kwargs(text: str) -> dict[str, Any]:
    """Chat-template arguments written as a JSON object, e.g. '{"enable_thinking": false}'."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object such as '{{\"{THINKING_FLAG}\": false}}', got {text!r}")
    return value


def template_kwargs(tokenizer, given: dict[str, Any] | None) -> dict[str, Any]:
    """`given`, plus enable_thinking false where the template reads it and `given` does not set it."""
    kwargs = dict(given or {})
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and THINKING_FLAG in template:
        kwargs.setdefault(THINKING_FLAG, False)
    return kwargs


def render_chat(tokenizer, messages: object, given: dict[str, Any] | None) -> str:
    """The prompt text a chat becomes under the tokenizer's chat template (rendered by transformers' sandbox)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for message in messages:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError('every message must be {"role": "...", "content": "..."}')
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; send plain text instead of messages")
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **template_kwargs(tokenizer, given)
        )
    except Exception as exc:  # the template is Jinja from the checkpoint: any of its failures is one finding
        raise ValueError(f"the tokenizer's chat template failed: {' '.join(str(exc).split())[:200]}") from None
    return str(text)


def encode_chat(tokenizer, messages: object, given: dict[str, Any] | None) -> list[int]:
    """Token ids of the rendered chat; the template writes the special tokens itself."""
    return list(tokenizer.encode(render_chat(tokenizer, messages, given), add_special_tokens=False))
