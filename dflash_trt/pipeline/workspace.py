"""A build workspace and the record each stage leaves in it: a stage writes one directory and, last, the fingerprint
of everything it was made from plus a listing of its files, so a rerun can tell a complete stage from a stale or
half-written one."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from dflash_trt import __version__
from dflash_trt.pipeline.profiles import BuildProfile

STAGE_RECORD = ".dflash_stage.json"


@dataclass(frozen=True)
class Workspace:
    root: Path

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint"

    @property
    def engine(self) -> Path:
        return self.root / "engine"

    @property
    def triton(self) -> Path:
        return self.root / "triton"


def workspace(profile: BuildProfile, root: str | Path | None = None) -> Workspace:
    return Workspace(Path(root) if root else Path("out") / profile.name)


@dataclass(frozen=True)
class Stage:
    name: str
    output: Path
    fingerprint: str | None  # None: the models are not on disk (a dry run), so it cannot be taken
    command: str  # what the stage runs, as a user could type it
    run: Callable[[], None]
    note: str | None = None  # what a reader of the command would otherwise ask (the engine's lengths)


def _listing(directory: Path) -> dict[str, int]:
    return {
        p.relative_to(directory).as_posix(): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != STAGE_RECORD
    }


class StageState(Enum):
    """What a stage's output directory holds, judged against the stage's fingerprint."""

    COMPLETE = "complete"  # skipped on a rerun
    STALE = "stale"  # made from other inputs
    INCOMPLETE = "incomplete"  # files missing or changed since the record
    MISSING = "missing"
    UNVERIFIED = "unverified"  # outputs exist but the models they came from are not on disk


def stage_state(stage: Stage) -> StageState:
    """The state of a stage's output, read from its record and its files."""
    record_path = stage.output / STAGE_RECORD
    if stage.fingerprint is None:
        return StageState.UNVERIFIED if stage.output.exists() else StageState.MISSING
    if not record_path.is_file():
        return StageState.INCOMPLETE if stage.output.exists() else StageState.MISSING
    try:
        record = json.loads(record_path.read_text())
    except json.JSONDecodeError:
        return StageState.INCOMPLETE
    if record.get("fingerprint") != stage.fingerprint:
        return StageState.STALE
    return StageState.COMPLETE if record.get("files") == _listing(stage.output) else StageState.INCOMPLETE


def record_stage(stage: Stage) -> None:
    """Written last: its presence (with a matching listing) is what marks the stage complete."""
    record = {
        "stage": stage.name,
        "fingerprint": stage.fingerprint,
        "dflash_trt_version": __version__,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": _listing(stage.output),
    }
    (stage.output / STAGE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
