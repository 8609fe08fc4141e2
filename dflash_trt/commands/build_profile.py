"""`dflash-trt build --config PROFILE`: the flags of a profile-driven build, and its progress and outcome printed.

The pipeline itself (pipeline/) resolves the profile, plans the stages and runs them; this module turns flags into
its request and its typed results into the lines a user reads.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TextIO

from dflash_trt.errors import DFlashTrtError
from dflash_trt.pipeline.resolve import PipelineInputs, PipelineRequest, offline_notes, resolve_inputs
from dflash_trt.pipeline.run import Outcome, StageResult, resume_command, run_pipeline
from dflash_trt.pipeline.stages import stages
from dflash_trt.trtllm.attention_route import route_summary
from dflash_trt.trtllm.build_settings import EngineBuildSettings

# Exit status of `build --config` on a host that cannot build the engine: not a failure, not a finished build.
STOPPED_BEFORE_ENGINE = 3


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `dflash-trt build` gains for profile-driven builds."""
    parser.add_argument(
        "--config",
        default=None,
        help="build profile (build_configs/*/*.yaml): run checkpoint -> engine -> Triton repository; "
        "--output_dir is then the workspace (default out/<profile name>)",
    )
    parser.add_argument(
        "--hf_cache",
        default=None,
        help="HF hub cache holding the profile's models (default: $HF_HUB_CACHE or ~/.cache/huggingface/hub)",
    )
    parser.add_argument(
        "--download", action="store_true", help="download models missing from the HF cache (never done otherwise)"
    )


def pipeline_request(args: argparse.Namespace) -> PipelineRequest:
    return PipelineRequest(
        config=args.config,
        output_dir=args.output_dir,
        hf_cache=args.hf_cache,
        download=args.download,
        plugin_library=args.plugin_library,
        dry_run=args.dry_run,
        draft_len_schedule=args.draft_len_schedule,
    )


def print_stage(result: StageResult, inp: PipelineInputs, out: TextIO) -> None:
    """One stage's progress line(s), printed before a stage that is built runs."""
    stage, state = result.stage, result.state.value
    header = f"[{result.index}/{result.total}] {stage.name} -> {stage.output}"
    if result.outcome is Outcome.SKIPPED:
        print(f"{header}: complete, skipped", file=out)
    elif result.outcome is Outcome.WOULD_RUN:
        print(f"{header}: {state}, would run:\n    {stage.command}", file=out)
        if stage.note:
            print(f"    # {stage.note}", file=out)
    elif result.outcome is Outcome.NEEDS_GPU:
        print(f"{header}: needs a GPU host with TensorRT-LLM 1.2.x; stopping here.", file=out)
        print("Finish on the GPU host (copy the workspace, keep the same model snapshots) with:", file=out)
        print(f"    {resume_command(inp)}", file=out)
        print("which runs:", file=out)
        print(f"    {stage.command}", file=out)
        if stage.note:
            print(f"    # {stage.note}", file=out)
    else:
        print(f"{header}: {state}, running:\n    {stage.command}", file=out, flush=True)


def run_profile(
    args: argparse.Namespace,
    settings_override: Callable[[argparse.Namespace, EngineBuildSettings], EngineBuildSettings],
) -> int:
    if getattr(args, "checkpoint_dir", None):
        raise DFlashTrtError("--checkpoint_dir does not combine with --config: the profile names the models")
    if args.gpu or args.acceptance_json:
        raise DFlashTrtError("--gpu and --acceptance_json serve --checkpoint_dir builds; a profile names its GPU")
    inp = resolve_inputs(
        pipeline_request(args),
        lambda settings: settings_override(args, settings),
        lambda warning: print(f"warning: {warning}", file=sys.stderr),
    )
    as_json = getattr(args, "json", False)
    out = sys.stderr if as_json else sys.stdout  # with --json, stdout holds only the JSON
    plan = stages(inp)
    for note in offline_notes(inp):
        print(f"offline: {note}", file=out)
    for line in route_summary(inp.settings.gpu, inp.attention_passes()):
        print(line, file=out)
    if inp.schedule is not None:
        print(f"draft-length schedule {inp.schedule.schedule.text()} ({inp.schedule.source})", file=out)
    results = run_pipeline(plan, dry_run=args.dry_run, report=lambda result: print_stage(result, inp, out))
    if as_json:
        print(json.dumps({"stages": [{"stage": r.stage.name, "outcome": r.label} for r in results]}))
    if any(r.outcome is Outcome.NEEDS_GPU for r in results):
        print(
            "dflash-trt build: stopped before the engine: this host has no CUDA GPU with TensorRT-LLM 1.2.x; the "
            "checkpoint is ready, finish with the command above on a GPU host",
            file=sys.stderr,
        )
        return STOPPED_BEFORE_ENGINE
    return 0
