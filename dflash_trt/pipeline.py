"""`dflash-trt build --config PROFILE`: checkpoint (convert + quantize) -> engine -> Triton repository.

Each stage writes one directory under the workspace and, last, a record of the fingerprint of everything it was
made from (source files, settings, the previous stage's fingerprint). A rerun skips a stage whose record matches
and whose files are all present, and redoes it (and what follows) otherwise. A host without a GPU and
TensorRT-LLM stops after the checkpoint and prints the exact command to finish on a GPU host.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_trt import __version__
from dflash_trt.checkpoint.atomic import check_output_apart
from dflash_trt.errors import DFlashTrtError
from dflash_trt.profiles import BuildProfile, check_against_checkpoints, load_profile, resolve_model_dir
from dflash_trt.spec import load_draft_spec, load_target_spec
from dflash_trt.trtllm.build_plan import EngineBuildPlan, EngineBuildSettings, plan_engine_build, settings_dict
from dflash_trt.trtllm.plugin import LIBRARY_ENV

STAGE_RECORD = ".dflash_stage.json"
# Exit status of `build --config` on a host that cannot build the engine: not a failure, not a finished build.
STOPPED_BEFORE_ENGINE = 3
# Files up to this size are hashed by content. Larger ones (weights) would cost minutes to hash on every run: an
# HF hub blob is named by the sha256 of its content, so its name is its identity; any other large file is known by
# size, modification time (which every write changes) and a hash of its first and last SAMPLE_BYTES.
CONTENT_HASH_LIMIT = 1 << 20
SAMPLE_BYTES = 1 << 16
HUB_BLOB_NAME = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Workspace:
    root: Path

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint"

    @property
    def engine(self) -> Path:
        return self.root / "engine"

    @property
    def triton(self) -> Path:
        return self.root / "triton"


def workspace(profile: BuildProfile, root: str | Path | None = None) -> Workspace:
    return Workspace(Path(root) if root else Path("out") / profile.name)


@dataclass(frozen=True)
class Stage:
    name: str
    output: Path
    fingerprint: str
    command: str  # what the stage runs, as a user could type it
    run: Callable[[], None]


def fingerprint(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def file_identity(path: Path) -> list:
    """What changes whenever the file's content does (see CONTENT_HASH_LIMIT)."""
    real = path.resolve()
    stat = real.stat()
    if stat.st_size <= CONTENT_HASH_LIMIT:
        return [stat.st_size, hashlib.sha256(real.read_bytes()).hexdigest()]
    if real.parent.name == "blobs" and HUB_BLOB_NAME.fullmatch(real.name):
        return [stat.st_size, real.name]
    sample = hashlib.sha256()
    with open(real, "rb") as handle:
        sample.update(handle.read(SAMPLE_BYTES))
        handle.seek(-SAMPLE_BYTES, os.SEEK_END)
        sample.update(handle.read(SAMPLE_BYTES))
    return [stat.st_size, stat.st_mtime_ns, sample.hexdigest()]


def directory_fingerprint(directory: Path) -> str:
    """Identity of a model directory: every file's name and `file_identity`."""
    entries = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(".")):
        entries.append([path.relative_to(directory).as_posix(), *file_identity(path)])
    return fingerprint(entries)


def _listing(directory: Path) -> dict[str, int]:
    return {
        p.relative_to(directory).as_posix(): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != STAGE_RECORD
    }


def stage_state(stage: Stage) -> str:
    """'complete' (skip), 'stale' (inputs changed), 'incomplete' (files missing or changed) or 'missing'."""
    record_path = stage.output / STAGE_RECORD
    if not record_path.is_file():
        return "incomplete" if stage.output.exists() else "missing"
    try:
        record = json.loads(record_path.read_text())
    except json.JSONDecodeError:
        return "incomplete"
    if record.get("fingerprint") != stage.fingerprint:
        return "stale"
    return "complete" if record.get("files") == _listing(stage.output) else "incomplete"


