"""The embedded tiny pair as the acceptance and decode benchmarks use it: converted in float32 to a scratch
directory, loaded as the golden model, and its held-out prompts tokenized."""

from __future__ import annotations

import tempfile
from pathlib import Path

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.reference.model import GoldenModel, load_golden_model
from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir
from dflash_trt.tokenizer import load_tokenizer


def tiny_golden(prompt_count: int) -> tuple[GoldenModel, list[list[int]]]:
    """(golden model, the first `prompt_count` held-out prompts as token ids); the checkpoint is gone afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "ckpt"
        convert_checkpoint(target_dir(), draft_dir(), checkpoint, dtype="float32")
        model = load_golden_model(checkpoint)
        tokenizer = load_tokenizer(checkpoint)
    return model, [tokenizer.encode(p.text) for p in load_heldout(limit=prompt_count)]
