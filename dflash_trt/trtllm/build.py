"""Run a planned engine build on a GPU host with TensorRT-LLM 1.2.x, writing the engine directory atomically.

The build itself is `trtllm-build` with our model class file, so what runs is exactly the command `--dry_run`
prints (with `--workers` > 1 and TP: one `rank_build` process per rank, at most `--workers` at a time, each running
trtllm-build's own argument handling for its rank); this module adds the checks that need the host (TensorRT-LLM
present, plugin library built, enough GPUs), stages the output next to its destination and adds `dflash_trt.json`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from dflash_trt.checkpoint.atomic import (
    check_destination,
    check_output_apart,
    mark_output,
    remove_stale_partials,
    staging_path,
)
from dflash_trt.checkpoint.integrity import check_integrity
from dflash_trt.errors import DFlashTrtError
from dflash_trt.gpu_targets import visible_gpu
from dflash_trt.trtllm.build_limits import REQUIRED_TRTLLM
from dflash_trt.trtllm.build_plan import EngineBuildPlan
from dflash_trt.trtllm.engine_manifest import MANIFEST_NAME, check_engine_config
from dflash_trt.trtllm.network_environment import TREE_ENV
from dflash_trt.trtllm.plugin import LIBRARY_ENV
from dflash_trt.trtllm.trtllm_build_command import TRTLLM_BUILD

POLL_SECONDS = 0.2


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def require_tensorrt_llm(without: str = "") -> str:
    """The installed TensorRT-LLM version, or one sentence saying why this host cannot run engines; `without`
    ends it with what the calling command can do instead (only `build` has a --dry_run)."""
    version = installed_version("tensorrt_llm") or installed_version("tensorrt-llm")
    if version is None:
        raise DFlashTrtError(
            f"tensorrt_llm {REQUIRED_TRTLLM}.x is not installed here; run inside a TensorRT-LLM "
            f"{REQUIRED_TRTLLM}.x environment (e.g. its NGC release container){without}"
        )
    if not version.startswith(REQUIRED_TRTLLM + "."):
        raise DFlashTrtError(
            f"tensorrt_llm {version} is installed but DFlash engines need the {REQUIRED_TRTLLM}.x engine API"
        )
    return version


def check_build_host(plan: EngineBuildPlan) -> str:
    """Fail early, in one sentence, when this host cannot build; returns the TensorRT-LLM version found."""
    version = require_tensorrt_llm(" or use dflash-trt build --dry_run")
    if shutil.which(TRTLLM_BUILD) is None:
        raise DFlashTrtError(f"{TRTLLM_BUILD} is not on PATH although tensorrt_llm {version} is installed")
    if not Path(plan.plugin_library).is_file():
        raise DFlashTrtError(
            f"the DFlash plugin library {plan.plugin_library} does not exist; build it (plugins/) or pass "
            "--plugin_library"
        )
    check_build_gpu(plan)
    if plan.parallel_workers > 1:
        import torch

        if torch.cuda.device_count() < plan.parallel_workers:
            raise DFlashTrtError(
                f"--workers {plan.parallel_workers} needs as many GPUs; this host has {torch.cuda.device_count()}"
            )
    return version


def check_build_gpu(plan: EngineBuildPlan) -> None:
    """A TensorRT engine runs on the GPU generation it was built on, and ours is planned for `--gpu`: the two must
    agree (a dry run plans for any GPU)."""
    visible = visible_gpu()
    planned = plan.settings.gpu
    if visible is None:
        raise DFlashTrtError(f"no GPU is visible; building needs the GPU the engine is for ({planned})")
    name, sm = visible
    if sm != plan.settings.route.sm:
        raise DFlashTrtError(
            f"the engine is planned for {planned} (SM{plan.settings.route.sm}) but this host's GPU is "
            f"{name or 'unsupported'} (SM{sm}); TensorRT engines run on the GPU generation they are built on: build "
            f"on a {planned}, or pass --gpu {name or 'h100|h200|b200|b300'}"
        )


def _staged_command(plan: EngineBuildPlan, staging: Path) -> list[str]:
    command = list(plan.command)
    command[command.index("--output_dir") + 1] = str(staging)
    return command


def run_rank_builds(
    commands: list[list[str]],
    workers: int,
    env: dict[str, str],
    launch: Callable[..., subprocess.Popen] = subprocess.Popen,
) -> list[int]:
    """Run one build process per rank, `workers` at a time; the first failure stops the others (a rank's engine is
    useless without the rest). Returns the ranks that failed."""
    pending = list(enumerate(commands))
    running: dict[int, subprocess.Popen] = {}
    failed: list[int] = []
    try:
        while running or (pending and not failed):
            while pending and not failed and len(running) < workers:
                rank, command = pending.pop(0)
                running[rank] = launch(command, env=env)
            time.sleep(POLL_SECONDS)
            for rank, process in list(running.items()):
                if process.poll() is not None:
                    del running[rank]
                    if process.returncode != 0:
                        failed.append(rank)
            if failed:
                for process in running.values():
                    process.terminate()
                for process in running.values():
                    process.wait()
                running.clear()
    finally:
        for process in running.values():  # interrupted: no build outlives the command
            process.kill()
            process.wait()
    return failed


def _build(plan: EngineBuildPlan, staging: Path, env: dict[str, str]) -> None:
    command = _staged_command(plan, staging)
    rank_commands = plan.rank_commands(command, python=sys.executable)
    if not rank_commands:
        result = subprocess.run(command, env=env, check=False)
        if result.returncode != 0:
            raise DFlashTrtError(f"{TRTLLM_BUILD} failed with exit code {result.returncode}; its log is above")
        return
    failed = run_rank_builds(rank_commands, plan.parallel_workers, env)
    if failed:
        raise DFlashTrtError(
            f"building rank {', '.join(map(str, sorted(failed)))} failed (its log is above); the "
            "other ranks were stopped"
        )


def run_engine_build(plan: EngineBuildPlan, overwrite: bool = False) -> Path:
    """Build the engine into a staging directory (ranks in parallel with `--workers` > 1), add the manifest, then
    move it into place."""
    output = Path(os.path.abspath(plan.output_dir))
    check_output_apart(output, {"--checkpoint_dir": plan.checkpoint_dir, "--plugin_library": plan.plugin_library})
    check_destination(output, overwrite, "build")
    check_integrity(plan.checkpoint_dir)  # one read pass, small next to the build; an edited checkpoint is refused
    version = check_build_host(plan)
    remove_stale_partials(output)
    staging = staging_path(output, str(os.getpid()))
    shutil.rmtree(staging, ignore_errors=True)
    # A draft tree's node count reaches the model class only from the plan: an inherited one would turn a chain into
    # a tree.
    env = {name: value for name, value in os.environ.items() if name != TREE_ENV}
    env.update({LIBRARY_ENV: str(Path(plan.plugin_library).resolve())}, **plan.build_env())
    manifest = dict(plan.dflash_manifest, tensorrt_llm_version=version, tensorrt_version=installed_version("tensorrt"))
    try:
        _build(plan, staging, env)
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        check_engine_config(staging)  # what trtllm-build wrote must be what the plan printed and recorded
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    mark_output(staging, "build")
    if output.exists():
        shutil.rmtree(output)
    staging.rename(output)
    return output