def record_stage(stage: Stage) -> None:
    """Written last: its presence (with a matching listing) is what marks the stage complete."""
    record = {
        "stage": stage.name,
        "fingerprint": stage.fingerprint,
        "dflash_trt_version": __version__,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": _listing(stage.output),
    }
    (stage.output / STAGE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def engine_settings(profile: BuildProfile) -> EngineBuildSettings:
    eng = profile.engine
    return EngineBuildSettings(
        max_batch_size=eng.max_batch_size,
        max_input_len=eng.max_input_len,
        max_seq_len=eng.max_seq_len,
        max_num_tokens=eng.max_num_tokens,
        gemm_plugin=eng.gemm_plugin,
        use_paged_context_fmha=eng.use_paged_context_fmha,
        use_fp8_context_fmha=eng.use_fp8_context_fmha,
        multiple_profiles=eng.multiple_profiles,
    )


# Calibration knobs are passed only to a converter that takes them; the formats are required once quantizing.
CALIBRATION_PARAMETERS = ("calib_dataset", "calib_size", "calib_max_seq_len")


def quantization_kwargs(profile: BuildProfile, profile_path: Path) -> dict:
    """Converter arguments for the profile's quantization (empty for an unquantized profile); the calibration
    prompt file is relative to the profile."""
    q = profile.quantization
    if (q.qformat, q.draft_qformat, q.kv_cache_dtype) == ("none", "none", "none"):
        return {}
    formats = {"qformat": q.qformat, "dflash_qformat": q.draft_qformat, "kv_cache_dtype": q.kv_cache_dtype}
    dataset = Path(q.calibration.dataset)
    dataset = dataset if dataset.is_absolute() else Path(profile_path).parent / dataset
    calibration = dict(zip(CALIBRATION_PARAMETERS, (str(dataset), q.calibration.size, q.calibration.max_seq_len),
                           strict=True))
    return {**formats, **calibration}


def convert_command(profile: BuildProfile, target: Path, draft: Path, output: Path, quant: dict) -> str:
    argv = ["dflash-trt", "convert", "--model_dir", str(target), "--dflash_model_dir", str(draft),
            "--output_dir", str(output), "--dtype", profile.checkpoint.dtype,
            "--tp_size", str(profile.checkpoint.tp_size)]
    for key, value in quant.items():
        argv += [f"--{key}", str(value)]
    return shlex.join(argv)


def planned_checkpoint_config(profile: BuildProfile, target: Path, draft: Path) -> dict:
    """The config.json the checkpoint stage will write, so the engine can be planned before converting."""
    from dflash_trt.checkpoint.trtllm_config import checkpoint_config
    from dflash_trt.quant.formats import quantization_config
    from dflash_trt.spec import load_draft_spec, load_target_spec

    target_spec = load_target_spec(target)
    draft_spec = load_draft_spec(draft, target_spec)
    q = profile.quantization
    return checkpoint_config(target_spec, draft_spec, profile.checkpoint.dtype, profile.checkpoint.tp_size,
                             quantization=quantization_config(q.qformat, q.kv_cache_dtype),
                             draft_quantization=quantization_config(q.draft_qformat, q.kv_cache_dtype))


def plan_engine(profile: BuildProfile, ws: Workspace, settings: EngineBuildSettings, target: Path, draft: Path,
                plugin_library: str | None) -> EngineBuildPlan:
    """The engine build for the workspace's checkpoint; planned from the would-be config when it is not written yet."""
    if (ws.checkpoint / "config.json").is_file():
        return plan_engine_build(ws.checkpoint, ws.engine, settings, plugin_library=plugin_library)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(planned_checkpoint_config(profile, target, draft)))
        plan = plan_engine_build(tmp, ws.engine, settings, plugin_library=plugin_library)
    command = [str(ws.checkpoint) if arg == tmp else arg for arg in plan.command]
    return dataclasses.replace(plan, checkpoint_dir=str(ws.checkpoint), command=command)


