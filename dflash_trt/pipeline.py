"""`dflash-trt build --config PROFILE`: checkpoint (convert + quantize) -> engine -> Triton repository.

Each stage writes one directory under the workspace and, last, a record of the fingerprint of everything it was
made from (source files, settings, the previous stage's fingerprint). A rerun skips a stage whose record matches
and whose files are all present, and redoes it (and what follows) otherwise. A host without a GPU and
TensorRT-LLM stops after the checkpoint and prints the exact command to finish on a GPU host.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_trt import __version__
from dflash_trt.capacity import checkpoint_warnings
from dflash_trt.checkpoint.atomic import check_output_apart
from dflash_trt.errors import DFlashTrtError
from dflash_trt.profiles import (
    BuildProfile,
    check_against_configs,
    load_profile,
    looks_like_repo_id,
    resolve_model_dir,
)
from dflash_trt.recorded_configs import ModelSource, load_recorded_configs, local_source, recorded_source
from dflash_trt.spec import parse_draft_config, parse_target_config
from dflash_trt.triton.serving import ServingSettings
from dflash_trt.trtllm.build_plan import (
    SAMPLING_POLICY,
    EngineBuildPlan,
    EngineBuildSettings,
    build_command,
    plan_engine_build,
    settings_dict,
)
from dflash_trt.trtllm.plugin import LIBRARY_ENV, default_library_path

if TYPE_CHECKING:  # the repository writer imports numpy (its processing code), which `--help` must not
    from dflash_trt.triton.repository import RepositorySettings

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
    fingerprint: str | None  # None: the models are not on disk (a dry run), so it cannot be taken
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
    """'complete' (skip), 'stale' (inputs changed), 'incomplete' (files missing or changed) or 'missing';
    'unverified' when outputs exist but the models they came from are not on disk."""
    record_path = stage.output / STAGE_RECORD
    if stage.fingerprint is None:
        return "unverified" if stage.output.exists() else "missing"
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
    """The profile's `engine` section as build settings: every field both spell the same way (trtllm-build's flag
    names); `max_draft_len` is not among them, the build takes it from the checkpoint's block size."""
    shared = {f.name for f in dataclasses.fields(EngineBuildSettings)}
    return EngineBuildSettings(**profile.engine.model_dump(include=shared))


def settings_from_profile(
    profile: BuildProfile,
    engine_dir: str | Path,
    tokenizer_dir: str | Path,
    plugin_library: str | Path,
    serving: ServingSettings | None = None,
) -> RepositorySettings:
    """Settings for the engine a build profile will produce, so the repository can be reviewed before the build;
    `serving` replaces the profile's serving section (already validated overrides)."""
    from dflash_trt.triton.repository import RepositorySettings, max_temperature_for_sampling, serving_fields

    eng = profile.engine
    return RepositorySettings(
        engine_dir=str(Path(engine_dir).absolute()),
        tokenizer_dir=str(Path(tokenizer_dir).absolute()),
        plugin_library=str(Path(plugin_library).absolute()),
        max_batch_size=eng.max_batch_size,
        max_input_len=eng.max_input_len,
        max_draft_len=eng.max_draft_len,
        world_size=profile.checkpoint.tp_size,
        max_temperature=max_temperature_for_sampling(SAMPLING_POLICY),
        **serving_fields(serving or profile.serving),
    )


@dataclass(frozen=True)
class QuantizationSettings:
    """A quantized profile's converter settings; the field names are `convert`'s flags and `convert_checkpoint`'s
    parameters, and their order is the order of the checkpoint stage's fingerprint and shown command."""

    qformat: str
    dflash_qformat: str | None
    kv_cache_dtype: str | None
    calib_dataset: str
    calib_size: int
    calib_max_seq_len: int | None

    def as_fields(self) -> dict[str, str | int | None]:
        return asdict(self)


