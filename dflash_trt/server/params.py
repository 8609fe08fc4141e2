"""What a completions or chat request asks of the engine, checked: its output budget, sampling and stops.

Everything the engine cannot honour is refused by name (HTTP 400), never dropped: more than one choice, log
probabilities, logit bias, tools, structured output, and every sampling parameter `sampling_rules` refuses (top-p,
top-k, penalties, ...), which reuse its words. The HTTP edge normalises sampling once into the request's `Sampling`:
temperature defaults to OpenAI's 1.0 (`DEFAULT_TEMPERATURE`), and a request without a seed gets a fresh random one.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from dflash_trt.executors.contract import Request
from dflash_trt.sampling_rules import (
    DEFAULT_TEMPERATURE,
    MAX_SEED,
    NEUTRAL,
    Sampling,
    SamplingRefused,
    request_sampling,
)
from dflash_trt.server.errors import error
from dflash_trt.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, SamplingFields

# Parameters outside sampling that the engine cannot honour, with the values that mean "not used".
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "echo": (False,),
    "suffix": ("",),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "skip_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "priority": (0,),
}
WHY = {
    "n": "the server returns one choice per request; send several requests",
    "best_of": "the server returns one choice per request",
    "logprobs": "the engine returns no log probabilities",
    "top_logprobs": "the engine returns no log probabilities",
    "echo": "the prompt is not echoed",
    "suffix": "insertion is not supported",
    "logit_bias": "the engine's runtime takes no logit bias",
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "response_format": "structured output is not supported",
    "store": "this server stores no completions",
    "service_tier": "this server has one processing tier",
    "skip_special_tokens": "the text always leaves special tokens out (return_token_ids gives every token)",
    "include_stop_str_in_output": "a stop string is never part of the text",
    "priority": "requests are served in arrival order",
}


VLLM_TOP_K_OFF = -1  # vLLM's spelling of "no top-k" (TensorRT-LLM's is 0), sent by clients written for vLLM


@dataclass(frozen=True)
class Limits:
    """What the served engine accepts: tokens per request (prompt + output) and the token id range."""

    max_seq_len: int
    vocab_size: int | None


@dataclass(frozen=True, kw_only=True)
class Admission:
    """A checked request: what the engine is asked, and where this server ends its text (stop strings, and stop
    token ids: the request's own, plus the model's EOS ids unless the request ignores EOS)."""

    request: Request
    stop: list[str]
    stop_token_ids: frozenset[int]


def refusal(request: SamplingFields) -> ErrorResponse | None:
    """The first parameter outside sampling the engine cannot honour, as a 400 naming it; None when all can be."""
    fields = request.model_fields_set
    for name, neutral in UNSUPPORTED.items():
        value = getattr(request, name, None)
        if name in fields and value is not None and value not in neutral:
            allowed = " or ".join(repr(v) for v in neutral)
            return error(f"{name} {value!r} refused: {WHY[name]}; omit it or send {allowed}", name)
    return None


def sampling_of(request: SamplingFields) -> Sampling | ErrorResponse:
    """The request's sampling, normalised once (OpenAI's default temperature, a fresh seed when none is sent), or a
    400 naming the first sampling parameter the engine cannot honour."""
    params = {name: getattr(request, name, None) for name in ("temperature", "seed", *NEUTRAL)}
    if params["top_k"] == VLLM_TOP_K_OFF:
        params["top_k"] = None
    if params["seed"] is None:
        params["seed"] = secrets.randbelow(MAX_SEED + 1)
    try:
        return request_sampling(params, DEFAULT_TEMPERATURE)
    except SamplingRefused as exc:
        return error(str(exc), exc.param)


def admission(
    request: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    sampling: Sampling,
    limits: Limits,
    prompt_param: str,
    eos_token_ids: frozenset[int],
) -> Admission | ErrorResponse:
    """Budget and stops of a request with these prompt tokens and sampling (after `refusal` and `sampling_of`)."""
    prompt_len = len(prompt_ids)
    room = limits.max_seq_len - prompt_len
    if room < 1:
        return error(
            f"the prompt has {prompt_len} tokens; this engine takes at most {limits.max_seq_len} tokens per request "
            f"(prompt + output), so at most {limits.max_seq_len - 1} prompt tokens",
            prompt_param,
        )
    name, asked = "max_tokens", request.max_tokens
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        name, asked = "max_completion_tokens", request.max_completion_tokens
    if asked is not None and asked < 1:
        return error(f"{name} must be >= 1, got {asked}", name)
    if asked is not None and asked > room:
        return error(
            f"{name} {asked} is too large: the prompt has {prompt_len} tokens and this engine takes at most "
            f"{limits.max_seq_len} tokens per request, so {name} must be <= {room}",
            name,
        )
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if any(not s for s in stops):
        return error("stop strings must not be empty", "stop")
    ids = request.stop_token_ids or []
    vocab = limits.vocab_size
    if vocab is not None and any(not 0 <= i < vocab for i in ids):
        return error(f"stop_token_ids must lie in [0, {vocab - 1}]", "stop_token_ids")
    return Admission(
        request=Request(input_ids=prompt_ids, max_new_tokens=room if asked is None else asked, sampling=sampling),
        stop=stops,
        stop_token_ids=frozenset(ids) | (frozenset() if request.ignore_eos else eos_token_ids),
    )
