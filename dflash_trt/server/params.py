"""What a completions or chat request asks of the engine, checked: its output budget, sampling and stops.

Everything the engine cannot honour is refused by name (HTTP 400), never dropped: more than one choice, log
probabilities, logit bias, tools, structured output, and every sampling parameter `sampling_rules` refuses (top-p,
top-k, penalties, ...), which reuse its words. Temperature defaults to OpenAI's 1.0; a sampled request without a
seed gets a fresh random one.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from dflash_trt.sampling_rules import MAX_SEED, NEUTRAL, sampling_refusal
from dflash_trt.server.errors import error
from dflash_trt.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, SamplingFields

DEFAULT_TEMPERATURE = 1.0  # OpenAI's

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
}


@dataclass(frozen=True)
class Limits:
    """What the served engine accepts: tokens per request (prompt + output) and the token id range."""

    max_seq_len: int
    vocab_size: int | None


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int
    temperature: float
    seed: int
    stop: list[str]
    stop_token_ids: frozenset[int]
    ignore_eos: bool


def refusal(request: SamplingFields) -> ErrorResponse | None:
    """The first parameter the engine cannot honour, as a 400 naming it; None when all can be honoured."""
    fields = request.model_fields_set
    for name, neutral in UNSUPPORTED.items():
        value = getattr(request, name, None)
        if name in fields and value is not None and value not in neutral:
            allowed = " or ".join(repr(v) for v in neutral)
            return error(f"{name} {value!r} refused: {WHY[name]}; omit it or send {allowed}", name)
    temperature = DEFAULT_TEMPERATURE if request.temperature is None else request.temperature
    for name in ("temperature", *NEUTRAL):
        value = getattr(request, name, None)
        if value is None:
            continue
        message = sampling_refusal({"temperature": temperature, name: value})
        if message is not None:
            return error(message, name)
    return None


def generation_params(
    request: CompletionRequest | ChatCompletionRequest, prompt_len: int, limits: Limits, prompt_param: str
) -> GenerationParams | ErrorResponse:
    """Budget, sampling and stops of a request whose prompt has `prompt_len` tokens (after `refusal`)."""
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
    seed = request.seed
    if seed is not None and not 0 <= seed <= MAX_SEED:
        return error(f"seed must lie in [0, {MAX_SEED}], got {seed}", "seed")
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if any(not s for s in stops):
        return error("stop strings must not be empty", "stop")
    ids = request.stop_token_ids or []
    vocab = limits.vocab_size
    if vocab is not None and any(not 0 <= i < vocab for i in ids):
        return error(f"stop_token_ids must lie in [0, {vocab - 1}]", "stop_token_ids")
    return GenerationParams(
        max_tokens=room if asked is None else asked,
        temperature=DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        seed=secrets.randbelow(MAX_SEED + 1) if seed is None else seed,
        stop=stops,
        stop_token_ids=frozenset(ids),
        ignore_eos=bool(request.ignore_eos),
    )
