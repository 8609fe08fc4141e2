"""The integrity record: format 2 (BLAKE3) written and checked, format 1 (sha256, from earlier versions) still
checked, anything else refused. The oracle is the `blake3` package and hashlib over the file bytes read back."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from blake3 import blake3

from dflash_trt.checkpoint import integrity
from dflash_trt.checkpoint.integrity import (
    INTEGRITY_FILE,
    check_integrity,
    file_digest,
    new_record_digest,
    write_integrity_record,
)
from dflash_trt.errors import DFlashTrtError

FILES = {"config.json": b'{"dtype": "float32"}', "rank0.safetensors": bytes(range(256)) * 4099}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    for name, data in FILES.items():
        (tmp_path / name).write_bytes(data)
    return tmp_path


def _write_record(directory: Path, record: object) -> None:
    (directory / INTEGRITY_FILE).write_text(json.dumps(record))


def _sha256_record(directory: Path) -> dict:
    """A format-1 record as earlier versions wrote it."""
    files = {
        name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for name, data in ((p.name, p.read_bytes()) for p in sorted(directory.iterdir()))
    }
    return {"format": 1, "files": files}


def _flip_byte(path: Path, offset: int = 1000) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _changed(directory: Path, name: str) -> str:
    return re.escape(
        f"checkpoint {directory}: {name} changed after conversion (it no longer matches {INTEGRITY_FILE}); "
        "convert again"
    )


def test_format_2_record_holds_every_files_size_and_blake3(checkpoint: Path) -> None:
    """Files the writer hashed keep the digest it gave; the others are read back."""
    streamed = new_record_digest()
    streamed.update(FILES["rank0.safetensors"])
    write_integrity_record(checkpoint, list(FILES), {"rank0.safetensors": streamed.hexdigest()})
    record = json.loads((checkpoint / INTEGRITY_FILE).read_text())
    assert record == {
        "format": 2,
        "files": {
            name: {"size": len(data), "blake3": blake3((checkpoint / name).read_bytes()).hexdigest()}
            for name, data in FILES.items()
        },
    }
    assert check_integrity(checkpoint) is True


def test_format_2_detects_a_flipped_byte_and_a_changed_size(checkpoint: Path) -> None:
    write_integrity_record(checkpoint, list(FILES))
    rank = checkpoint / "rank0.safetensors"
    _flip_byte(rank)
    assert check_integrity(checkpoint, content=False) is True  # sizes only
    with pytest.raises(DFlashTrtError, match=_changed(checkpoint, "rank0.safetensors")):
        check_integrity(checkpoint)
    (checkpoint / "config.json").write_bytes(FILES["config.json"] + b" ")
    with pytest.raises(DFlashTrtError, match=_changed(checkpoint, "config.json")):
        check_integrity(checkpoint, content=False)


def test_a_format_1_record_still_verifies_and_detects_a_flipped_byte(checkpoint: Path) -> None:
    _write_record(checkpoint, _sha256_record(checkpoint))
    assert check_integrity(checkpoint) is True
    _flip_byte(checkpoint / "rank0.safetensors", offset=len(FILES["rank0.safetensors"]) - 1)
    with pytest.raises(DFlashTrtError, match=_changed(checkpoint, "rank0.safetensors")):
        check_integrity(checkpoint)


def test_a_listed_file_missing_is_named(checkpoint: Path) -> None:
    write_integrity_record(checkpoint, list(FILES))
    (checkpoint / "rank0.safetensors").unlink()
    message = f"checkpoint {checkpoint} is missing rank0.safetensors, which its integrity record lists"
    with pytest.raises(DFlashTrtError, match=re.escape(message)):
        check_integrity(checkpoint)


def test_no_record_reads_as_before(checkpoint: Path) -> None:
    assert check_integrity(checkpoint) is False


@pytest.mark.parametrize(
    "change",
    [
        {"format": 3},
        {"format": 0},
        {"format": "2"},
        {"format": True},
        {"format": None},
        {"format": [2]},
        {"files": []},
        {"format": 1},  # a format-1 record must hold sha256, not blake3
    ],
)
def test_an_unknown_record_is_refused(checkpoint: Path, change: dict) -> None:
    write_integrity_record(checkpoint, list(FILES))
    record = json.loads((checkpoint / INTEGRITY_FILE).read_text())
    _write_record(checkpoint, record | change)
    message = f"{checkpoint / INTEGRITY_FILE} is not an integrity record this version understands"
    with pytest.raises(DFlashTrtError, match=re.escape(message)):
        check_integrity(checkpoint)


def test_a_format_2_record_holding_sha256_is_refused(checkpoint: Path) -> None:
    _write_record(checkpoint, _sha256_record(checkpoint) | {"format": 2})
    with pytest.raises(DFlashTrtError, match="is not an integrity record this version understands"):
        check_integrity(checkpoint)


@pytest.mark.parametrize(("algorithm", "oracle"), [("sha256", hashlib.sha256), ("blake3", blake3)])
def test_file_digest_reads_in_chunks(tmp_path: Path, monkeypatch, algorithm: str, oracle) -> None:
    monkeypatch.setattr(integrity, "CHUNK_BYTES", 1000)
    path = tmp_path / "data"
    path.write_bytes(bytes(range(251)) * 40)  # ten chunks and a partial one
    assert file_digest(path, algorithm) == oracle(path.read_bytes()).hexdigest()


def test_importing_the_record_module_does_not_import_torch() -> None:
    """Checking a checkpoint stays cheap for commands that never load a tensor."""
    script = "import sys, dflash_trt.checkpoint.integrity; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"
