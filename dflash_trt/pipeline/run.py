"""Running the stages: each is skipped when its record matches, reported in a dry run, stopped at the engine on a
host that cannot build one, and otherwise run and recorded. A rerun redoes the first stage that is not complete
and everything after it. Results are typed values; the caller prints them."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from dflash_trt.pipeline.resolve import PipelineInputs
from dflash_trt.pipeline.workspace import Stage, StageState, record_stage, stage_state


class Outcome(Enum):
    SKIPPED = "skipped"  # complete already
    WOULD_RUN = "would run"  # a dry run
    NEEDS_GPU = "needs gpu"  # the engine stage on a host without a GPU and TensorRT-LLM; nothing after it runs
    BUILT = "built"


@dataclass(frozen=True)
class StageResult:
    index: int  # 1-based, of `total`
    total: int
    stage: Stage
    state: StageState  # what the stage's output held before this run
    outcome: Outcome

    @property
    def label(self) -> str:
        """The outcome as `build --config --json` reports it."""
        if self.outcome is Outcome.WOULD_RUN:
            return f"{self.outcome.value} ({self.state.value})"
        return self.outcome.value


def gpu_build_available() -> bool:
    """An engine needs a CUDA GPU and TensorRT-LLM; without them the pipeline stops after the checkpoint."""
    import torch

    from dflash_trt.trtllm.build import installed_version

    has_trtllm = installed_version("tensorrt_llm") or installed_version("tensorrt-llm")
    return bool(has_trtllm) and torch.cuda.is_available()


def resume_command(inp: PipelineInputs) -> str:
    argv = ["dflash-trt", "build", "--config", str(inp.profile_path), "--output_dir", str(inp.ws.root)]
    if inp.plugin_library:
        argv += ["--plugin_library", inp.plugin_library]
    if inp.schedule_flag is not None:
        argv += ["--draft_len_schedule", inp.schedule_flag]
    return shlex.join(argv)


def run_pipeline(
    plan: list[Stage],
    *,
    dry_run: bool = False,
    gpu: bool | None = None,
    report: Callable[[StageResult], object] = lambda result: None,
) -> list[StageResult]:
    """Run (or with dry_run, only report) the stages of `stages(inputs)`. `report` hears each stage's result as soon
    as it is decided, before a stage that is to be built runs."""
    gpu = gpu_build_available() if gpu is None else gpu
    results: list[StageResult] = []
    redo = False
    for i, stage in enumerate(plan, 1):
        state = stage_state(stage)
        redo = redo or state is not StageState.COMPLETE
        result = StageResult(i, len(plan), stage, state, _outcome(stage, redo, dry_run, gpu))
        report(result)
        results.append(result)
        if result.outcome is Outcome.NEEDS_GPU:
            break
        if result.outcome is Outcome.BUILT:
            stage.run()
            record_stage(stage)
    return results


def _outcome(stage: Stage, redo: bool, dry_run: bool, gpu: bool) -> Outcome:
    if not redo:
        return Outcome.SKIPPED
    if dry_run:
        return Outcome.WOULD_RUN
    if stage.name == "engine" and not gpu:
        return Outcome.NEEDS_GPU
    return Outcome.BUILT
