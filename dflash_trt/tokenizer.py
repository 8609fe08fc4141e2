"""Tokenizer of a model or checkpoint directory, when it has one; loaded as data only (never remote code)."""

from __future__ import annotations

from pathlib import Path

from dflash_trt.errors import DFlashTrtError

TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json")
UNLIMITED = int(1e30)  # what transformers itself uses for a tokenizer without a length limit
MAX_CHAT_TEMPLATE_BYTES = 1024 * 1024  # real templates are tens of kB; a larger file is the wrong file


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
        tokenizer = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
    except Exception as exc:  # a third-party loader: all its failures mean "unusable tokenizer"
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise DFlashTrtError(
            f"the tokenizer in {directory} cannot be loaded (checkpoint code is never run): {detail}"
        ) from None
    # Every run checks prompt lengths against the model's own limits (max_position_embeddings, --max_seq_len,
    # calibration's cut); the tokenizer's model_max_length would only print transformers' "Token indices sequence
    # length is longer than the specified maximum" warning, which names no flag of ours.
    tokenizer.model_max_length = UNLIMITED
    return tokenizer


def read_chat_template(path: str | Path) -> str:
    """A Jinja chat template from a file (for a tokenizer that has none, or to replace its own), checked to parse
    so that a typo is one error at start, not a 400 on every chat request."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    path = Path(path)
    if not path.is_file():
        raise DFlashTrtError(f"chat template {path} does not exist or is not a file")
    if path.stat().st_size > MAX_CHAT_TEMPLATE_BYTES:
        raise DFlashTrtError(f"chat template {path} is over {MAX_CHAT_TEMPLATE_BYTES} bytes: not a chat template")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DFlashTrtError(f"chat template {path} is not UTF-8 text: {exc.reason}") from None
    if not text.strip():
        raise DFlashTrtError(f"chat template {path} is empty")
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as exc:
        raise DFlashTrtError(f"chat template {path}, line {exc.lineno}: {exc.message}") from None
    return text
