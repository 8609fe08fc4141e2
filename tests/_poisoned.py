"""A real per-request engine fault: the tiny pair with one token's embedding row set to NaN.

A request whose prompt holds POISONED_TOKEN carries NaN through the target (its own rows only: every layer is
per token or per request); sampled, its weights are NaN and the engine's sampler finds no token (the emulated
gather refuses index -1, a GPU would read out of bounds). Requests without the token decode exactly as on the
clean checkpoint. POISONED_TOKEN lies past the tokenizer's 99 ids, so no text and no trained output produces it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from dflash_trt.checkpoint.integrity import INTEGRITY_FILE
from dflash_trt.tensor_names import VOCAB_EMBEDDING

POISONED_TOKEN = 120


def poisoned_copy(checkpoint: Path, destination: Path) -> Path:
    """`checkpoint` copied to `destination` with POISONED_TOKEN's embedding row NaN (and no integrity record)."""
    shutil.copytree(checkpoint, destination)
    (destination / INTEGRITY_FILE).unlink(missing_ok=True)
    rank = destination / "rank0.safetensors"
    tensors = load_file(rank)
    tensors[VOCAB_EMBEDDING][POISONED_TOKEN] = float("nan")
    save_file(tensors, rank)
    return destination
