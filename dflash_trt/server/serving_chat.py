"""`POST /v1/chat/completions`: messages rendered with the tokenizer's chat template, one choice out.

The template runs in `transformers`' sandboxed Jinja environment; `chat_template_kwargs` (e.g. `enable_thinking`)
reach it as template variables. The rendered text holds the template's special tokens, so it is tokenized without
adding more. Rendering and tokenizing run off the event loop (`tokenizing.PromptTokenizer`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from dflash_trt.server import sse
from dflash_trt.server.engine_client import ExecutorError
from dflash_trt.server.errors import SERVER_ERROR, error
from dflash_trt.server.generation import Generation, Served
from dflash_trt.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaMessage,
    ErrorResponse,
)
from dflash_trt.server.serving_common import joined, response_id, start_generation, usage_of

# Arguments of apply_chat_template that decide what it returns, not what the template sees.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tokenize", "return_dict", "return_tensors", "tokenizer_kwargs", "chat_template"}
)


async def prompt_ids(served: Served, request: ChatCompletionRequest) -> list[int] | ErrorResponse:
    """The prompt's token ids: the messages rendered, then tokenized, both in the tokenizer's worker thread."""
    text = await served.prompts.run(render, served.tokenizer, request.messages, request.chat_template_kwargs)
    if isinstance(text, ErrorResponse):
        return text
    return await served.prompts.encode(text, "messages", add_special_tokens=False)


def render(tokenizer: Any, messages: list[ChatMessage], template_kwargs: dict[str, Any] | None) -> str | ErrorResponse:
    """The prompt's text; 400 when the tokenizer has no chat template or the template refuses the messages."""
    if not getattr(tokenizer, "chat_template", None):
        return error(
            "the tokenizer has no chat template, so chat messages cannot be turned into a prompt; use "
            "/v1/completions, or start serve with --chat_template FILE",
            "messages",
        )
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        return error(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    kwargs.setdefault("add_generation_prompt", True)
    entries = []
    for message in messages:
        entry = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            entry["content"] = "\n".join(part.text for part in message.content)
        entries.append(entry)
    try:
        return tokenizer.apply_chat_template(entries, tokenize=False, **kwargs)
    except Exception as exc:  # a Jinja template's own refusals (raise_exception) and errors: the messages' fault
        detail = " ".join(str(exc).split())[:300] or type(exc).__name__
        return error(f"the chat template cannot render these messages: {detail}", "messages")


async def create_chat_completion(
    served: Served, request: ChatCompletionRequest
) -> ChatCompletionResponse | sse.EventStream | ErrorResponse:
    ids = await prompt_ids(served, request)
    if isinstance(ids, ErrorResponse):
        return ids
    generation = start_generation(served, request, ids, "messages")
    if isinstance(generation, ErrorResponse):
        return generation
    head: dict[str, Any] = {
        "id": response_id("chatcmpl"),
        "created": int(time.time()),
        "model": served.model_name,
    }
    with_ids = bool(request.return_token_ids)
    if request.stream:
        options = request.stream_options
        usage = bool(options and options.include_usage)
        each = usage and bool(options and options.continuous_usage_stats)
        return sse.EventStream(chat_stream(generation, head, usage, each, with_ids), generation.close)
    try:
        pieces = [piece async for piece in generation.pieces()]
    except ExecutorError as exc:
        return error(f"the engine failed the request: {exc}", status=SERVER_ERROR)
    text, token_ids = joined(pieces, with_ids)
    message = AssistantMessage(content=text)
    choice = ChatChoice(message=message, finish_reason=generation.finish_reason, token_ids=token_ids)
    return ChatCompletionResponse(**head, choices=[choice], usage=usage_of(generation))


async def chat_stream(
    generation: Generation, head: dict[str, Any], include_usage: bool, usage_each: bool, with_ids: bool
) -> AsyncIterator[str]:
    """Chunks as the engine answers; with `usage_each` (vLLM's continuous_usage_stats) every chunk also carries
    the usage so far."""

    def chunk(delta: DeltaMessage, finish_reason: str | None = None, token_ids: list[int] | None = None) -> str:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason, token_ids=token_ids)
        usage = usage_of(generation) if usage_each else None
        return sse.event(ChatCompletionChunk(**head, choices=[choice], usage=usage))

    yield chunk(DeltaMessage(role="assistant", content=""))
    try:
        async for piece in generation.pieces():
            if piece.text or with_ids and piece.token_ids:
                yield chunk(DeltaMessage(content=piece.text), token_ids=piece.token_ids if with_ids else None)
    except ExecutorError as exc:
        yield sse.event(error(f"the engine failed the request: {exc}", status=SERVER_ERROR))
        yield sse.DONE
        return
    yield chunk(DeltaMessage(), generation.finish_reason)
    if include_usage:
        yield sse.event(ChatCompletionChunk(**head, choices=[], usage=usage_of(generation)))
    yield sse.DONE
