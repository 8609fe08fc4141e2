"""The integrity record of a converted checkpoint: size and digest of every file, written last at conversion.

Whatever reads a checkpoint can then tell, before trusting it, that no byte changed since conversion: an edited
config (fewer layers, another dtype) or a flipped weight byte would otherwise decode into wrong text with exit 0.
A checkpoint without a record (written by an older version) is read as before.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from blake3 import blake3

from dflash_trt.errors import DFlashTrtError
from dflash_trt.jsonfile import read_json_object

INTEGRITY_FILE = "dflash_integrity.json"
# The record formats read, each with the hash it keeps per file (named as that hash's field): the format contract.
# Format 2 (BLAKE3, over 3x the speed of sha256, which had become the converter's bottleneck) is written; format 1
# (sha256) is still read, since checkpoints converted by earlier versions carry it.
HASH_BY_FORMAT = {1: "sha256", 2: "blake3"}
FORMAT = 2
CHUNK_BYTES = 16 << 20


class _Hash(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


_NEW_HASH: dict[str, Callable[[], _Hash]] = {"sha256": hashlib.sha256, "blake3": blake3}


def file_digest(path: Path, algorithm: str) -> str:
    """Hex digest of the file at `path` with `algorithm` (a value of HASH_BY_FORMAT), read in chunks."""
    digest = _NEW_HASH[algorithm]()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def new_record_digest() -> _Hash:
    """A hash of the record's algorithm, for a writer to hash a file as it writes it (no read-back)."""
    return _NEW_HASH[HASH_BY_FORMAT[FORMAT]]()


def write_integrity_record(directory: Path, file_names: list[str], digests: Mapping[str, str] | None = None) -> None:
    """Record `file_names` (relative to `directory`) as they are now, in format FORMAT; `digests` holds the digest
    (`new_record_digest`'s) of files whose writer already hashed them (the others are read back)."""
    known = digests or {}
    algorithm = HASH_BY_FORMAT[FORMAT]
    files = {
        name: {
            "size": (directory / name).stat().st_size,
            algorithm: known[name] if name in known else file_digest(directory / name, algorithm),
        }
        for name in sorted(file_names)
    }
    (directory / INTEGRITY_FILE).write_text(json.dumps({"format": FORMAT, "files": files}, indent=2) + "\n")


def check_integrity(directory: str | Path, content: bool = True) -> bool:
    """Raise if a recorded file is missing or changed; sizes always, content too with `content` (one read pass).

    Reads every format of HASH_BY_FORMAT. Returns whether a record was found.
    """
    directory = Path(directory)
    record_path = directory / INTEGRITY_FILE
    if not record_path.exists():
        return False
    record = read_json_object(record_path, f"{record_path} cannot be read")
    record_format, files = record.get("format"), record.get("files")
    algorithm = HASH_BY_FORMAT.get(record_format) if type(record_format) is int else None
    if (
        algorithm is None
        or not isinstance(files, dict)
        or not all(
            isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get(algorithm), str)
            for entry in files.values()
        )
    ):
        raise DFlashTrtError(f"{record_path} is not an integrity record this version understands")
    for name, entry in sorted(files.items()):
        path = directory / name
        if Path(name).name != name or not path.is_file():
            raise DFlashTrtError(f"checkpoint {directory} is missing {name}, which its integrity record lists")
        if path.stat().st_size != entry["size"] or (content and file_digest(path, algorithm) != entry[algorithm]):
            raise DFlashTrtError(
                f"checkpoint {directory}: {name} changed after conversion (it no longer matches {INTEGRITY_FILE}); "
                "convert again"
            )
    return True