def gpu_build_available() -> bool:
    """An engine needs a CUDA GPU and TensorRT-LLM; without them the pipeline stops after the checkpoint."""
    import torch

    from dflash_trt.trtllm.build import installed_version

    has_trtllm = installed_version("tensorrt_llm") or installed_version("tensorrt-llm")
    return bool(has_trtllm) and torch.cuda.is_available()


@dataclass(frozen=True)
class PipelineInputs:
    profile: BuildProfile
    profile_path: Path
    ws: Workspace
    target: Path
    draft: Path
    tokenizer: Path
    settings: EngineBuildSettings
    plugin_library: str | None


def resolve_inputs(args: argparse.Namespace, settings_override: Callable | None = None) -> PipelineInputs:
    profile = load_profile(args.config)
    cache = Path(args.hf_cache) if args.hf_cache else None
    m = profile.model

    def resolve(ref: str, revision: str | None) -> Path:
        return resolve_model_dir(ref, revision=revision, cache_dir=cache, allow_download=args.download)

    target, draft = resolve(m.target, m.target_revision), resolve(m.draft, m.draft_revision)
    tokenizer = resolve(m.tokenizer, None) if m.tokenizer else target
    load_draft_spec(draft, load_target_spec(target))  # strict types and values first: the profile checks read raw
    check_against_checkpoints(profile, target, draft)
    settings = engine_settings(profile)
    if settings_override is not None:
        settings = settings_override(args, settings)
    ws = workspace(profile, args.output_dir)
    calibration = quantization_kwargs(profile, Path(args.config)).get("calib_dataset")
    check_output_apart(ws.root, {"--config": args.config, "the target model": target, "the drafter": draft,
                                 "the tokenizer": tokenizer, "the calibration dataset": calibration,
                                 "--plugin_library": args.plugin_library})
    return PipelineInputs(profile, Path(args.config), ws, target, draft, tokenizer, settings, args.plugin_library)


def stages(inp: PipelineInputs) -> list[Stage]:
    profile, ws = inp.profile, inp.ws
    quant = quantization_kwargs(profile, inp.profile_path)
    ckpt_fp = fingerprint({
        "stage": "checkpoint", "version": __version__,
        "target": directory_fingerprint(inp.target), "draft": directory_fingerprint(inp.draft),
        "checkpoint": profile.checkpoint.model_dump(), "quantization": quant,
    })

    def run_checkpoint() -> None:
        from dflash_trt.checkpoint.convert import convert_checkpoint

        convert_checkpoint(inp.target, inp.draft, ws.checkpoint, dtype=profile.checkpoint.dtype,
                tp_size=profile.checkpoint.tp_size, overwrite=True, show_progress=True, **quant)

    plan = plan_engine(profile, ws, inp.settings, inp.target, inp.draft, inp.plugin_library)
    engine_fp = fingerprint({"stage": "engine", "checkpoint": ckpt_fp, "settings": settings_dict(inp.settings),
                             "command": plan.command})

    # The build loads the plugin library named by this variable, so it is part of the exact command.
    engine_command = f"{LIBRARY_ENV}={shlex.quote(plan.plugin_library)} {plan.shell_command()}"

    def run_engine() -> None:
        from dflash_trt.trtllm.build import run_engine_build

        run_engine_build(plan_engine_build(ws.checkpoint, ws.engine, inp.settings,
                                           plugin_library=inp.plugin_library), overwrite=True)

    from dflash_trt.triton.repository import settings_from_profile, write_repository

    repo_settings = settings_from_profile(profile, ws.engine, inp.tokenizer, plan.plugin_library)
    triton_fp = fingerprint({"stage": "triton", "engine": engine_fp, "tokenizer": directory_fingerprint(inp.tokenizer),
                             "settings": dataclasses.asdict(repo_settings)})
    triton_command = shlex.join(["dflash-trt", "triton", "--engine_dir", str(ws.engine), "--tokenizer_dir",
                                 str(inp.tokenizer), "--output_dir", str(ws.triton)])

    def run_triton() -> None:
        from dflash_trt.triton.repository import settings_from_engine

        serving = profile.serving
        write_repository(settings_from_engine(
            ws.engine, inp.tokenizer,
            kv_cache_free_gpu_mem_fraction=serving.kv_cache_free_gpu_mem_fraction,
            batch_scheduler_policy=serving.batch_scheduler_policy,
            enable_chunked_context=serving.enable_chunked_context,
            enable_kv_cache_reuse=serving.enable_kv_cache_reuse,
            max_queue_delay_microseconds=serving.max_queue_delay_microseconds,
            instance_count=serving.instance_count,
        ), ws.triton, overwrite=True)

    return [
        Stage("checkpoint", ws.checkpoint, ckpt_fp,
              convert_command(profile, inp.target, inp.draft, ws.checkpoint, quant), run_checkpoint),
        Stage("engine", ws.engine, engine_fp, engine_command, run_engine),
        Stage("triton", ws.triton, triton_fp, triton_command, run_triton),
    ]


