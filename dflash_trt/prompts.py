"""Prompt files: one JSON object per line, `{"input_ids": [...]}`, `{"text": "..."}` (needs a tokenizer) or
`{"messages": [{"role": ..., "content": ...}, ...]}` (a chat, rendered with the tokenizer's chat template and a
generation prompt by `dflash_trt.chat`); or, for calibration on hosts with the `datasets` package, a local HF
datasets folder whose rows carry one of the first two columns.

`generate` and calibration read the same format, so they share this reader and its error messages.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_trt.chat import encode_chat, parse_template_kwargs
from dflash_trt.errors import DFlashTrtError

# Folders written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` hold one of these.
SAVED_DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")
PROMPT_COLUMNS = ("text", "input_ids")
PROMPT_KEYS = ("input_ids", "text", "messages")
CHAT_TEMPLATE_KWARGS_HELP = (
    'JSON object passed to the tokenizer\'s chat template for {"messages": [...]} prompts, e.g. '
    "'{\"enable_thinking\": false}' (default: enable_thinking false where the template knows it, as the Qwen3 "
    "DFlash drafters were trained)"
)
# Per-request options other tools accept on a prompt line. Options here apply to a whole run, so a line carrying
# one is refused: ignoring it would run something other than what the file asks for. Other keys (an id, a source)
# are metadata and pass.
PER_LINE_OPTIONS = frozenset(
    {
        "max_new_tokens",
        "max_tokens",
        "output_len",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "end_id",
        "ignore_eos",
        "block_size",
        "num_beams",
        "beam_width",
        "sampling_params",
        "logprobs",
    }
)
# Text and chat prompts need a tokenizer; where a command looks for one depends on the command.
NO_TOKENIZER = "no tokenizer was found (no --tokenizer_dir was given, and the model folder holds none): send input_ids"


def _jsonl_records(path: Path) -> Iterator[tuple[str, object]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DFlashTrtError(f"prompt file {path} is not UTF-8 text (byte {exc.start} cannot be decoded)") from None
    # Lines end at "\n" only: `splitlines` would also cut at U+2028 or U+0085, which JSON strings may hold.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DFlashTrtError(f"{path}:{number} is not valid JSON: {exc.msg}") from None
        except RecursionError:
            raise DFlashTrtError(f"{path}:{number} is nested too deeply") from None
        yield f"{path}:{number}", record


def _load_dataset_folder(path: Path):
    """The folder's rows: a saved Dataset (its `train` split if it is a DatasetDict), else its data files."""
    try:
        import datasets
    except ImportError:
        raise DFlashTrtError(
            f"{path} is a folder; reading an HF datasets folder needs the `datasets` package, else give a jsonl file"
        ) from None
    try:
        if any((path / name).is_file() for name in SAVED_DATASET_FILES):
            data = datasets.load_from_disk(str(path))
        else:
            data = datasets.load_dataset(str(path))
    except Exception as exc:  # datasets raises many types for unreadable folders; report one line
        raise DFlashTrtError(f"{path} is not a readable HF datasets folder: {exc}") from None
    if isinstance(data, datasets.DatasetDict):
        split = "train" if "train" in data else next(iter(data), None)
        if split is None:
            raise DFlashTrtError(f"prompt folder {path} holds no splits")
        data = data[split]
    return data


def _dataset_records(path: Path) -> Iterator[tuple[str, object]]:
    data = _load_dataset_folder(path)
    columns = [c for c in PROMPT_COLUMNS if c in data.column_names]
    if not columns:
        raise DFlashTrtError(
            f"prompt folder {path} has no {' or '.join(PROMPT_COLUMNS)} column "
            f"(columns: {', '.join(data.column_names)})"
        )
    for index, row in enumerate(data.select_columns(columns[:1])):
        yield f"{path}[{index}]", row


def parse_chat_template_kwargs(text: str | None, flag: str = "--chat_template_kwargs") -> dict[str, Any] | None:
    """The user's chat-template arguments, or None when not given."""
    if text is None:
        return None
    try:
        return parse_template_kwargs(text)
    except ValueError as exc:
        raise DFlashTrtError(f"{flag} {exc}") from None


def _encode_chat(tokenizer, messages: object, kwargs: dict[str, Any] | None, where: str) -> list[int]:
    if tokenizer is None:
        raise DFlashTrtError(f"{where} gives messages but {NO_TOKENIZER}")
    try:
        return encode_chat(tokenizer, messages, kwargs)
    except ValueError as exc:
        raise DFlashTrtError(f"{where}: {exc}") from None


def read_prompts(
    path: str | Path, tokenizer=None, limit: int | None = None, chat_kwargs: dict[str, Any] | None = None
) -> list[list[int]]:
    """Token ids of every prompt; `chat_kwargs` go to the chat template of `{"messages": ...}` lines."""
    path = Path(path)
    if path.is_dir():
        records = _dataset_records(path)
    elif path.exists():  # a file, or a pipe such as /dev/stdin
        records = _jsonl_records(path)
    else:
        raise DFlashTrtError(f"prompt file {path} does not exist")
    prompts: list[list[int]] = []
    for where, record in records:
        if limit is not None and len(prompts) >= limit:
            break
        if isinstance(record, dict) and PER_LINE_OPTIONS & set(record):
            option = sorted(PER_LINE_OPTIONS & set(record))[0]
            raise DFlashTrtError(
                f"{where}: per-prompt option '{option}' is not supported; set it for the whole run on the command line"
            )
        if isinstance(record, dict) and sum(key in record for key in PROMPT_KEYS) > 1:
            raise DFlashTrtError(f"{where} gives more than one of {', '.join(PROMPT_KEYS)}; keep one")
        if isinstance(record, dict) and isinstance(record.get("input_ids"), list):
            ids = record["input_ids"]
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise DFlashTrtError(f"{where}: input_ids must be a non-empty list of integers")
            prompts.append(ids)
        elif isinstance(record, dict) and isinstance(record.get("text"), str):
            if tokenizer is None:
                raise DFlashTrtError(f"{where} gives text but {NO_TOKENIZER}")
            prompts.append(tokenizer.encode(record["text"]))
        elif isinstance(record, dict) and "messages" in record:
            prompts.append(_encode_chat(tokenizer, record["messages"], chat_kwargs, where))
        else:
            raise DFlashTrtError(f'{where} must be {{"input_ids": [...]}}, {{"text": "..."}} or {{"messages": [...]}}')
    if not prompts:
        raise DFlashTrtError(f"prompt file {path} holds no prompts")
    return prompts
