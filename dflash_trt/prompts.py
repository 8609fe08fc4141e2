"""Prompt files: one JSON object per line, `{"input_ids": [...]}` or `{"text": "..."}` (needs a tokenizer).

`generate` and calibration read the same format, so they share this reader and its error messages.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_trt.errors import DFlashTrtError


def read_prompts(path: str | Path, tokenizer=None, limit: int | None = None) -> list[list[int]]:
    path = Path(path)
    if not path.is_file():
        raise DFlashTrtError(f"prompt file {path} does not exist")
    prompts: list[list[int]] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if limit is not None and len(prompts) >= limit:
            break
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DFlashTrtError(f"{path}:{number} is not valid JSON: {exc.msg}") from None
        if isinstance(record, dict) and isinstance(record.get("input_ids"), list):
            ids = record["input_ids"]
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise DFlashTrtError(f"{path}:{number}: input_ids must be a non-empty list of integers")
            prompts.append(ids)
        elif isinstance(record, dict) and isinstance(record.get("text"), str):
            if tokenizer is None:
                raise DFlashTrtError(f"{path}:{number} gives text but the checkpoint directory has no tokenizer")
            prompts.append(tokenizer.encode(record["text"]))
        else:
            raise DFlashTrtError(f'{path}:{number} must be {{"input_ids": [...]}} or {{"text": "..."}}')
    if not prompts:
        raise DFlashTrtError(f"prompt file {path} holds no prompts")
    return prompts