def resume_command(inp: PipelineInputs) -> str:
    argv = ["dflash-trt", "build", "--config", str(inp.profile_path), "--output_dir", str(inp.ws.root)]
    if inp.plugin_library:
        argv += ["--plugin_library", inp.plugin_library]
    return shlex.join(argv)


def run_pipeline(inp: PipelineInputs, *, dry_run: bool = False, gpu: bool | None = None,
                 out=None) -> list[tuple[str, str]]:
    """Run (or with dry_run, only report) every stage; returns (stage, outcome) pairs."""
    out = out or sys.stdout
    plan = stages(inp)
    gpu = gpu_build_available() if gpu is None else gpu
    outcomes: list[tuple[str, str]] = []
    redo = False
    for i, stage in enumerate(plan, 1):
        state = stage_state(stage)
        redo = redo or state != "complete"
        header = f"[{i}/{len(plan)}] {stage.name} -> {stage.output}"
        if not redo:
            print(f"{header}: complete, skipped", file=out)
            outcomes.append((stage.name, "skipped"))
            continue
        if dry_run:
            print(f"{header}: {state}, would run:\n    {stage.command}", file=out)
            outcomes.append((stage.name, f"would run ({state})"))
            continue
        if stage.name == "engine" and not gpu:
            print(f"{header}: needs a GPU host with TensorRT-LLM 1.2.x; stopping here.", file=out)
            print("Finish on the GPU host (copy the workspace, keep the same model snapshots) with:", file=out)
            print(f"    {resume_command(inp)}", file=out)
            print("which runs:", file=out)
            print(f"    {stage.command}", file=out)
            outcomes.append((stage.name, "needs gpu"))
            break
        print(f"{header}: {state}, running:\n    {stage.command}", file=out, flush=True)
        stage.run()
        record_stage(stage)
        outcomes.append((stage.name, "built"))
    return outcomes


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `dflash-trt build` gains for profile-driven builds."""
    parser.add_argument("--config", default=None,
                        help="build profile (build_configs/*/*.yaml): run checkpoint -> engine -> Triton repository; "
                             "--output_dir is then the workspace (default out/<profile name>)")
    parser.add_argument("--hf_cache", default=None, help="HF hub cache holding the profile's models "
                                                         "(default: $HF_HUB_CACHE or ~/.cache/huggingface/hub)")
    parser.add_argument("--download", action="store_true",
                        help="download models missing from the HF cache (never done otherwise)")


def run_profile(args: argparse.Namespace, settings_override: Callable | None = None) -> int:
    if getattr(args, "checkpoint_dir", None):
        raise DFlashTrtError("--checkpoint_dir does not combine with --config: the profile names the models")
    inp = resolve_inputs(args, settings_override)
    outcomes = run_pipeline(inp, dry_run=args.dry_run)
    if ("engine", "needs gpu") in outcomes:
        print("dflash-trt build: stopped before the engine: this host has no CUDA GPU with TensorRT-LLM 1.2.x; the "
              "checkpoint is ready, finish with the command above on a GPU host", file=sys.stderr)
        return STOPPED_BEFORE_ENGINE
    return 0
