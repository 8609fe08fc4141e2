"""The three stages of `dflash-trt build --config PROFILE`: checkpoint (convert + quantize) -> engine -> Triton
repository, each with the command it runs and the fingerprint of everything it is made from (source files,
settings, the previous stage's fingerprint). Without the models on disk (dry runs only) no fingerprint can be
taken: stages are then reported from their outputs alone."""

from __future__ import annotations

import dataclasses
import functools
import shlex
from pathlib import Path

from dflash_trt import __version__
from dflash_trt.pipeline.fingerprints import directory_fingerprint, fingerprint
from dflash_trt.pipeline.resolve import PipelineInputs
from dflash_trt.pipeline.settings import convert_command, plan_engine, quantization_settings, settings_from_profile
from dflash_trt.pipeline.workspace import Stage
from dflash_trt.trtllm.build_plan import plan_engine_build
from dflash_trt.trtllm.build_settings import settings_dict
from dflash_trt.trtllm.engine_lengths import EngineLengths
from dflash_trt.trtllm.network_environment import build_environment, environment_prefix
from dflash_trt.trtllm.plugin import LIBRARY_ENV, default_library_path
from dflash_trt.trtllm.trtllm_build_command import build_command


def stages(inp: PipelineInputs) -> list[Stage]:
    """The checkpoint, engine and Triton stages, in order."""
    checkpoint = _checkpoint_stage(inp)
    engine, library = _engine_stage(inp, checkpoint.fingerprint)
    return [checkpoint, engine, _triton_stage(inp, engine.fingerprint, library)]


def _checkpoint_stage(inp: PipelineInputs) -> Stage:
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
            qformat=quant.formats.qformat,
            dflash_qformat=quant.formats.dflash_qformat,
            kv_cache_dtype=quant.formats.kv_cache_dtype,
            calib_dataset=quant.calib_dataset,
            calib_size=quant.calib_size,
            calib_max_seq_len=quant.calib_max_seq_len,
        )

    command = convert_command(profile, inp.target.shown, inp.draft.shown, ws.checkpoint, quant)
    return Stage("checkpoint", ws.checkpoint, ckpt_fp, command, run_checkpoint)


def _engine_stage(inp: PipelineInputs, ckpt_fp: str | None) -> tuple[Stage, str]:
    """The engine stage and the plugin library it loads (the repository names it too)."""
    profile, ws = inp.profile, inp.ws
    if inp.configs_known:
        plan = plan_engine(profile, ws, inp.settings, inp.target, inp.draft, inp.plugin_library)
        library, build_argv, lengths = plan.plugin_library, plan.command, plan.lengths
        # The build loads the plugin library and builds for the GPU these variables name: part of the exact command.
        engine_command = plan.shell_command(with_library=True)
    else:
        library = str(Path(inp.plugin_library or default_library_path()).absolute())
        nodes = inp.settings.draft_tree or profile.engine.max_draft_len
        build_argv = build_command(str(ws.checkpoint), str(ws.engine), nodes, inp.settings)
        engine_command = environment_prefix({LIBRARY_ENV: library, **build_environment(inp.settings)}) + shlex.join(
            build_argv
        )
        lengths = EngineLengths(
            max_seq_len=inp.settings.max_seq_len,
            max_draft_len=profile.engine.max_draft_len,
            draft_nodes=nodes,
            positions=None,  # the target's max_position_embeddings is not known yet
        )
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

    return Stage("engine", ws.engine, engine_fp, engine_command, run_engine, lengths.explanation()), library


def _triton_stage(inp: PipelineInputs, engine_fp: str | None, library: str) -> Stage:
    from dflash_trt.triton.repository import write_repository

    profile, ws = inp.profile, inp.ws
    schedule = None if inp.schedule is None else inp.schedule.schedule.text()
    repo_settings = settings_from_profile(
        profile,
        ws.engine,
        inp.tokenizer.shown,
        library,
        draft_len_schedule=schedule,
        draft_tree=inp.settings.draft_tree,
    )
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

    return Stage("triton", ws.triton, triton_fp, triton_command, run_triton)
