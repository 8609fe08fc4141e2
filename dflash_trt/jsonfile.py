"""Reading the JSON files users hand us (config.json, manifests) with one clear error for each way they go wrong."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashTrtError


def read_json_object(path: str | Path, missing: str) -> dict[str, Any]:
    """The JSON object in `path`; `missing` is the message when the file does not exist."""
    path = Path(path)
    if path.is_dir():
        raise DFlashTrtError(f"{path} is a directory, not a JSON file")
    if not path.is_file():
        raise DFlashTrtError(missing)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise DFlashTrtError(f"cannot read {path}: {exc.strerror or exc}") from None
    except RecursionError:
        raise DFlashTrtError(f"{path} is nested too deeply to be a real JSON file") from None
    except ValueError as exc:  # also JSONDecodeError, UnicodeDecodeError, and integers too long to convert
        raise DFlashTrtError(f"{path} is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise DFlashTrtError(f"{path} must hold a JSON object")
    return data


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def strict_json(data: Any, indent: int | None = None, sort_keys: bool = False) -> str:
    """JSON every parser accepts: an infinite or NaN number (which Python would write as `Infinity` / `NaN`,
    outside the JSON standard) is written as null, meaning "no limit" or "not measured"."""
    return json.dumps(_finite(data), indent=indent, sort_keys=sort_keys, allow_nan=False)
