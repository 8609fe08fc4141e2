"""Profile -> settings: the one place a build profile becomes converter arguments, engine build settings and
Triton repository settings, each planned before the stage that uses it runs."""

from __future__ import annotations

import dataclasses
import json
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_trt.checkpoint.stored import QuantSettings
from dflash_trt.formats import fp8_context_fmha
from dflash_trt.pipeline.profiles import BuildProfile
from dflash_trt.pipeline.workspace import Workspace
from dflash_trt.recorded_configs import ModelSource
from dflash_trt.reference.loop_rules import longest_request
from dflash_trt.sampling_rules import ENGINE_SAMPLING
from dflash_trt.triton.serving import ServingSettings
from dflash_trt.trtllm.build_plan import EngineBuildPlan, plan_engine_build
from dflash_trt.trtllm.build_settings import EngineBuildSettings
from dflash_trt.trtllm.settings_checks import resolved_gemm_plugin

if TYPE_CHECKING:  # the repository writer imports numpy (its processing code), which `--help` must not
    from dflash_trt.triton.repository import RepositorySettings


def engine_settings(profile: BuildProfile) -> EngineBuildSettings:
    """The profile's `engine` section as build settings, with the values the builder settles from the quantization
    written out as the plan writes them (`settings_checks.resolve_settings`), so a command shown before the model
    configs are known is the one that runs; the profile's GPU decides each pass's attention kernel."""
    settings = profile.engine.build_settings()
    quant = profile.quantization
    return dataclasses.replace(
        settings,
        gemm_plugin=resolved_gemm_plugin(settings.gemm_plugin, quant.qformat),
        use_fp8_context_fmha=fp8_context_fmha(quant.qformat, quant.kv_cache_dtype),
        gpu=profile.gpu,
    )


def settings_from_profile(
    profile: BuildProfile,
    engine_dir: str | Path,
    tokenizer_dir: str | Path,
    plugin_library: str | Path,
    serving: ServingSettings | None = None,
    draft_len_schedule: str | None = None,
    draft_tree: int | None = None,
) -> RepositorySettings:
    """Settings for the engine a build profile will produce, so the repository can be reviewed before the build;
    `serving` replaces the profile's serving section (already validated overrides); `draft_len_schedule` is the
    table the engine is built with, once resolved (else the profile's text: `auto` still says the engine drafts by
    load); `draft_tree` the nodes it verifies (`build --config --draft_tree`, else the profile's)."""
    from dflash_trt.triton.repository import RepositorySettings, max_temperature_for_sampling, serving_fields

    eng = profile.engine
    nodes = draft_tree or eng.draft_tree or eng.max_draft_len
    return RepositorySettings(
        engine_dir=str(Path(engine_dir).absolute()),
        tokenizer_dir=str(Path(tokenizer_dir).absolute()),
        plugin_library=str(Path(plugin_library).absolute()),
        max_batch_size=eng.max_batch_size,
        max_input_len=eng.max_input_len,
        max_draft_len=nodes,
        eagle_depth=eng.max_draft_len if nodes != eng.max_draft_len else None,
        world_size=profile.checkpoint.tp_size,
        max_temperature=max_temperature_for_sampling(ENGINE_SAMPLING),
        # At most what the built engine holds (its window and positions are at least the profile's max_seq_len);
        # the pipeline rewrites the repository from the built engine's config.
        max_seq_len=longest_request(eng.max_seq_len, eng.max_draft_len),
        draft_len_schedule=draft_len_schedule or eng.draft_len_schedule,
        **serving_fields(serving or profile.serving),
    )


@dataclass(frozen=True)
class QuantizedConversion:
    """A quantized profile's converter inputs: its formats (the converter's own record) and its calibration set.
    `as_fields` names them as `convert`'s flags and `convert_checkpoint`'s parameters, in the order of the
    checkpoint stage's fingerprint and shown command."""

    formats: QuantSettings
    calib_dataset: str
    calib_size: int
    calib_max_seq_len: int | None

    def as_fields(self) -> dict[str, str | int | None]:
        calibration = {k: v for k, v in dataclasses.asdict(self).items() if k != "formats"}
        return {**dataclasses.asdict(self.formats), **calibration}


def quantization_settings(profile: BuildProfile, profile_path: Path) -> QuantizedConversion | None:
    """The profile's quantization for the converter (None for an unquantized profile)."""
    dataset = profile.calibration_dataset(profile_path)
    if dataset is None:
        return None
    q = profile.quantization
    return QuantizedConversion(
        formats=q.formats,
        calib_dataset=str(dataset),
        calib_size=q.calibration.size,
        calib_max_seq_len=q.calibration.max_seq_len,
    )


def convert_command(
    profile: BuildProfile, target: str, draft: str, output: Path, quant: QuantizedConversion | None
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
    from dflash_trt.spec import parse_draft_config, parse_target_config

    assert target.config is not None and draft.config is not None
    target_spec = parse_target_config(target.config, target.path)
    draft_spec = parse_draft_config(draft.config, target_spec)
    formats = profile.quantization.formats
    return checkpoint_config(
        target_spec,
        draft_spec,
        profile.checkpoint.dtype,
        profile.checkpoint.tp_size,
        quantization=formats.config(draft=False),
        draft_quantization=formats.config(draft=True),
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
