"""Publish a directory all at once: build it beside the destination, rename it into place when complete.

A crash, a kill or a full disk therefore never leaves a half-written checkpoint under the output name, and an
existing output is only replaced when the caller asked for it and the folder is one the same command published
before: every published folder holds a marker file naming its command, so `--overwrite` never deletes a folder
of the user's own files (`--output_dir .` run from a home directory).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from dflash_trt.errors import DFlashTrtError

PARTIAL_MARKER = ".partial-"
SYNC_FILE_RANGE_WRITE = 2  # sync_file_range flag: start writing out dirty pages, do not wait (linux/fs.h)
# The file in every published folder that says which command wrote it (read before replacing the folder).
OUTPUT_MARKER = ".dflash-trt-output"
# Characters of the output's name kept in its staging folder's name, so that a legal 255-character output name
# plus `.partial-old-PID` stays within the file system's name limit.
STAGING_NAME_CHARS = 200


InputPaths = Mapping[str, "str | os.PathLike[str] | None"]


def _input_locations(path: Path) -> list[Path]:
    """Where an input really lives: the path with symlinks resolved and, for a folder, what its top-level links
    point to (an HF hub snapshot's files are links into the cache's `blobs/`)."""
    real = path.resolve()
    places = [real]
    if real.is_dir():
        try:
            links = [entry for entry in real.iterdir() if entry.is_symlink()]
        except OSError:
            links = []
        places += sorted({link.resolve() for link in links} - {real})
    return places


def check_output_apart(output: str | os.PathLike[str], inputs: InputPaths) -> None:
    """Refuse an output that is, contains or lies inside any input (symlinks resolved), whatever the flags.

    Publishing replaces the output as a whole, so such an output would delete or mix with the inputs; `inputs`
    maps a name the user knows (a flag) to its path, None for an input not given.
    """
    real_output = Path(output).resolve()
    for label, given in inputs.items():
        if given is None:
            continue
        for place in _input_locations(Path(given)):
            if real_output == place:
                relation = "is"
            elif place in real_output.parents:
                relation = "lies inside"
            elif real_output in place.parents:
                relation = "contains"
            else:
                continue
            where = "" if place == Path(given).absolute() else f" (really {place})"
            raise DFlashTrtError(
                f"output {output} {relation} the input {label} {given}{where}; choose an output outside every input"
            )


def mark_output(directory: Path, command: str) -> None:
    """Record in `directory` (about to be published) that `dflash-trt <command>` wrote it."""
    (directory / OUTPUT_MARKER).write_text(json.dumps({"written_by": f"dflash-trt {command}"}) + "\n")


def _written_by(directory: Path) -> str | None:
    try:
        data = json.loads((directory / OUTPUT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data.get("written_by") if isinstance(data, dict) and isinstance(data.get("written_by"), str) else None


def check_destination(output_dir: Path, overwrite: bool, command: str) -> None:
    """An existing non-empty `output_dir` is replaced only with `overwrite`, and only when `dflash-trt <command>`
    published it (its marker says so); anything else in the way is refused, never deleted."""
    if output_dir.exists() and not output_dir.is_dir():
        raise DFlashTrtError(f"output path {output_dir} exists and is not a directory")
    if not output_dir.exists() or not any(output_dir.iterdir()):
        return
    if not overwrite:
        raise DFlashTrtError(f"output directory {output_dir} already exists; pass --overwrite to replace it")
    writer = _written_by(output_dir)
    if writer != f"dflash-trt {command}":
        made = f"was written by {writer}" if writer else f"holds files dflash-trt did not write (no {OUTPUT_MARKER})"
        raise DFlashTrtError(
            f"output directory {output_dir} {made}; --overwrite only replaces an earlier dflash-trt {command} "
            "output, so choose another --output_dir or empty this one yourself"
        )


def check_writable(output_dir: Path) -> None:
    """Fail now, not after an hour of work, when nothing can be created where `output_dir` would go: a scratch
    folder is made and removed in the nearest folder that exists."""
    existing = Path(os.path.abspath(output_dir)).parent
    while not existing.exists():
        existing = existing.parent
    try:
        Path(tempfile.mkdtemp(prefix=".dflash-probe-", dir=existing)).rmdir()
    except OSError as exc:
        raise DFlashTrtError(f"cannot create output {output_dir}: {exc.strerror or exc}") from None


def staging_path(output_dir: Path, tag: str) -> Path:
    """`.<output name>.partial-<tag>` beside the output: where it is built, or where the old one is retired."""
    return output_dir.parent / f".{output_dir.name[:STAGING_NAME_CHARS]}{PARTIAL_MARKER}{tag}"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(output_dir: Path) -> None:
    """Delete leftovers of killed runs for this destination (their writer process is gone), so reruns start clean."""
    for stale in output_dir.parent.glob(f".{glob.escape(output_dir.name[:STAGING_NAME_CHARS])}{PARTIAL_MARKER}*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def scratch_directory(parent: Path, purpose: str) -> Iterator[Path]:
    """A private work folder `.dflash-<purpose>-<pid>-*` in `parent`, removed on exit; folders of the same purpose
    left by killed runs (their process is gone) are removed first, since a SIGKILL skips every cleanup."""
    prefix = f".dflash-{purpose}-"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for stale in parent.glob(f"{prefix}*"):
            pid = stale.name[len(prefix) :].split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _process_alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))
    except OSError as exc:
        raise DFlashTrtError(f"cannot create a work folder in {parent}: {exc.strerror or exc}") from None
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def atomic_directory(
    output_dir: str | os.PathLike[str], command: str, overwrite: bool = False, inputs: InputPaths | None = None
) -> Iterator[Path]:
    """Yields an empty staging directory; on success its files are made durable (one fsync each) and it becomes
    `output_dir`, marked as written by `dflash-trt <command>`; on failure it disappears.

    `inputs` (see `check_output_apart`) are what the output is made from: an output among them is refused.
    """
    output_dir = Path(os.path.abspath(output_dir))  # `.` and `a/..` name their folder, not an empty name
    check_output_apart(output_dir, inputs or {})
    check_destination(output_dir, overwrite, command)
    staging = staging_path(output_dir, str(os.getpid()))
    try:
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(output_dir)
        staging.mkdir()
        mark_output(staging, command)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise DFlashTrtError(f"cannot create output {output_dir}: {exc.strerror or exc}") from None
    try:
        yield staging
        for entry in os.scandir(staging):
            if entry.is_file(follow_symlinks=False):
                _fsync(Path(entry.path))
        _fsync(staging)
        if output_dir.exists():
            check_destination(output_dir, overwrite, command)
            retired = staging_path(output_dir, f"old-{os.getpid()}")
            output_dir.rename(retired)
            staging.rename(output_dir)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(output_dir)
        _fsync(output_dir.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (Linux), or None where there is none."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing bytes [offset, offset + length) of an open file to disk, without waiting for it.

    The disk then works while the rest of the file is produced, and the fsync at publish waits only for the tail.
    Where the call is missing or fails, nothing is lost but the head start: the fsync still writes and reports.
    """
    call = _sync_file_range()
    if call is not None:
        call(fd, offset, length, SYNC_FILE_RANGE_WRITE)


def _fsync(path: Path) -> None:
    """Make a file, or a folder's entries, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
