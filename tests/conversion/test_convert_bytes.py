"""The bytes a conversion writes: every rank file equals, byte for byte, what the converter wrote before its write
path was made faster (sha256 digests below), and the integrity record holds each file's true BLAKE3 digest.

The weights are 8-bit integer patterns scaled by a power of two, so every value and every cast of it is exact and the
files are the same on any CPU; the digests were taken from the plain write path (whole tensors, one after the
other, hashed by reading the files back).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from _pairs import PairVariant, make_pair
from blake3 import blake3
from safetensors.torch import load_file, save_file

import dflash_trt.conversion.convert as convert
from dflash_trt.checkpoint.integrity import INTEGRITY_FILE
from dflash_trt.conversion import rank_writer

VARIANT = PairVariant(vocab=93, heads=4, kv_heads=2)
# sha256 of rank{N}.safetensors by (dtype, tp_size).
RANK_DIGESTS = {
    ("bfloat16", 1): ["ea9ba340d2ad98df8b7c4c485dc31f51c0fce8cf6c9d6ec3cc160bf8e9426c32"],
    ("float16", 1): ["7e9f30836829fa2b7b3a5dbc94072561be1bef26cf9ab457a40ea982b4ccc1cc"],
    ("bfloat16", 2): [
        "185ddbf65fb6e890d1202fc33f278d00ed51c3db1dfe25b7fe107190aa4add55",
        "df868f1ec677c0ae0f86b1452711c48669b4e530aa76acd26b0ea9e68853b904",
    ],
    ("float32", 4): [
        "abed7a7e91459093f8670a16674dda54f938eeafe3b7851511533187bbf4535b",
        "4a3ee8bb9e6254a6a34eb17a70f78a77ecb6357206a3fa88db35f6619e5acad9",
        "8b22d6a9802189b11dedc309e1c5d4b2911e54abef206f3fd39d545d0af10bb0",
        "4c3c089434568833a8837054ef1810f61dda03e7959f22214d201d6f4f780819",
    ],
}


def _pattern(shape: torch.Size, salt: int) -> torch.Tensor:
    """Values k / 64 with |k| < 256 from a multiplicative hash of the index: exact in every float type."""
    index = torch.arange(shape.numel(), dtype=torch.int64)
    k = (index * 2654435761 + salt * 40503) % 511 - 255
    return (k.to(torch.float32) / 64).reshape(shape)


def _exact_weights(model_dir: Path, salt: int) -> None:
    for number, path in enumerate(sorted(model_dir.glob("*.safetensors"))):
        tensors = load_file(path)
        patterned = {
            name: _pattern(tensor.shape, salt + 97 * number + index).to(tensor.dtype)
            for index, (name, tensor) in enumerate(sorted(tensors.items()))
        }
        save_file(patterned, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def exact_pair(tmp_path_factory):
    target_dir, draft_dir = make_pair(tmp_path_factory.mktemp("bytes"), VARIANT)
    _exact_weights(target_dir, 1)
    _exact_weights(draft_dir, 2)
    return target_dir, draft_dir


def _digests(directory: Path, tp_size: int) -> list[str]:
    return [hashlib.sha256((directory / f"rank{r}.safetensors").read_bytes()).hexdigest() for r in range(tp_size)]


def _check_record(directory: Path) -> None:
    """The integrity record (format 2) lists config.json and every rank file with its real size and BLAKE3 digest."""
    record = json.loads((directory / INTEGRITY_FILE).read_text())
    assert record["format"] == 2
    assert sorted(record["files"]) == sorted(["config.json", *(p.name for p in directory.glob("rank*.safetensors"))])
    for name, entry in record["files"].items():
        data = (directory / name).read_bytes()
        assert entry == {"size": len(data), "blake3": blake3(data).hexdigest()}, name


@pytest.mark.parametrize(("dtype", "tp_size"), [("bfloat16", 1), ("float16", 1), ("bfloat16", 2), ("float32", 4)])
def test_rank_files_are_byte_identical_to_the_plain_write_path(exact_pair, tmp_path, dtype, tp_size):
    out = tmp_path / "ckpt"
    convert.convert_checkpoint(*exact_pair, out, dtype=dtype, tp_size=tp_size)
    assert _digests(out, tp_size) == RANK_DIGESTS[dtype, tp_size]
    _check_record(out)


def test_streamed_and_parallel_writes_are_byte_identical(exact_pair, tmp_path, monkeypatch):
    """Row-block streaming (uneven blocks) and rank files written by spawned workers give the same bytes."""
    monkeypatch.setattr(rank_writer, "BLOCK_BYTES", 700)
    out = tmp_path / "ckpt"
    convert.convert_checkpoint(*exact_pair, out, dtype="bfloat16", tp_size=2)
    assert _digests(out, 2) == RANK_DIGESTS["bfloat16", 2]
    _check_record(out)
    monkeypatch.undo()
    parallel = tmp_path / "parallel"
    convert.convert_checkpoint(*exact_pair, parallel, dtype="float32", tp_size=4, workers=2)
    assert _digests(parallel, 4) == RANK_DIGESTS["float32", 4]
    _check_record(parallel)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names fsynced descriptors through Linux /proc")
def test_every_published_file_is_fsynced_once(exact_pair, tmp_path, monkeypatch):
    """Durability costs one fsync per file, at publish: the rank writers leave theirs to it."""
    real_fsync, synced = os.fsync, []

    def recording_fsync(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    out = tmp_path / "ckpt"
    convert.convert_checkpoint(*exact_pair, out, dtype="bfloat16", tp_size=2)
    files = sorted(path.name for path in synced if path.parent.name.startswith(".ckpt.partial-"))
    assert files == sorted(path.name for path in out.iterdir())
    assert sorted(path.name for path in synced if path.parent == tmp_path) == [f".ckpt.partial-{os.getpid()}"]
    assert tmp_path in synced  # the rename into place
