"""The integrity record of a converted checkpoint: size and sha256 of every file, written last at conversion.

Whatever reads a checkpoint can then tell, before trusting it, that no byte changed since conversion: an edited
config (fewer layers, another dtype) or a flipped weight byte would otherwise decode into wrong text with exit 0.
A checkpoint without a record (written by an older version) is read as before.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dflash_trt.errors import DFlashTrtError
from dflash_trt.jsonfile import read_json_object

INTEGRITY_FILE = "dflash_integrity.json"
FORMAT = 1
CHUNK_BYTES = 16 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def write_integrity_record(directory: Path, file_names: list[str]) -> None:
    """Record `file_names` (relative to `directory`) as they are now."""
    files = {
        name: {"size": (directory / name).stat().st_size, "sha256": file_sha256(directory / name)}
        for name in sorted(file_names)
    }
    (directory / INTEGRITY_FILE).write_text(json.dumps({"format": FORMAT, "files": files}, indent=2) + "\n")


def check_integrity(directory: str | Path, content: bool = True) -> bool:
    """Raise if a recorded file is missing or changed; sizes always, content too with `content` (one read pass).

    Returns whether a record was found.
    """
    directory = Path(directory)
    record_path = directory / INTEGRITY_FILE
    if not record_path.exists():
        return False
    record = read_json_object(record_path, f"{record_path} cannot be read")
    files = record.get("files")
    if (
        record.get("format") != FORMAT
        or not isinstance(files, dict)
        or not all(
            isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)
            for entry in files.values()
        )
    ):
        raise DFlashTrtError(f"{record_path} is not an integrity record this version understands")
    for name, entry in sorted(files.items()):
        path = directory / name
        if Path(name).name != name or not path.is_file():
            raise DFlashTrtError(f"checkpoint {directory} is missing {name}, which its integrity record lists")
        if path.stat().st_size != entry["size"] or (content and file_sha256(path) != entry["sha256"]):
            raise DFlashTrtError(
                f"checkpoint {directory}: {name} changed after conversion (it no longer matches {INTEGRITY_FILE}); "
                "convert again"
            )
    return True
