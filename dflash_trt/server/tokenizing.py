"""Prompt text turned into token ids off the event loop, after a length check that needs no tokenizing.

Tokenizing is the costly step of admitting a text prompt: measured on the tiny pair's tokenizer, a 7.9 MB prompt
took 7 s and raised the server's memory by 1.4 GiB, and on the event loop it stalled every other request and
stream for that long. So:

- A text longer than `max_chars` = max_seq_len × `chars_per_token` is refused at once: each token spells at most
  the vocabulary's longest entry (added tokens included), so such a text tokenizes to more than max_seq_len tokens.
  A tokenizer that normalizes text first may compose up to `NORMALIZATION_RATIO` code points into one (NFC on a
  Greek letter with three marks), so its bound is that many times larger.
- Chat templates are rendered, and texts tokenized, in one worker thread: the event loop keeps serving, and at most
  one prompt's tokenization holds memory at a time.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from dflash_trt.server.errors import error
from dflash_trt.server.protocol import ErrorResponse

NORMALIZATION_RATIO = 4
Result = TypeVar("Result")


def chars_per_token(tokenizer: Any) -> int:
    """The most characters of input text one token can stand for."""
    longest = max((len(entry) for entry in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizes = backend is None or backend.normalizer is not None  # a slow tokenizer may normalize: assume so
    return longest * (NORMALIZATION_RATIO if normalizes else 1)


class PromptTokenizer:
    def __init__(self, tokenizer: Any, max_seq_len: int):
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.per_token = chars_per_token(tokenizer)
        self.max_chars = max_seq_len * self.per_token
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-trt-tokenize")

    async def run(self, work: Callable[..., Result], *args: Any) -> Result:
        """`work(*args)` in the worker thread, seeing the caller's context (the request it serves)."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self.worker, context.run, work, *args)

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int] | ErrorResponse:
        """The text's token ids (tokenized as `generate` tokenizes), or a 400 when it cannot fit."""
        if len(text) > self.max_chars:
            return error(
                f"the prompt is {len(text)} characters; a request holds at most {self.max_seq_len} tokens, which "
                f"with this tokenizer (at most {self.per_token} characters a token) spell at most "
                f"{self.max_chars} characters",
                param,
            )
        return await self.run(lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)
