"""Models a build profile names, as the pipeline sees them: a local directory, or, for a dry run on a machine that
has not downloaded them, the `config.json` fields recorded once and shipped with the package
(`dflash_trt/assets/recorded_configs.yaml`, `PACKAGED_RECORDED_CONFIGS`).

A dry run is how a build is reviewed before tens of GB are fetched, so it must work offline. Planning reads only
the two `config.json` files; a recorded copy stands in for a missing one, and a model recorded as `unknown` leaves
the checks that need its shapes for the real run (the dry run says which). The performance model reads its public
model shapes from the same file (`packaged_recorded_configs`), so each value is written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import yaml

from dflash_trt.errors import DFlashTrtError
from dflash_trt.jsonfile import read_json_object

UNKNOWN = "unknown"
PACKAGED_RECORDED_CONFIGS = Path(str(resources.files("dflash_trt") / "assets" / "recorded_configs.yaml"))


@dataclass(frozen=True)
class ModelSource:
    """One model of a profile: where it is, and its config.json (None while unknown)."""

    ref: str
    path: Path | None  # None: not downloaded (dry runs only)
    config: dict | None
    unknown_reason: str | None = None

    @property
    def directory(self) -> Path:
        """The local directory; only a dry run meets a model without one."""
        if self.path is None:
            raise DFlashTrtError(f"{self.ref} is not downloaded")
        return self.path

    @property
    def shown(self) -> str:
        """How commands name it: the directory, else the HF id the real run resolves in the cache."""
        return str(self.path) if self.path is not None else self.ref


def local_source(ref: str, path: Path, read_config: bool = True) -> ModelSource:
    config = read_json_object(path / "config.json", f"{path} has no config.json") if read_config else None
    return ModelSource(ref, path, config)


def load_recorded_configs(path: Path) -> dict[str, dict | str]:
    """HF id -> recorded config.json fields, or the reason they are unknown."""
    if not path.is_file():
        raise DFlashTrtError(f"recorded configs file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise DFlashTrtError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise DFlashTrtError(f"{path}: must map HF ids to config.json fields")
    recorded: dict[str, dict | str] = {}
    for ref, entry in data.items():
        if not isinstance(entry, dict) or not entry:
            raise DFlashTrtError(f"{path}: {ref} must map to config.json fields or to {{{UNKNOWN}: reason}}")
        if UNKNOWN in entry:
            if set(entry) != {UNKNOWN} or not isinstance(entry[UNKNOWN], str):
                raise DFlashTrtError(f"{path}: {ref}: {UNKNOWN} takes a reason and no other key")
            recorded[str(ref)] = entry[UNKNOWN]
        else:
            recorded[str(ref)] = entry
    return recorded


@cache
def packaged_recorded_configs() -> dict[str, dict | str]:
    """The recorded configs shipped with the package, read once per process."""
    return load_recorded_configs(PACKAGED_RECORDED_CONFIGS)


def recorded_source(ref: str, recorded: dict[str, dict | str], where: Path) -> ModelSource:
    """The stand-in for a model that is not downloaded; one that is not recorded at all cannot be planned."""
    if ref not in recorded:
        raise DFlashTrtError(
            f"{ref} is not downloaded and {where} records no config for it; download it (--download) or record its "
            "config.json fields there"
        )
    entry = recorded[ref]
    if isinstance(entry, str):
        return ModelSource(ref, None, None, unknown_reason=entry)
    return ModelSource(ref, None, dict(entry))
