"""A measured acceptance distribution read from a JSON file (`plan --acceptance_json`): a `histogram` of
acceptance lengths or the `per_position` acceptance rates, checked against the drafter's block."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_trt.analysis.model import Acceptance
from dflash_trt.errors import DFlashTrtError


def read_acceptance_file(path: Path, block: int) -> Acceptance:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DFlashTrtError(f"cannot read acceptance file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise DFlashTrtError(f"{path} must hold a JSON object")
    values = data.get("histogram", data.get("per_position"))
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise DFlashTrtError(f"{path} needs a 'histogram' or 'per_position' list of numbers")
    acc = Acceptance.from_histogram(values) if "histogram" in data else Acceptance.from_position_rates(values)
    if acc.max_length > block:
        raise DFlashTrtError(f"{path} describes blocks of {acc.max_length} tokens; the drafter's block is {block}")
    return acc
