"""`POST /v1/completions`: one prompt (text or token ids) in, one choice out, whole or streamed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from dflash_trt.server import sse
from dflash_trt.server.engine_client import ExecutorError
from dflash_trt.server.errors import SERVER_ERROR, error
from dflash_trt.server.generation import Generation, Served
from dflash_trt.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
from dflash_trt.server.serving_common import joined, response_id, start_generation, usage_of


async def prompt_ids(
    served: Served, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[int] | ErrorResponse:
    """The prompt's token ids: text is tokenized as `generate` tokenizes text prompts (off the event loop)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            return error(f"prompt holds {len(prompt)} prompts; send one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await served.prompts.encode(prompt, "prompt")
    return list(prompt)  # type: ignore[arg-type]


async def create_completion(
    served: Served, request: CompletionRequest
) -> CompletionResponse | sse.EventStream | ErrorResponse:
    ids = await prompt_ids(served, request.prompt)
    if isinstance(ids, ErrorResponse):
        return ids
    generation = start_generation(served, request, ids, "prompt")
    if isinstance(generation, ErrorResponse):
        return generation
    head: dict[str, Any] = {"id": response_id("cmpl"), "created": int(time.time()), "model": served.model_name}
    with_ids = bool(request.return_token_ids)
    if request.stream:
        usage = bool(request.stream_options and request.stream_options.include_usage)
        return sse.EventStream(completion_stream(generation, head, usage, with_ids), generation.close)
    try:
        pieces = [piece async for piece in generation.pieces()]
    except ExecutorError as exc:
        return error(f"the engine failed the request: {exc}", status=SERVER_ERROR)
    text, token_ids = joined(pieces, with_ids)
    choice = CompletionChoice(text=text, finish_reason=generation.finish_reason, token_ids=token_ids)
    return CompletionResponse(**head, choices=[choice], usage=usage_of(generation))


async def completion_stream(
    generation: Generation, head: dict[str, Any], include_usage: bool, with_ids: bool
) -> AsyncIterator[str]:
    try:
        async for piece in generation.pieces():
            if piece.text or with_ids and piece.token_ids:
                choice = CompletionChoice(text=piece.text, token_ids=piece.token_ids if with_ids else None)
                yield sse.event(CompletionResponse(**head, choices=[choice]))
    except ExecutorError as exc:
        yield sse.event(error(f"the engine failed the request: {exc}", status=SERVER_ERROR))
        yield sse.DONE
        return
    yield sse.event(
        CompletionResponse(**head, choices=[CompletionChoice(text="", finish_reason=generation.finish_reason)])
    )
    if include_usage:
        yield sse.event(CompletionResponse(**head, choices=[], usage=usage_of(generation)))
    yield sse.DONE
