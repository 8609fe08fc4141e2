"""A measured acceptance distribution read from a JSON file (`plan --acceptance_json`, `build --acceptance_json`):
a `histogram` of acceptance lengths, the `per_position` acceptance rates, or a `generate --json` / `emulate --json`
report, checked against the drafter's block."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_trt.analysis.model import Acceptance
from dflash_trt.errors import DFlashTrtError

REPORT_KEY = "per_position_acceptance"  # generate / emulate --json (reference/stats.py)


def _numbers(values: object) -> bool:
    return isinstance(values, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _from_report(path: Path, survival: object) -> Acceptance:
    """A report's per-position survival (the share of steps proposing draft i whose first i + 1 drafts were all
    accepted, `stats.per_position_acceptance`) as conditional rates; positions no step proposed end it."""
    if not isinstance(survival, list):
        raise DFlashTrtError(f"{path}: {REPORT_KEY} must be a list")
    measured = survival[: next((i for i, s in enumerate(survival) if s is None), len(survival))]
    if not _numbers(measured) or not measured or any(not 0 <= s <= 1 for s in measured):
        raise DFlashTrtError(f"{path}: {REPORT_KEY} must start with fractions in [0, 1]")
    rates, previous = [], 1.0
    for s in measured:
        rates.append(min(1.0, s / previous) if previous > 0 else 0.0)
        previous = s
    return Acceptance.from_position_rates(rates)


def read_acceptance_file(path: Path, block: int) -> Acceptance:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DFlashTrtError(f"cannot read acceptance file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise DFlashTrtError(f"{path} must hold a JSON object")
    if REPORT_KEY in data:
        acc = _from_report(path, data[REPORT_KEY])
    else:
        values = data.get("histogram", data.get("per_position"))
        if not _numbers(values):
            raise DFlashTrtError(f"{path} needs a 'histogram', 'per_position' or '{REPORT_KEY}' list of numbers")
        assert isinstance(values, list)
        acc = Acceptance.from_histogram(values) if "histogram" in data else Acceptance.from_position_rates(values)
    if acc.max_length > block:
        raise DFlashTrtError(f"{path} describes blocks of {acc.max_length} tokens; the drafter's block is {block}")
    return acc
