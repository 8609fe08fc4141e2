"""Server-sent events as OpenAI streams them: one `data:` line per JSON chunk, ending with `data: [DONE]`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"


def event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


@dataclass(frozen=True)
class EventStream:
    """A streamed answer: its events, and what to call once the response is over however it ended (a client that
    leaves before the first event never starts `events`, so its request is released here)."""

    events: AsyncIterator[str]
    close: Callable[[], None]
