"""Tokenizer of a model or checkpoint directory, when it has one; loaded as data only (never remote code)."""

from __future__ import annotations

from pathlib import Path

TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(directory: str | Path):
    """A `transformers` tokenizer, or None when the directory holds no tokenizer files."""
    directory = Path(directory)
    if not any((directory / marker).is_file() for marker in TOKENIZER_MARKERS):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
