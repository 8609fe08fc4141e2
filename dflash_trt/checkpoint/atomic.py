"""Publish a directory all at once: build it beside the destination, rename it into place when complete.

A crash, a kill or a full disk therefore never leaves a half-written checkpoint under the output name, and an
existing output is only replaced when the caller asked for it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dflash_trt.errors import DFlashTrtError

PARTIAL_MARKER = ".partial-"


def check_destination(output_dir: Path, overwrite: bool) -> None:
    if output_dir.exists() and not overwrite:
        raise DFlashTrtError(f"output directory {output_dir} already exists; pass --overwrite to replace it")
    if output_dir.exists() and not output_dir.is_dir():
        raise DFlashTrtError(f"output path {output_dir} exists and is not a directory")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_partials(output_dir: Path) -> None:
    """Delete leftovers of killed runs for this destination (their writer process is gone), so reruns start clean."""
    for stale in output_dir.parent.glob(f".{output_dir.name}{PARTIAL_MARKER}*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def atomic_directory(output_dir: str | os.PathLike[str], overwrite: bool = False) -> Iterator[Path]:
    """Yields an empty staging directory; on success it becomes `output_dir`, on failure it disappears."""
    output_dir = Path(output_dir).absolute()
    check_destination(output_dir, overwrite)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(output_dir)
    staging = output_dir.parent / f".{output_dir.name}{PARTIAL_MARKER}{os.getpid()}"
    staging.mkdir()
    try:
        yield staging
        _fsync_directory(staging)
        if output_dir.exists():
            check_destination(output_dir, overwrite)
            retired = output_dir.parent / f".{output_dir.name}{PARTIAL_MARKER}old-{os.getpid()}"
            output_dir.rename(retired)
            staging.rename(output_dir)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(output_dir)
        _fsync_directory(output_dir.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
