"""Run a planned engine build on a GPU host with TensorRT-LLM 1.2.x, writing the engine directory atomically.

The build itself is `trtllm-build` with our model class file, so what runs is exactly the command `--dry_run`
prints; this module adds the checks that need the host (TensorRT-LLM present, plugin library built), stages the
output next to its destination and adds `dflash_trt.json`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

from dflash_trt.checkpoint.atomic import check_output_apart, remove_stale_partials
from dflash_trt.checkpoint.integrity import check_integrity
from dflash_trt.errors import DFlashTrtError
from dflash_trt.trtllm.build_plan import (
    MANIFEST_NAME,
    PLUGIN_LIBRARY_ENV,
    REQUIRED_TRTLLM,
    TRTLLM_BUILD,
    EngineBuildPlan,
)


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def require_tensorrt_llm() -> str:
    """The installed TensorRT-LLM version, or one sentence saying why this host cannot build engines."""
    version = installed_version("tensorrt_llm") or installed_version("tensorrt-llm")
    if version is None:
        raise DFlashTrtError(
            f"tensorrt_llm {REQUIRED_TRTLLM}.x is not installed here; run the build inside a TensorRT-LLM "
            f"{REQUIRED_TRTLLM}.x environment (e.g. its NGC release container) or use --dry_run"
        )
    if not version.startswith(REQUIRED_TRTLLM + "."):
        raise DFlashTrtError(
            f"tensorrt_llm {version} is installed but DFlash engines need the {REQUIRED_TRTLLM}.x engine API"
        )
    return version


def check_build_host(plan: EngineBuildPlan) -> str:
    """Fail early, in one sentence, when this host cannot build; returns the TensorRT-LLM version found."""
    version = require_tensorrt_llm()
    if shutil.which(TRTLLM_BUILD) is None:
        raise DFlashTrtError(f"{TRTLLM_BUILD} is not on PATH although tensorrt_llm {version} is installed")
    if not Path(plan.plugin_library).is_file():
        raise DFlashTrtError(
            f"the DFlash plugin library {plan.plugin_library} does not exist; build it (plugins/) or pass "
            "--plugin_library"
        )
    return version


def _staged_command(plan: EngineBuildPlan, staging: Path) -> list[str]:
    command = list(plan.command)
    command[command.index("--output_dir") + 1] = str(staging)
    return command


def run_engine_build(plan: EngineBuildPlan, overwrite: bool = False) -> Path:
    """Build the engine into a staging directory, add the manifest, then move it into place."""
    output = Path(plan.output_dir)
    check_output_apart(output, {"--checkpoint_dir": plan.checkpoint_dir, "--plugin_library": plan.plugin_library})
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise DFlashTrtError(f"{output} already exists and is not empty; pass --overwrite to replace it")
    check_integrity(plan.checkpoint_dir)  # one read pass, small next to the build; an edited checkpoint is refused
    version = check_build_host(plan)
    remove_stale_partials(output)
    staging = output.with_name(f".{output.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    env = dict(os.environ, **{PLUGIN_LIBRARY_ENV: str(Path(plan.plugin_library).resolve())})
    result = subprocess.run(_staged_command(plan, staging), env=env, check=False)
    if result.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise DFlashTrtError(f"{TRTLLM_BUILD} failed with exit code {result.returncode}; its log is above")
    manifest = dict(plan.dflash_manifest, tensorrt_llm_version=version,
                    tensorrt_version=installed_version("tensorrt"))
    (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    if output.exists():
        shutil.rmtree(output)
    staging.rename(output)
    return output
