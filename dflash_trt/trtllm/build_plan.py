"""Plan a DFlash engine build without TensorRT-LLM: validate, then spell the exact `trtllm-build` call.

Everything that can be decided on a CPU machine is decided here and in the modules this one composes (the limits,
the checkpoint's facts, the checks, the engine's lengths, the command and the manifest), so `dflash-trt build
--dry_run`, build profiles and the tests see the same rules the GPU build applies.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dflash_trt.trtllm.attention_checks import check_attention_route, check_xqa_block_layout
from dflash_trt.trtllm.attention_route import TARGET_SM_ENV
from dflash_trt.trtllm.build_settings import EngineBuildSettings
from dflash_trt.trtllm.checkpoint_facts import read_checkpoint_facts
from dflash_trt.trtllm.eagle_layout import verified_drafts
from dflash_trt.trtllm.engine_lengths import EngineLengths, engine_lengths
from dflash_trt.trtllm.engine_manifest import manifest
from dflash_trt.trtllm.network_checks import check_network
from dflash_trt.trtllm.network_environment import build_environment, environment_prefix
from dflash_trt.trtllm.plugin import LIBRARY_ENV, default_library_path
from dflash_trt.trtllm.settings_checks import check_rank_files, check_settings, resolve_settings
from dflash_trt.trtllm.trtllm_build_command import build_command, build_config_dict, check_extra_flags

# Builds one TP rank per process for `--workers` > 1 (trtllm-build's own workers cannot load our class).
RANK_BUILD_MODULE = "dflash_trt.trtllm.rank_build"


@dataclass(frozen=True)
class EngineBuildPlan:
    """The exact build: argv for `trtllm-build`, the BuildConfig dict it implies, and the manifest to write."""

    checkpoint_dir: str
    output_dir: str
    command: list[str]
    build_config: dict[str, Any]
    plugin_library: str
    dflash_manifest: dict[str, Any]
    settings: EngineBuildSettings = field(repr=False)
    lengths: EngineLengths
    world_size: int = 1

    @property
    def parallel_workers(self) -> int:
        """Ranks built at once; 1 means one trtllm-build process building rank after rank."""
        return max(1, min(self.settings.workers, self.world_size))

    def rank_commands(self, command: list[str] | None = None, python: str = "python") -> list[list[str]]:
        """One `rank_build` process per rank for a parallel build (see rank_build.py), else nothing."""
        if self.parallel_workers == 1:
            return []
        args = (command or self.command)[1:]
        return [
            [python, "-m", RANK_BUILD_MODULE, "--rank", str(rank), "--gpus", str(self.parallel_workers), "--", *args]
            for rank in range(self.world_size)
        ]

    def build_env(self) -> dict[str, str]:
        """What the build processes need in their environment beyond the caller's (`build_environment`)."""
        return build_environment(self.settings)

    def shell_command(self, with_library: bool = False) -> str:
        """The build as a shell line with the variables the network is built from; `with_library` also sets the
        plugin library and the planned GPU's SM, as `dflash-trt build` runs it (without them, a line run by hand on a
        GPU host builds for that host's GPU, `route_for_build`)."""
        variables = self.build_env()
        if not with_library:
            variables.pop(TARGET_SM_ENV)
        env = environment_prefix({**({LIBRARY_ENV: self.plugin_library} if with_library else {}), **variables})
        if self.parallel_workers == 1:
            return env + shlex.join(self.command)
        one_rank = [
            "python",
            "-m",
            RANK_BUILD_MODULE,
            "--rank",
            "{}",
            "--gpus",
            str(self.parallel_workers),
            "--",
            *self.command[1:],
        ]
        return f"seq 0 {self.world_size - 1} | {env}xargs -P {self.parallel_workers} -I{{}} {shlex.join(one_rank)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "checkpoint_dir": self.checkpoint_dir,
            "output_dir": self.output_dir,
            "command": list(self.command),
            "build_config": self.build_config,
            "plugin_library": self.plugin_library,
            "dflash_manifest": self.dflash_manifest,
            "lengths": self.lengths.to_dict(),
        }


def plan_engine_build(
    checkpoint_dir: str | Path,
    output_dir: str | Path,
    settings: EngineBuildSettings,
    plugin_library: str | Path | None = None,
    require_weights: bool = True,
) -> EngineBuildPlan:
    """Validate a converted checkpoint against the build settings and return the exact build to run.

    Build profiles plan through here too (from the config.json the converter will write, `require_weights`
    False), so both ways into `build` apply the same checks.
    """
    facts = read_checkpoint_facts(checkpoint_dir)
    # A tree of the chain's node count is the chain: the plan records no tree for it.
    tree = verified_drafts(facts, settings)
    settings = replace(settings, draft_tree=tree if tree != facts.max_draft_len else None)
    if settings.draft_tree is not None:
        settings.route.check_tree(settings.gpu, settings.draft_tree)
    check_network(facts)
    check_xqa_block_layout(facts, settings)
    check_attention_route(facts, settings)
    check_settings(facts, settings)
    settings = resolve_settings(facts, settings)
    check_extra_flags(settings)
    if require_weights:
        check_rank_files(Path(checkpoint_dir), facts)
    library = str(Path(plugin_library if plugin_library is not None else default_library_path()).absolute())
    checkpoint, output = str(checkpoint_dir), str(output_dir)
    return EngineBuildPlan(
        checkpoint_dir=checkpoint,
        output_dir=output,
        command=build_command(checkpoint, output, verified_drafts(facts, settings), settings),
        build_config=build_config_dict(facts, settings),
        plugin_library=library,
        dflash_manifest=manifest(facts, settings, library),
        settings=settings,
        lengths=engine_lengths(facts, settings),
        world_size=facts.tp_size * facts.pp_size,
    )
