"""`POST /v1/completions`: one prompt (text or token ids) or a list of them in, one choice per prompt out, whole or
streamed. A list is served as vLLM serves it: every prompt is its own engine request, choice i answers prompt i,
and the usage counts them all."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from dflash_trt.server import sse
from dflash_trt.server.engine_client import ExecutorError
from dflash_trt.server.errors import SERVER_ERROR, error
from dflash_trt.server.generation import Generation, Piece, Served
from dflash_trt.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
from dflash_trt.server.serving_common import close_all, joined, merged_pieces, response_id, start_generations, usage_of


async def prompt_ids(
    served: Served, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]] | ErrorResponse:
    """Each prompt's token ids: text is tokenized as `generate` tokenizes text prompts (off the event loop); a list
    of texts or of token id lists is several prompts."""
    several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    prompts: list[Any] = list(prompt) if several else [prompt]
    ids = []
    for each in prompts:
        encoded = await served.prompts.encode(each, "prompt") if isinstance(each, str) else list(each)
        if isinstance(encoded, ErrorResponse):
            return encoded
        ids.append(encoded)
    return ids


async def create_completion(
    served: Served, request: CompletionRequest
) -> CompletionResponse | sse.EventStream | ErrorResponse:
    prompts = await prompt_ids(served, request.prompt)
    if isinstance(prompts, ErrorResponse):
        return prompts
    generations = start_generations(served, request, prompts, "prompt")
    if isinstance(generations, ErrorResponse):
        return generations
    head: dict[str, Any] = {"id": response_id("cmpl"), "created": int(time.time()), "model": served.model_name}
    with_ids = bool(request.return_token_ids)
    if request.stream:
        options = request.stream_options
        usage = bool(options and options.include_usage)
        each = usage and bool(options and options.continuous_usage_stats)
        events = completion_stream(generations, head, usage, each, with_ids)
        return sse.EventStream(events, partial(close_all, generations))
    pieces: list[list[Piece]] = [[] for _ in generations]
    try:
        async for index, piece in merged_pieces(generations):
            if piece is not None:
                pieces[index].append(piece)
    except ExecutorError as exc:
        return error(f"the engine failed the request: {exc}", status=SERVER_ERROR)
    choices = [whole_choice(index, generation, pieces[index], with_ids) for index, generation in enumerate(generations)]
    return CompletionResponse(**head, choices=choices, usage=usage_of(*generations))


def whole_choice(index: int, generation: Generation, pieces: list[Piece], with_ids: bool) -> CompletionChoice:
    text, token_ids = joined(pieces, with_ids)
    return CompletionChoice(index=index, text=text, finish_reason=generation.finish_reason, token_ids=token_ids)


async def completion_stream(
    generations: list[Generation], head: dict[str, Any], include_usage: bool, usage_each: bool, with_ids: bool
) -> AsyncIterator[str]:
    """Chunks as the engine answers; with `usage_each` (vLLM's continuous_usage_stats) every chunk also carries
    its choice's usage so far."""

    def chunk(index: int, text: str, token_ids: list[int] | None = None, finish: str | None = None) -> str:
        choice = CompletionChoice(index=index, text=text, token_ids=token_ids, finish_reason=finish)
        usage = usage_of(generations[index]) if usage_each else None
        return sse.event(CompletionResponse(**head, choices=[choice], usage=usage))

    try:
        async for index, piece in merged_pieces(generations):
            if piece is None:
                yield chunk(index, "", finish=generations[index].finish_reason)
            elif piece.text or with_ids and piece.token_ids:
                yield chunk(index, piece.text, piece.token_ids if with_ids else None)
    except ExecutorError as exc:
        yield sse.event(error(f"the engine failed the request: {exc}", status=SERVER_ERROR))
        yield sse.DONE
        return
    if include_usage:
        yield sse.event(CompletionResponse(**head, choices=[], usage=usage_of(*generations)))
    yield sse.DONE
