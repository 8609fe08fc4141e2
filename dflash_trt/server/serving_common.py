"""What both generation endpoints check before a request reaches the engine, and the usage they report."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from dflash_trt.server.engine_client import ExecutorError, QueueFull
from dflash_trt.server.errors import NOT_FOUND, UNAVAILABLE, error
from dflash_trt.server.generation import Generation, Piece, Served
from dflash_trt.server.observability import current_request_id
from dflash_trt.server.params import Admission, admission, refusal, sampling_of
from dflash_trt.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, Usage


def unknown_model(served: Served, model: str | None) -> ErrorResponse | None:
    """404 for a request naming a model this server does not serve (naming none means the served one)."""
    if model is None or model == served.model_name:
        return None
    return error(f"model {model!r} does not exist; this server serves {served.model_name!r}", "model", NOT_FOUND)


def admit(
    served: Served, request: CompletionRequest | ChatCompletionRequest, ids: list[int], prompt_param: str
) -> Admission | ErrorResponse:
    """The model name, refused parameters, sampling, the prompt's token ids, then budget and stops."""
    refused = unknown_model(served, request.model) or refusal(request)
    if refused is not None:
        return refused
    sampling = sampling_of(request)
    if isinstance(sampling, ErrorResponse):
        return sampling
    if request.ignore_eos and served.engine_stops_at_eos:
        return error(
            "ignore_eos refused: this server's engine ends every request at EOS (the end ids are fixed when the "
            "engine's executor starts), so it would be silently ignored; start serve with --ignore_eos, after which "
            "each request chooses",
            "ignore_eos",
        )
    if not ids:
        return error("the prompt is empty", prompt_param)
    vocab = served.limits.vocab_size
    if vocab is not None and not 0 <= min(ids) <= max(ids) < vocab:
        return error(f"prompt token ids must lie in [0, {vocab - 1}]", prompt_param)
    return admission(request, ids, sampling, served.limits, prompt_param, served.eos_token_ids)


def start_generation(
    served: Served, request: CompletionRequest | ChatCompletionRequest, ids: list[int], prompt_param: str
) -> Generation | ErrorResponse:
    """The request checked (`admit`) and admitted to the engine, or the error that stops it (503 at capacity)."""
    checked = admit(served, request, ids, prompt_param)
    if isinstance(checked, ErrorResponse):
        return checked
    try:
        return Generation(served, checked)
    except QueueFull:
        return queue_full(served)


def start_generations(
    served: Served, request: CompletionRequest, prompts: list[list[int]], prompt_param: str
) -> list[Generation] | ErrorResponse:
    """Every prompt of a request checked before any is admitted (one refused prompt refuses the request, as vLLM
    does), then all admitted; 503 with none left running when the queue cannot take them all."""
    checked = []
    for ids in prompts:
        admitted = admit(served, request, ids, prompt_param)
        if isinstance(admitted, ErrorResponse):
            return admitted
        checked.append(admitted)
    generations: list[Generation] = []
    try:
        for admitted in checked:
            generations.append(Generation(served, admitted))
    except QueueFull:
        close_all(generations)
        return queue_full(served)
    return generations


async def merged_pieces(generations: list[Generation]) -> AsyncIterator[tuple[int, Piece | None]]:
    """The pieces of several generations as they come, each with its generation's index, and (index, None) when
    that generation has ended. Raises the first ExecutorError; every generation is released however this ends."""
    queue: asyncio.Queue[tuple[int, Piece | None | ExecutorError]] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for piece in generation.pieces():
                queue.put_nowait((index, piece))
            queue.put_nowait((index, None))
        except ExecutorError as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(index, generation)) for index, generation in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if isinstance(item, ExecutorError):
                raise item
            running -= item is None
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        close_all(generations)


def close_all(generations: list[Generation]) -> None:
    for generation in generations:
        generation.close()


def response_id(prefix: str) -> str:
    """The id of a completion object: its request's id, so a client's X-Request-Id finds it in the server's log."""
    return f"{prefix}-{current_request_id.get() or uuid.uuid4().hex}"


def queue_full(served: Served) -> ErrorResponse:
    client = served.client
    return error(
        f"the server is at capacity ({client.max_batch_size} requests running, {client.max_queue} queued); retry later",
        status=UNAVAILABLE,
    )


def usage_of(*generations: Generation) -> Usage:
    """The tokens of every prompt and every choice of a request (or, mid-stream, those counted so far)."""
    prompt = sum(generation.prompt_tokens for generation in generations)
    completion = sum(generation.completion_tokens for generation in generations)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def joined(pieces: list[Piece], with_ids: bool) -> tuple[str, list[int] | None]:
    """A whole answer's text, and its token ids when the request asked for them."""
    text = "".join(piece.text for piece in pieces)
    return text, [token for piece in pieces for token in piece.token_ids] if with_ids else None
