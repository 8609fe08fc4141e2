"""`dflash-trt convert` whose spawned rank writers write their rank, announce it and then hold until stopped.

Signal tests run this instead of the plain CLI: they signal the converting process only once a writer has announced
itself, so the conversion is known to be waiting on its workers and cannot have finished first. Run with this folder
on PYTHONPATH (spawned workers import this module by name) and HOLD_DIR_VARIABLE naming a folder for the
announcements:

    python -c "import sys, _held_convert; sys.exit(_held_convert.main(sys.argv[1:]))" convert ...
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from dflash_trt import cli
from dflash_trt.conversion import convert

HOLD_DIR_VARIABLE = "HELD_CONVERT_ANNOUNCE_DIR"
# A held writer that nobody stops (the test failed before signalling) gives up after this long.
HOLD_SECONDS = 300
REAL_RANK_WRITER = convert._write_ranks_in_worker


def announced(hold_dir: Path) -> list[Path]:
    """The announcements of the writers that are holding now."""
    return sorted(hold_dir.glob("rank*"))


def held_rank_writer(plan: convert.ConversionPlan, staging: Path, ranks: list[int]) -> dict:
    """The real rank writer, then an announcement, then a hold the parent's signal handling has to end."""
    written = REAL_RANK_WRITER(plan, staging, ranks)
    (Path(os.environ[HOLD_DIR_VARIABLE]) / f"rank{ranks[0]}").touch()
    time.sleep(HOLD_SECONDS)
    return written


def main(argv: list[str]) -> int:
    # The pool pickles the function it runs by module and name: this module's, found again in each spawned worker.
    convert._write_ranks_in_worker = held_rank_writer  # type: ignore[assignment]
    return cli.main(argv)
