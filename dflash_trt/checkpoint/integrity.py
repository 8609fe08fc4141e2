"""The integrity record of a converted checkpoint: size and sha256 of every file, written last at conversion.

Whatever reads a checkpoint can then tell, before trusting it, that no byte changed since conversion: an edited
config (fewer layers, another dtype) or a flipped weight byte would otherwise decode into wrong text with exit 0.
A checkpoint without a record (written by an older version) is read as before.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from dflash_trt.errors import DFlashTrtError
from dflash_trt.jsonfile import read_json_object

INTEGRITY_FILE = "dflash_integrity.json"
FORMAT = 1
CHUNK_BYTES = 16 << 20
# Buffers below this are hashed in the calling thread: handing them over would cost more than hashing them.
BACKGROUND_MIN_BYTES = 1 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


class BackgroundSha256:
    """sha256 of a stream of buffers, hashed on a worker thread while the caller goes on with the next one.

    A writer hashes the bytes it already holds instead of reading its file back, and off its critical path:
    hashlib releases the GIL on large buffers. At most one buffer is pending (it stays referenced until hashed),
    so memory grows by at most one buffer.
    """

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256")
        self._pending: Future[None] | None = None

    def update(self, data: bytes | memoryview) -> None:
        """Queue `data` after everything queued before; the caller must not change it until the next call."""
        self._wait()
        if len(data) < BACKGROUND_MIN_BYTES:
            self._digest.update(data)
        else:
            self._pending = self._pool.submit(self._digest.update, data)

    def hexdigest(self) -> str:
        """The digest of everything queued; ends the worker thread."""
        self.close()
        return self._digest.hexdigest()

    def close(self) -> None:
        self._wait()
        self._pool.shutdown()

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()


def write_integrity_record(directory: Path, file_names: list[str], digests: Mapping[str, str] | None = None) -> None:
    """Record `file_names` (relative to `directory`) as they are now; `digests` holds the sha256 of files whose
    writer already hashed them (the others are read back)."""
    known = digests or {}
    files = {
        name: {
            "size": (directory / name).stat().st_size,
            "sha256": known[name] if name in known else file_sha256(directory / name),
        }
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
