"""Tensors of a Hugging Face model directory, single-file or sharded, read lazily from safetensors.

Only safetensors are read: pickle weights (`*.bin`, `*.pt`, ...) can run arbitrary code when loaded, so a
directory that has nothing else is refused. The shard index is cross-checked against the shards themselves
so a stale or tampered index cannot silently drop, duplicate or misplace a tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from dflash_trt.checkpoint.safetensors_io import SafetensorsFile, brief
from dflash_trt.errors import DFlashTrtError
from dflash_trt.spec import DRAFT_SOURCE_ALIASES

if TYPE_CHECKING:
    import numpy as np
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# Real indexes are tens of kilobytes; this only stops a hostile one from exhausting memory.
MAX_INDEX_BYTES = 64 * 1024 * 1024


class HFCheckpointReader:
    """All tensors of a HF checkpoint directory, each looked up in the shard that holds it.

    `aliases` (stored name -> name) reads a tensor some writers spell differently under the one name the caller
    asks for; a checkpoint holding both spellings is refused as ambiguous.
    """

    def __init__(self, model_dir: str | os.PathLike[str], aliases: dict[str, str] | None = None) -> None:
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise DFlashTrtError(f"{self.model_dir} is not a directory.")
        self._files: list[SafetensorsFile] = []
        self._where: dict[str, SafetensorsFile] = {}
        self._stored: dict[str, str] = {}  # name asked for -> name in the file, where they differ
        try:
            index_path = self.model_dir / INDEX_FILE
            if index_path.is_file() and (self.model_dir / SINGLE_FILE).is_file():
                raise DFlashTrtError(
                    f"{self.model_dir} has both {SINGLE_FILE} and {INDEX_FILE}, so which weights are meant is "
                    "ambiguous; remove one of them."
                )
            if index_path.is_file():
                self._open_sharded(index_path)
            else:
                self._open_single(self._single_file())
            self._apply_aliases(aliases or {})
        except BaseException:
            self.close()
            raise

    def _apply_aliases(self, aliases: dict[str, str]) -> None:
        for stored, name in aliases.items():
            if stored not in self._where:
                continue
            if name in self._where:
                raise DFlashTrtError(
                    f"{self.model_dir} holds both {brief(stored)} and {brief(name)}, two spellings of one tensor."
                )
            self._where[name] = self._where.pop(stored)
            self._stored[name] = stored

    def _single_file(self) -> Path:
        single = self.model_dir / SINGLE_FILE
        if single.is_file():
            return single
        candidates = sorted(path for path in self.model_dir.glob("*.safetensors") if path.is_file())
        if len(candidates) == 1:
            return candidates[0]
        if candidates:
            raise DFlashTrtError(
                f"{self.model_dir} holds {len(candidates)} safetensors files but no {INDEX_FILE} saying "
                "which tensor is in which."
            )
        pickles = sorted(path.name for path in self.model_dir.iterdir() if path.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise DFlashTrtError(
                f"{self.model_dir} has only pickle weights ({', '.join(pickles)}), which are never loaded because "
                "unpickling can run code; convert them to safetensors first."
            )
        raise DFlashTrtError(f"{self.model_dir} has no model weights (no *.safetensors file).")

    def _open_single(self, path: Path) -> None:
        shard = SafetensorsFile(path)
        self._files.append(shard)
        self._where = dict.fromkeys(shard.names(), shard)

    def _open_sharded(self, index_path: Path) -> None:
        weight_map = _read_weight_map(index_path)
        shards: dict[str, SafetensorsFile] = {}
        for shard_name in dict.fromkeys(weight_map.values()):
            shard_path = self.model_dir / shard_name
            if not shard_path.is_file():
                raise DFlashTrtError(f"{index_path} references shard {brief(shard_name)}, which does not exist.")
            shards[shard_name] = SafetensorsFile(shard_path)
            self._files.append(shards[shard_name])
        for shard_name, shard in shards.items():
            for name in shard.names():
                other = self._where.get(name)
                if other is not None:
                    raise DFlashTrtError(
                        f"tensor {brief(name)} is stored twice, in {brief(other.path.name)} and in {brief(shard_name)}."
                    )
                if name not in weight_map:
                    raise DFlashTrtError(
                        f"{brief(shard_name)} holds tensor {brief(name)}, which {INDEX_FILE} does not list."
                    )
                self._where[name] = shard
        for name, shard_name in weight_map.items():
            if name not in shards[shard_name]:
                raise DFlashTrtError(
                    f"{INDEX_FILE} places tensor {brief(name)} in {brief(shard_name)}, which does not hold it."
                )

    def names(self) -> list[str]:
        """Tensor names, shard by shard in file order."""
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def _shard(self, name: str) -> tuple[SafetensorsFile, str]:
        """The shard holding `name`, and the name it stores it under."""
        shard = self._where.get(name)
        if shard is None:
            raise DFlashTrtError(f"{self.model_dir} has no tensor named {brief(name)}.")
        return shard, self._stored.get(name, name)

    def dtype(self, name: str) -> torch.dtype:
        shard, stored = self._shard(name)
        return shard.dtype(stored)

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype name ("BF16", ...), known without torch."""
        shard, stored = self._shard(name)
        return shard.dtype_name(stored)

    def shape(self, name: str) -> tuple[int, ...]:
        shard, stored = self._shard(name)
        return shard.shape(stored)

    def nbytes(self, name: str) -> int:
        shard, stored = self._shard(name)
        return shard.nbytes(stored)

    def nbytes_total(self) -> int:
        return sum(shard.nbytes_total() for shard in self._files)

    def get(self, name: str, copy: bool = False) -> torch.Tensor:
        """The tensor `name` as a view of its shard's memory map, or an owned copy with `copy=True`."""
        shard, stored = self._shard(name)
        return shard.get(stored, copy=copy)

    def read_rows(self, name: str, start: int, stop: int, into: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) of `name` as bit patterns, read into `into` or a new array (no torch, no map)."""
        shard, stored = self._shard(name)
        return shard.read_rows(stored, start, stop, into)

    def close(self) -> None:
        for shard in self._files:
            shard.close()

    def __enter__(self) -> HFCheckpointReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_drafter(dflash_model_dir: str | os.PathLike[str]) -> HFCheckpointReader:
    """A drafter checkpoint, with the spellings of its tensors that some writers use read as the usual ones."""
    return HFCheckpointReader(dflash_model_dir, DRAFT_SOURCE_ALIASES)


def _read_weight_map(index_path: Path) -> dict[str, str]:
    """The index's tensor -> shard file map; shard names must be plain file names in the same directory."""
    if index_path.stat().st_size > MAX_INDEX_BYTES:
        raise DFlashTrtError(f"{index_path} is larger than {MAX_INDEX_BYTES} bytes, far beyond any real index.")
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DFlashTrtError(f"{index_path} is not a readable JSON file ({exc}).") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise DFlashTrtError(f"{index_path} has no weight_map object naming the shard of each tensor.")
    for name, shard_name in weight_map.items():
        if not isinstance(shard_name, str) or not _is_plain_file_name(shard_name):
            raise DFlashTrtError(
                f"{index_path} places tensor {brief(name)} in {brief(shard_name)}, which is not a file name "
                "in that directory."
            )
    return weight_map


def _is_plain_file_name(name: str) -> bool:
    return (
        name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and os.path.basename(name) == name
    )