def quantization_settings(profile: BuildProfile, profile_path: Path) -> QuantizationSettings | None:
    """The profile's quantization for the converter (None for an unquantized profile)."""
    dataset = profile.calibration_dataset(profile_path)
    if dataset is None:
        return None
    q = profile.quantization
    return QuantizationSettings(
        qformat=q.qformat,
        dflash_qformat=q.dflash_qformat,
        kv_cache_dtype=q.kv_cache_dtype,
        calib_dataset=str(dataset),
        calib_size=q.calibration.size,
        calib_max_seq_len=q.calibration.max_seq_len,
    )


def convert_command(
    profile: BuildProfile, target: str, draft: str, output: Path, quant: QuantizationSettings | None
) -> str:
    argv = [
        "dflash-trt",
        "convert",
        "--model_dir",
        target,
        "--dflash_model_dir",
        draft,
        "--output_dir",
        str(output),
        "--dtype",
        profile.checkpoint.dtype,
        "--tp_size",
        str(profile.checkpoint.tp_size),
    ]
    for key, value in (quant.as_fields() if quant else {}).items():
        argv += [f"--{key}", str(value)]
    return shlex.join(argv)


def planned_checkpoint_config(profile: BuildProfile, target: ModelSource, draft: ModelSource) -> dict:
    """The config.json the checkpoint stage will write, so the engine can be planned before converting."""
    from dflash_trt.checkpoint.trtllm_config import checkpoint_config
    from dflash_trt.formats import quantization_config
    from dflash_trt.spec import parse_draft_config, parse_target_config

    assert target.config is not None and draft.config is not None
    target_spec = parse_target_config(target.config, target.path)
    draft_spec = parse_draft_config(draft.config, target_spec)
    q = profile.quantization
    return checkpoint_config(
        target_spec,
        draft_spec,
        profile.checkpoint.dtype,
        profile.checkpoint.tp_size,
        quantization=quantization_config(q.qformat, q.kv_cache_dtype),
        draft_quantization=quantization_config(q.dflash_qformat, q.kv_cache_dtype),
    )


def plan_engine(
    profile: BuildProfile,
    ws: Workspace,
    settings: EngineBuildSettings,
    target: ModelSource,
    draft: ModelSource,
    plugin_library: str | None,
) -> EngineBuildPlan:
    """The engine build for the workspace's checkpoint; planned from the would-be config when it is not written yet.
    Weight files are not required here: the checkpoint stage's record decides whether they are complete, and the
    engine stage plans again, with them, right before it builds."""
    if (ws.checkpoint / "config.json").is_file():
        return plan_engine_build(
            ws.checkpoint, ws.engine, settings, plugin_library=plugin_library, require_weights=False
        )
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(planned_checkpoint_config(profile, target, draft)))
        plan = plan_engine_build(tmp, ws.engine, settings, plugin_library=plugin_library, require_weights=False)
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
    target: ModelSource
    draft: ModelSource
    tokenizer: ModelSource
    settings: EngineBuildSettings
    plugin_library: str | None

    @property
    def local(self) -> bool:
        """Every model is on disk (always so outside dry runs)."""
        return all(m.path is not None for m in (self.target, self.draft, self.tokenizer))

    @property
    def configs_known(self) -> bool:
        return self.target.config is not None and self.draft.config is not None


def _model_source(
    ref: str,
    revision: str | None,
    args: argparse.Namespace,
    recorded: Callable[[str], ModelSource],
    read_config: bool = True,
) -> ModelSource:
    """The model's directory; in a dry run, an HF id that is not downloaded falls back to its recorded config."""
    cache = Path(args.hf_cache) if args.hf_cache else None
    dry_run = getattr(args, "dry_run", False)
    try:
        path = resolve_model_dir(ref, revision=revision, cache_dir=cache, allow_download=args.download and not dry_run)
    except DFlashTrtError:
        if not dry_run or not looks_like_repo_id(ref):
            raise
        return recorded(ref)
    return local_source(ref, path, read_config)


