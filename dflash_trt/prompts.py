"""Prompt files: one JSON object per line, `{"input_ids": [...]}` or `{"text": "..."}` (needs a tokenizer).

`generate` and calibration read the same format, so they share this reader and its error messages.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_trt.errors import DFlashTrtError

# Per-request options other tools accept on a prompt line. Options here apply to a whole run, so a line carrying
# one is refused: ignoring it would run something other than what the file asks for. Other keys (an id, a source)
# are metadata and pass.
PER_LINE_OPTIONS = frozenset({
    "max_new_tokens", "max_tokens", "output_len", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
    "end_id", "ignore_eos", "block_size", "num_beams", "beam_width", "sampling_params", "logprobs",
})


def read_prompts(path: str | Path, tokenizer=None, limit: int | None = None) -> list[list[int]]:
    """Token ids of each prompt line (`input_ids` or `text`, not both)."""
    path = Path(path)
    if path.is_dir():
        raise DFlashTrtError(f"prompt file {path} is a directory")
    if not path.is_file():
        raise DFlashTrtError(f"prompt file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DFlashTrtError(f"prompt file {path} is not UTF-8 text (byte {exc.start} cannot be decoded)") from None
    prompts: list[list[int]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if limit is not None and len(prompts) >= limit:
            break
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DFlashTrtError(f"{path}:{number} is not valid JSON: {exc.msg}") from None
        except RecursionError:
            raise DFlashTrtError(f"{path}:{number} is nested too deeply") from None
        if isinstance(record, dict) and PER_LINE_OPTIONS & set(record):
            option = sorted(PER_LINE_OPTIONS & set(record))[0]
            raise DFlashTrtError(f"{path}:{number}: per-prompt option '{option}' is not supported; set it for the "
                                 "whole run on the command line")
        if isinstance(record, dict) and "input_ids" in record and "text" in record:
            raise DFlashTrtError(f"{path}:{number} gives both input_ids and text; keep one")
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
