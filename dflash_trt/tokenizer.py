"""Tokenizer of a model or checkpoint directory, when it has one; loaded as data only (never remote code)."""

from __future__ import annotations

from pathlib import Path

from dflash_trt.errors import DFlashTrtError

TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json")
MAX_LENGTH = 2**62


def load_tokenizer(directory: str | Path):
    """A `transformers` tokenizer, or None when the directory holds no tokenizer files.

    Corrupt files, or a tokenizer that exists only as checkpoint code (`auto_map`), make `transformers` raise any
    of many exception types; every one of them is the same finding for the user: this tokenizer cannot be loaded.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise DFlashTrtError(f"tokenizer folder {directory} does not exist or is not a folder")
    if not any((directory / marker).is_file() for marker in TOKENIZER_MARKERS):
        return None
    from transformers import AutoTokenizer

    try:
        # Lengths are checked against the model by each command, in one line; the tokenizer's own limit would only
        # add a second, multi-line warning for a long prompt.
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False, model_max_length=MAX_LENGTH)
    except Exception as exc:  # a third-party loader: all its failures mean "unusable tokenizer"
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise DFlashTrtError(
            f"the tokenizer in {directory} cannot be loaded (checkpoint code is never run): {detail}"
        ) from None
