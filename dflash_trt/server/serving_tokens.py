"""`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info` in vLLM's shapes, so clients that count tokens
(lm-eval's remote tokenizer, load generators) use the served tokenizer instead of fetching one from a model hub."""

from __future__ import annotations

from dflash_trt.server.errors import error
from dflash_trt.server.generation import Served
from dflash_trt.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from dflash_trt.server.serving_chat import render
from dflash_trt.server.serving_common import unknown_model


async def tokenize(served: Served, request: TokenizeRequest) -> TokenizeResponse | ErrorResponse:
    """A prompt's token ids as /v1/completions would send it to the engine (special tokens added unless
    `add_special_tokens` is false), or messages' ids as /v1/chat/completions would (rendered, none added)."""
    refused = unknown_model(served, request.model)
    if refused is not None:
        return refused
    if (request.prompt is None) == (request.messages is None):
        return error("send exactly one of prompt and messages", "prompt")
    tokenizer = served.tokenizer
    if request.messages is not None:
        kwargs = {"add_generation_prompt": request.add_generation_prompt, **(request.chat_template_kwargs or {})}
        text = await served.prompts.run(render, tokenizer, request.messages, kwargs)
        if isinstance(text, ErrorResponse):
            return text
        param, special = "messages", bool(request.add_special_tokens)
    else:
        text, param, special = request.prompt or "", "prompt", request.add_special_tokens is not False
    ids = await served.prompts.encode(text, param, add_special_tokens=special)  # off the loop, as prompts are
    if isinstance(ids, ErrorResponse):
        return ids
    strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=served.limits.max_seq_len, tokens=ids, token_strs=strs)


async def detokenize(served: Served, request: DetokenizeRequest) -> DetokenizeResponse | ErrorResponse:
    """Token ids as text, special tokens included, so that it reverses /tokenize."""
    refused = unknown_model(served, request.model)
    if refused is not None:
        return refused
    vocab = served.limits.vocab_size or len(served.tokenizer)  # a Triton target may not say its vocabulary
    if any(not 0 <= token < vocab for token in request.tokens):
        return error(f"tokens must lie in [0, {vocab - 1}]", "tokens")
    return DetokenizeResponse(prompt=served.tokenizer.decode(request.tokens))


def tokenizer_info(served: Served) -> TokenizerInfo:
    tokenizer = served.tokenizer
    special = {name: getattr(tokenizer, name, None) for name in ("eos_token", "bos_token", "pad_token", "unk_token")}
    return TokenizerInfo(
        tokenizer_class=type(tokenizer).__name__,
        **{name: value if isinstance(value, str) else None for name, value in special.items()},
        chat_template=getattr(tokenizer, "chat_template", None) or None,
        model_max_length=served.limits.max_seq_len,
    )
