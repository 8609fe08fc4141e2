"""Server-sent events as OpenAI streams them: one `data:` line per JSON chunk, ending with `data: [DONE]`."""

from __future__ import annotations

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"


def event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"