def resolve_inputs(args: argparse.Namespace, settings_override: Callable | None = None) -> PipelineInputs:
    """The profile's models and settings. A dry run never downloads: a model missing from the HF cache is planned
    from the profile's recorded configs instead."""
    profile = load_profile(args.config)
    m = profile.model
    recorded_path = profile.recorded_configs_path(args.config)

    def recorded(ref: str) -> ModelSource:
        if recorded_path is None:
            raise DFlashTrtError(
                f"{ref} is not downloaded and the profile records no configs (model.recorded_configs) for a dry run "
                "without it; download it with --download or pass --hf_cache"
            )
        return recorded_source(ref, load_recorded_configs(recorded_path), recorded_path)

    target = _model_source(m.target, m.target_revision, args, recorded)
    draft = _model_source(m.draft, m.draft_revision, args, recorded)
    tokenizer = (
        _model_source(m.tokenizer, None, args, lambda ref: ModelSource(ref, None, None), read_config=False)
        if m.tokenizer
        else target
    )
    if target.config is not None and draft.config is not None:
        # Strict types and values first: the profile checks read the raw configs.
        parse_draft_config(draft.config, parse_target_config(target.config, target.path))
        check_against_configs(profile, target.config, draft.config, draft.shown)
    if target.path is not None and draft.path is not None:
        for warning in checkpoint_warnings(profile, target.path, draft.path):
            print(f"warning: {warning}", file=sys.stderr)
    settings = engine_settings(profile)
    if settings_override is not None:
        settings = settings_override(args, settings)
    ws = workspace(profile, args.output_dir)
    quant = quantization_settings(profile, Path(args.config))
    check_output_apart(
        ws.root,
        {
            "--config": args.config,
            "the target model": target.path,
            "the drafter": draft.path,
            "the tokenizer": tokenizer.path,
            "the calibration dataset": quant.calib_dataset if quant else None,
            "--plugin_library": args.plugin_library,
        },
    )
    return PipelineInputs(profile, Path(args.config), ws, target, draft, tokenizer, settings, args.plugin_library)


def offline_notes(inp: PipelineInputs) -> list[str]:
    """What a dry run without the models stands in for, and what it could not check."""
    notes = []
    for role, model in (("target", inp.target), ("drafter", inp.draft), ("tokenizer", inp.tokenizer)):
        if model.path is not None or (role == "tokenizer" and model is inp.target):
            continue
        if model.config is not None:
            notes.append(f"{role} {model.ref}: not downloaded; planned from its recorded config.json fields")
        elif model.unknown_reason is not None:
            notes.append(
                f"{role} {model.ref}: not downloaded and its shapes are unknown ({model.unknown_reason}); "
                "head counts against tp_size, block size, memory, KV geometry, RoPE and max_seq_len are "
                "checked once its config.json is available"
            )
        else:
            notes.append(f"{role} {model.ref}: not downloaded")
    return notes


