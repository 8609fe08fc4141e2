"""Reading the JSON files users hand us (config.json, manifests) with one clear error for each way they go wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashTrtError


def read_json_object(path: str | Path, missing: str) -> dict[str, Any]:
    """The JSON object in `path`; `missing` is the message when the file does not exist."""
    path = Path(path)
    if not path.is_file():
        raise DFlashTrtError(missing)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DFlashTrtError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise DFlashTrtError(f"{path} must hold a JSON object")
    return data
