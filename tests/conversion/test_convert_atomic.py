"""Conversion never leaves a half checkpoint under the output name, never touches its inputs, never clobbers.

A real `dflash-trt convert` process is SIGKILLed while it writes; a full disk is simulated at the file-write level
under the streaming writer; an existing output must survive a refused run and a failed `--overwrite` run byte for
byte; every file the converter opens inside the input directories is opened read-only (seen by an audit hook, since
file modes do not stop root).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _pairs import PairVariant, make_pair

from dflash_trt.cli import main
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.conversion.verify import verify_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Large enough that writing 8 bf16 rank files takes far longer than the poll interval below (~70 MB of float32).
BIG = PairVariant(
    vocab=4096,
    hidden=256,
    intermediate=1024,
    layers=16,
    heads=8,
    kv_heads=2,
    head_dim=32,
    draft_heads=8,
    draft_kv_heads=2,
    draft_head_dim=32,
    draft_intermediate=512,
    taps=[1, 8, 14],
)


@pytest.fixture(scope="module")
def big_pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("atomic_big"), BIG)


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("atomic_small"))


def _convert_args(target_dir: Path, draft_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "convert",
        "--model_dir",
        str(target_dir),
        "--dflash_model_dir",
        str(draft_dir),
        "--output_dir",
        str(out),
        *extra,
    ]


def _snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    """name -> (sha256, mtime_ns) of every file under `directory`."""
    return {
        str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _partials(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.partial-*"))


def test_sigkill_mid_write_leaves_nothing_under_the_output_name(big_pair, tmp_path, capsys):
    target_dir, draft_dir = big_pair
    out = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "dflash_trt.cli", *_convert_args(target_dir, draft_dir, out, "--tp_size", "8")]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    staging = out.parent / f".{out.name}.partial-{proc.pid}"
    deadline = time.monotonic() + 120
    try:
        # Kill once the first rank file is being written: the checks are done and the output is half built.
        while not (staging / "rank0.safetensors").exists():
            assert proc.poll() is None, f"convert ended before it was killed: {proc.stderr.read().decode()}"
            assert time.monotonic() < deadline, "convert never started writing"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    assert staging.is_dir(), "a SIGKILLed run cannot clean up; its staging directory must be the only trace"
    assert not (staging / "config.json").exists()

    assert main(_convert_args(target_dir, draft_dir, out, "--tp_size", "8")) == 0
    assert not staging.exists() and not _partials(out)
    assert sorted(p.name for p in out.glob("rank*.safetensors")) == [f"rank{r}.safetensors" for r in range(8)]
    capsys.readouterr()
    assert (
        main(
            [
                "verify",
                "--checkpoint_dir",
                str(out),
                "--model_dir",
                str(target_dir),
                "--dflash_model_dir",
                str(draft_dir),
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("OK: ")


class _FullDisk:
    """Stands in for `os.pwrite`: writes into safetensors files run out of space after `budget` bytes (Linux /proc
    names each descriptor's file); every other write goes through."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.real_pwrite = os.pwrite

    def __call__(self, fd: int, data, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors"):
            size = memoryview(data).nbytes
            if size > self.budget:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.budget -= size
        return self.real_pwrite(fd, data, offset)


def test_enospc_is_one_clear_error_and_leaves_nothing(small_pair, tmp_path, monkeypatch, capsys):
    target_dir, draft_dir = small_pair
    reference = tmp_path / "ref"
    convert_checkpoint(target_dir, draft_dir, reference, tp_size=2)
    rank_bytes = (reference / "rank0.safetensors").stat().st_size
    out = tmp_path / "ckpt"
    # Space for three quarters of both rank files, written side by side: the failure hits in the middle of one.
    monkeypatch.setattr(os, "pwrite", _FullDisk(rank_bytes + rank_bytes // 2))
    code = main(_convert_args(target_dir, draft_dir, out, "--tp_size", "2"))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert re.search(r"rank[01]\.safetensors", err) and "No space left on device" in err
    assert not out.exists() and not _partials(out)


def test_failed_overwrite_keeps_the_existing_output(small_pair, tmp_path, monkeypatch, capsys):
    target_dir, draft_dir = small_pair
    out = tmp_path / "ckpt"
    convert_checkpoint(target_dir, draft_dir, out, tp_size=2)
    before = _snapshot(out)
    monkeypatch.setattr(os, "pwrite", _FullDisk(1000))
    assert main(_convert_args(target_dir, draft_dir, out, "--tp_size", "2", "--overwrite")) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert _snapshot(out) == before and not _partials(out)


def test_existing_output_is_byte_identical_after_a_refused_run(small_pair, tmp_path, capsys):
    target_dir, draft_dir = small_pair
    out = tmp_path / "ckpt"
    convert_checkpoint(target_dir, draft_dir, out, tp_size=1, dtype="float16")
    (out / "notes.txt").write_text("user data")
    before = _snapshot(out)
    code = main(_convert_args(target_dir, draft_dir, out, "--tp_size", "2"))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "already exists; pass --overwrite" in err
    assert _snapshot(out) == before and not _partials(out)


def test_output_path_that_is_a_file_is_refused(small_pair, tmp_path, capsys):
    target_dir, draft_dir = small_pair
    out = tmp_path / "ckpt"
    out.write_text("not a directory")
    assert main(_convert_args(target_dir, draft_dir, out, "--overwrite")) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert out.read_text() == "not a directory"


_AUDIT: list[tuple[str, int]] | None = None


def _audit_opens(event: str, args: tuple) -> None:
    if _AUDIT is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _AUDIT.append((os.fsdecode(args[0]), args[2]))


def test_inputs_are_opened_read_only_and_left_unchanged(small_pair, tmp_path):
    global _AUDIT
    target_dir, draft_dir = small_pair
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    copies = []
    for source in (target_dir, draft_dir):
        copy = inputs / source.name
        copy.mkdir()
        for f in source.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
            (copy / f.name).chmod(0o444)
        copy.chmod(0o555)
        copies.append(copy)
    before = _snapshot(inputs)
    sys.addaudithook(_audit_opens)  # hooks cannot be removed; this one records only while _AUDIT is a list
    _AUDIT = []
    try:
        convert_checkpoint(copies[0], copies[1], tmp_path / "ckpt", tp_size=2)
        verify_checkpoint(tmp_path / "ckpt", copies[0], copies[1])
        opened = [(path, flags) for path, flags in _AUDIT if Path(path).resolve().is_relative_to(inputs.resolve())]
    finally:
        _AUDIT = None
        for copy in copies:
            copy.chmod(0o755)
    assert any(path.endswith("model.safetensors") for path, _ in opened)
    writable = [path for path, flags in opened if flags & WRITE_FLAGS]
    assert not writable, f"inputs opened for writing: {writable}"
    assert _snapshot(inputs) == before
