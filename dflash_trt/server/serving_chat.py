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
    text = await served.prompts.run(render, served.tokenizer, request)
    if isinstance(text, ErrorResponse):
        return text
    return await served.prompts.encode(text, "messages", add_special_tokens=False)


def render(tokenizer: Any, request: ChatCompletionRequest) -> str | ErrorResponse:
    """The prompt's text; 400 when the tokenizer has no chat template or the template refuses the messages."""
    if not getattr(tokenizer, "chat_template", None):
        return error(
            "the tokenizer has no chat template, so chat messages cannot be turned into a prompt; use "
            "/v1/completions, or serve a --tokenizer_dir whose tokenizer_config.json has a chat_template",
            "messages",
        )
    kwargs: dict[str, Any] = dict(request.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        return error(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    kwargs.setdefault("add_generation_prompt", True)
    messages = []
    for message in request.messages:
        entry = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            entry["content"] = "\n".join(part.text for part in message.content)
        messages.append(entry)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
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
        usage = bool(request.stream_options and request.stream_options.include_usage)
        return sse.EventStream(chat_stream(generation, head, usage, with_ids), generation.close)
    try:
        pieces = [piece async for piece in generation.pieces()]
    except ExecutorError as exc:
        return error(f"the engine failed the request: {exc}", status=SERVER_ERROR)
    text, token_ids = joined(pieces, with_ids)
    message = AssistantMessage(content=text)
    choice = ChatChoice(message=message, finish_reason=generation.finish_reason, token_ids=token_ids)
    return ChatCompletionResponse(**head, choices=[choice], usage=usage_of(generation))


def _chunk(
    head: dict[str, Any], delta: DeltaMessage, finish_reason: str | None = None, token_ids: list[int] | None = None
) -> str:
    choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason, token_ids=token_ids)
    return sse.event(ChatCompletionChunk(**head, choices=[choice]))


async def chat_stream(
    generation: Generation, head: dict[str, Any], include_usage: bool, with_ids: bool
) -> AsyncIterator[str]:
    yield _chunk(head, DeltaMessage(role="assistant", content=""))
    try:
        async for piece in generation.pieces():
            if piece.text or with_ids and piece.token_ids:
                yield _chunk(head, DeltaMessage(content=piece.text), token_ids=piece.token_ids if with_ids else None)
    except ExecutorError as exc:
        yield sse.event(error(f"the engine failed the request: {exc}", status=SERVER_ERROR))
        yield sse.DONE
        return
    yield _chunk(head, DeltaMessage(), generation.finish_reason)
    if include_usage:
        yield sse.event(ChatCompletionChunk(**head, choices=[], usage=usage_of(generation)))
    yield sse.DONE
