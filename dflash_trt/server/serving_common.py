"""What both generation endpoints check before a request reaches the engine, and the usage they report."""

from __future__ import annotations

import uuid

from dflash_trt.server.engine_client import QueueFull
from dflash_trt.server.errors import NOT_FOUND, UNAVAILABLE, error
from dflash_trt.server.generation import Generation, Piece, Served
from dflash_trt.server.observability import current_request_id
from dflash_trt.server.params import Admission, admission, refusal, sampling_of
from dflash_trt.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, Usage


def admit(
    served: Served, request: CompletionRequest | ChatCompletionRequest, ids: list[int], prompt_param: str
) -> Admission | ErrorResponse:
    """The model name, refused parameters, sampling, the prompt's token ids, then budget and stops."""
    if request.model is not None and request.model != served.model_name:
        return error(
            f"model {request.model!r} does not exist; this server serves {served.model_name!r}", "model", NOT_FOUND
        )
    refused = refusal(request)
    if refused is not None:
        return refused
    sampling = sampling_of(request)
    if isinstance(sampling, ErrorResponse):
        return sampling
    if request.ignore_eos and served.engine_stops_at_eos:
        return error(
            "ignore_eos refused: this server's engine stops at EOS; start serve with --ignore_eos", "ignore_eos"
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


def response_id(prefix: str) -> str:
    """The id of a completion object: its request's id, so a client's X-Request-Id finds it in the server's log."""
    return f"{prefix}-{current_request_id.get() or uuid.uuid4().hex}"


def queue_full(served: Served) -> ErrorResponse:
    client = served.client
    return error(
        f"the server is at capacity ({client.max_batch_size} requests running, {client.max_queue} queued); retry later",
        status=UNAVAILABLE,
    )


def usage_of(generation: Generation) -> Usage:
    return Usage(
        prompt_tokens=generation.prompt_tokens,
        completion_tokens=generation.completion_tokens,
        total_tokens=generation.prompt_tokens + generation.completion_tokens,
    )


def joined(pieces: list[Piece], with_ids: bool) -> tuple[str, list[int] | None]:
    """A whole answer's text, and its token ids when the request asked for them."""
    text = "".join(piece.text for piece in pieces)
    return text, [token for piece in pieces for token in piece.token_ids] if with_ids else None
