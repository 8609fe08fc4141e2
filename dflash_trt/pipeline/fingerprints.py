"""Fingerprints of what a pipeline stage was made from: settings as JSON, model directories file by file."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

# Files up to this size are hashed by content. Larger ones (weights) would cost minutes to hash on every run: an
# HF hub blob is named by the sha256 of its content, so its name is its identity; any other large file is known by
# size, modification time (which every write changes) and a hash of its first and last SAMPLE_BYTES.
CONTENT_HASH_LIMIT = 1 << 20
SAMPLE_BYTES = 1 << 16
HUB_BLOB_NAME = re.compile(r"[0-9a-f]{64}")


def fingerprint(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def file_identity(path: Path) -> list:
    """What changes whenever the file's content does (see CONTENT_HASH_LIMIT)."""
    real = path.resolve()
    stat = real.stat()
    if stat.st_size <= CONTENT_HASH_LIMIT:
        return [stat.st_size, hashlib.sha256(real.read_bytes()).hexdigest()]
    if real.parent.name == "blobs" and HUB_BLOB_NAME.fullmatch(real.name):
        return [stat.st_size, real.name]
    sample = hashlib.sha256()
    with open(real, "rb") as handle:
        sample.update(handle.read(SAMPLE_BYTES))
        handle.seek(-SAMPLE_BYTES, os.SEEK_END)
        sample.update(handle.read(SAMPLE_BYTES))
    return [stat.st_size, stat.st_mtime_ns, sample.hexdigest()]


def directory_fingerprint(directory: Path) -> str:
    """Identity of a model directory: every file's name and `file_identity`."""
    entries = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(".")):
        entries.append([path.relative_to(directory).as_posix(), *file_identity(path)])
    return fingerprint(entries)
