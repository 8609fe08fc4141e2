"""One request's run through the engine, shared by both endpoints: tokens in, text pieces out, metrics recorded.

The request is admitted when the `Generation` is made (QueueFull when there is no room) and leaves the executor when
`pieces` ends for any reason: its final response, a stop, an error, or the client going away (the generator is
closed, and `EngineClient.close` cancels the request in the executor).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from dflash_trt.server.detokenizer import LENGTH, STOP, TextStream
from dflash_trt.server.engine_client import EngineClient
from dflash_trt.server.metrics import Metrics
from dflash_trt.server.params import Admission, Limits
from dflash_trt.server.tokenizing import PromptTokenizer


@dataclass
class Served:
    """What every endpoint needs: the engine, its tokenizer and limits, the served name and the metrics."""

    client: EngineClient
    tokenizer: Any
    limits: Limits
    model_name: str
    metrics: Metrics
    eos_token_ids: frozenset[int]  # the model's: end a request unless it sends ignore_eos
    engine_stops_at_eos: bool  # False when serve runs with --ignore_eos: only this server stops at EOS
    created: int = 0
    prompts: PromptTokenizer = field(init=False)  # the tokenizer's worker thread and the prompt length bound

    def __post_init__(self) -> None:
        self.prompts = PromptTokenizer(self.tokenizer, self.limits.max_seq_len)


@dataclass(frozen=True)
class Piece:
    """What one engine response adds: its sendable text (maybe empty) and its tokens up to a stop token."""

    text: str
    token_ids: list[int]


class Generation:
    def __init__(self, served: Served, admitted: Admission):
        request = admitted.request
        self.served = served
        self.prompt_tokens = len(request.input_ids)
        self.max_tokens = request.max_new_tokens
        self.arrived = time.perf_counter()
        self.text = TextStream(served.tokenizer, request.input_ids, admitted.stop, admitted.stop_token_ids)
        self.request_id = served.client.open(request)
        served.metrics.prompt_tokens.inc(self.prompt_tokens)

    @property
    def completion_tokens(self) -> int:
        return self.text.completion_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.text.finish_reason

    async def pieces(self) -> AsyncIterator[Piece]:
        """One piece per engine response with tokens, and one for text held back to the end; afterwards
        `finish_reason` is "stop" or "length". Raises ExecutorError."""
        metrics, text = self.served.metrics, self.text
        last = None
        try:
            async for tokens in self.served.client.responses(self.request_id):
                if not tokens:
                    continue
                now = time.perf_counter()
                if last is None:
                    metrics.time_to_first_token.observe(now - self.arrived)
                else:
                    metrics.inter_token_latency.observe(now - last)
                    metrics.acceptance_length.observe(len(tokens))
                last = now
                metrics.output_tokens.inc(len(tokens))
                counted = text.completion_tokens
                piece = text.add(tokens)
                yield Piece(piece, tokens[: text.completion_tokens - counted])
                if text.finish_reason is not None:
                    return
            rest = text.finish()
            if text.finish_reason is None:
                text.finish_reason = LENGTH if text.completion_tokens >= self.max_tokens else STOP
            if rest:
                yield Piece(rest, [])
        finally:
            self.close()

    def close(self) -> None:
        """Release the request (cancelled in the executor if it still runs there); closing twice is harmless."""
        self.served.client.close(self.request_id)
