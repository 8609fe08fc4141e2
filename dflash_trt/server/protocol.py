"""The OpenAI wire format `dflash-trt serve` speaks: request and response bodies, in one place.

Requests forbid unknown fields, so a parameter this server does not know is refused by name instead of being
silently dropped; parameters it knows but the engine cannot honour are declared here and refused by
`params.py`. Responses follow OpenAI's completions and chat completions objects field for field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage in every chunk too (with include_usage)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class SamplingFields(Strict):
    """What completions and chat share: sampling, stops and the parameters refused by name (params.py)."""

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # Bookkeeping that changes no token of the answer (OpenAI's and vLLM's schemas): accepted and not used.
    user: str | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's extensions: run past EOS (a server started with --ignore_eos), and each choice's token ids.
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None
    # Refused unless neutral (sampling_rules.NEUTRAL; top_k -1 is vLLM's "off"; params.UNSUPPORTED).
    n: int | None = None
    store: bool | None = None
    service_tier: str | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    priority: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    # Refused when set to anything but their neutral value.
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Refused when set to anything but their neutral value.
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None
    request_id: str | None = None  # the X-Request-Id of the request it answers


class ErrorResponse(BaseModel):
    """OpenAI's error object; the serving modules return it as a value and the app turns it into a status."""

    error: ErrorBody

    @property
    def status(self) -> int:
        return self.error.code or 400


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dflash-trt"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(Strict):
    """vLLM's `POST /tokenize` body: a prompt, or chat messages rendered with the chat template first."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: True for a prompt, False for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """vLLM's `GET /tokenizer_info`: what a client needs to tokenize and template prompts as the server does."""

    tokenizer_class: str
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None
    model_max_length: int