def stages(inp: PipelineInputs) -> list[Stage]:
    """The three stages. Without the models on disk (dry runs only) no fingerprint can be taken: stages are then
    reported from their outputs alone."""
    profile, ws = inp.profile, inp.ws
    quant = quantization_settings(profile, inp.profile_path)
    ckpt_fp = (
        fingerprint(
            {
                "stage": "checkpoint",
                "version": __version__,
                "target": directory_fingerprint(inp.target.directory),
                "draft": directory_fingerprint(inp.draft.directory),
                "checkpoint": profile.checkpoint.model_dump(),
                "quantization": quant.as_fields() if quant else {},
            }
        )
        if inp.local
        else None
    )

    def run_checkpoint() -> None:
        from dflash_trt.conversion.convert import convert_checkpoint

        convert = functools.partial(
            convert_checkpoint,
            inp.target.directory,
            inp.draft.directory,
            ws.checkpoint,
            dtype=profile.checkpoint.dtype,
            tp_size=profile.checkpoint.tp_size,
            overwrite=True,
            show_progress=True,
        )
        if quant is None:
            convert()
            return
        convert(
            qformat=quant.qformat,
            dflash_qformat=quant.dflash_qformat,
            kv_cache_dtype=quant.kv_cache_dtype,
            calib_dataset=quant.calib_dataset,
            calib_size=quant.calib_size,
            calib_max_seq_len=quant.calib_max_seq_len,
        )

    if inp.configs_known:
        plan = plan_engine(profile, ws, inp.settings, inp.target, inp.draft, inp.plugin_library)
        library, build_argv = plan.plugin_library, plan.command
        # The build loads the plugin library named by this variable, so it is part of the exact command.
        engine_command = plan.shell_command(with_library=True)
    else:
        library = str(Path(inp.plugin_library or default_library_path()).absolute())
        build_argv = build_command(str(ws.checkpoint), str(ws.engine), profile.engine.max_draft_len, inp.settings)
        engine_command = f"{LIBRARY_ENV}={shlex.quote(library)} {shlex.join(build_argv)}"
    engine_fp = (
        fingerprint(
            {"stage": "engine", "checkpoint": ckpt_fp, "settings": settings_dict(inp.settings), "command": build_argv}
        )
        if ckpt_fp
        else None
    )

    def run_engine() -> None:
        from dflash_trt.trtllm.build import run_engine_build

        run_engine_build(
            plan_engine_build(ws.checkpoint, ws.engine, inp.settings, plugin_library=inp.plugin_library), overwrite=True
        )

    from dflash_trt.triton.repository import write_repository

    repo_settings = settings_from_profile(profile, ws.engine, inp.tokenizer.shown, library)
    triton_fp = (
        fingerprint(
            {
                "stage": "triton",
                "engine": engine_fp,
                "tokenizer": directory_fingerprint(inp.tokenizer.directory),
                "settings": dataclasses.asdict(repo_settings),
            }
        )
        if engine_fp
        else None
    )
    triton_command = shlex.join(
        [
            "dflash-trt",
            "triton",
            "--engine_dir",
            str(ws.engine),
            "--tokenizer_dir",
            inp.tokenizer.shown,
            "--output_dir",
            str(ws.triton),
        ]
    )

    def run_triton() -> None:
        from dflash_trt.triton.repository import settings_from_engine

        write_repository(
            settings_from_engine(ws.engine, inp.tokenizer.directory, profile.serving), ws.triton, overwrite=True
        )

    return [
        Stage(
            "checkpoint",
            ws.checkpoint,
            ckpt_fp,
            convert_command(profile, inp.target.shown, inp.draft.shown, ws.checkpoint, quant),
            run_checkpoint,
        ),
        Stage("engine", ws.engine, engine_fp, engine_command, run_engine),
        Stage("triton", ws.triton, triton_fp, triton_command, run_triton),
    ]


def resume_command(inp: PipelineInputs) -> str:
    argv = ["dflash-trt", "build", "--config", str(inp.profile_path), "--output_dir", str(inp.ws.root)]
    if inp.plugin_library:
        argv += ["--plugin_library", inp.plugin_library]
    return shlex.join(argv)


def run_pipeline(
    inp: PipelineInputs, *, dry_run: bool = False, gpu: bool | None = None, out=None
) -> list[tuple[str, str]]:
    """Run (or with dry_run, only report) every stage; returns (stage, outcome) pairs."""
    out = out or sys.stdout
    plan = stages(inp)
    for note in offline_notes(inp):
        print(f"offline: {note}", file=out)
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


def run_profile(args: argparse.Namespace, settings_override: Callable | None = None) -> int:
    if getattr(args, "checkpoint_dir", None):
        raise DFlashTrtError("--checkpoint_dir does not combine with --config: the profile names the models")
    inp = resolve_inputs(args, settings_override)
    as_json = getattr(args, "json", False)
    outcomes = run_pipeline(inp, dry_run=args.dry_run, out=sys.stderr if as_json else None)
    if as_json:  # the progress went to stderr; stdout holds only the JSON
        print(json.dumps({"stages": [{"stage": stage, "outcome": outcome} for stage, outcome in outcomes]}))
    if ("engine", "needs gpu") in outcomes:
        print(
            "dflash-trt build: stopped before the engine: this host has no CUDA GPU with TensorRT-LLM 1.2.x; the "
            "checkpoint is ready, finish with the command above on a GPU host",
            file=sys.stderr,
        )
        return STOPPED_BEFORE_ENGINE
    return 0
