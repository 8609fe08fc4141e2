"""The profile's models and settings, resolved once: local directories, or in a dry run their recorded configs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.analysis.shapes import dflash_from_spec, target_from_spec
from dflash_trt.checkpoint.atomic import check_output_apart
from dflash_trt.draft_schedule import DraftLenSchedule
from dflash_trt.errors import DFlashTrtError
from dflash_trt.pipeline.capacity import checkpoint_warnings
from dflash_trt.pipeline.profiles import (
    BuildProfile,
    check_against_configs,
    load_profile,
    looks_like_repo_id,
    profile_tree,
    resolve_model_dir,
)
from dflash_trt.pipeline.schedule import ResolvedSchedule, derived_schedule
from dflash_trt.pipeline.settings import engine_settings, quantization_settings
from dflash_trt.pipeline.workspace import Workspace, workspace
from dflash_trt.recorded_configs import ModelSource, load_recorded_configs, local_source, recorded_source
from dflash_trt.spec import FULL_ATTENTION, SLIDING_ATTENTION, parse_draft_config, parse_target_config
from dflash_trt.trtllm.build_settings import EngineBuildSettings


@dataclass(frozen=True)
class PipelineRequest:
    """What a profile-driven build was asked to do (the `build --config` flags, parsed)."""

    config: str
    output_dir: str | None = None
    hf_cache: str | None = None
    download: bool = False
    plugin_library: str | None = None
    dry_run: bool = False
    draft_len_schedule: DraftLenSchedule | str | None = None  # `build --draft_len_schedule` over the profile's


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
    schedule: ResolvedSchedule | None = None  # None: `auto` with the models' shapes unknown (dry runs only)
    schedule_flag: str | None = None  # `build --draft_len_schedule` as given, for the resume command

    @property
    def local(self) -> bool:
        """Every model is on disk (always so outside dry runs)."""
        return all(m.path is not None for m in (self.target, self.draft, self.tokenizer))

    @property
    def configs_known(self) -> bool:
        return self.target.config is not None and self.draft.config is not None

    def attention_passes(self) -> dict[str, str]:
        """Each pass's attention kernel on the profile's GPU; the draft layers' by their kinds when the configs are
        known, else both kinds'."""
        layer_types: tuple[str, ...] = (FULL_ATTENTION, SLIDING_ATTENTION)
        if self.target.config is not None and self.draft.config is not None:
            target = parse_target_config(self.target.config, self.target.path)
            layer_types = parse_draft_config(self.draft.config, target).layer_types
        return self.settings.route.describe(layer_types)


def _model_source(
    ref: str,
    revision: str | None,
    request: PipelineRequest,
    recorded: Callable[[str], ModelSource],
    read_config: bool = True,
) -> ModelSource:
    """The model's directory; in a dry run, an HF id that is not downloaded falls back to its recorded config."""
    cache = Path(request.hf_cache) if request.hf_cache else None
    dry_run = request.dry_run
    try:
        path = resolve_model_dir(
            ref, revision=revision, cache_dir=cache, allow_download=request.download and not dry_run
        )
    except DFlashTrtError:
        if not dry_run or not looks_like_repo_id(ref):
            raise
        return recorded(ref)
    return local_source(ref, path, read_config)


def resolve_inputs(
    request: PipelineRequest,
    settings_override: Callable[[EngineBuildSettings], EngineBuildSettings] | None = None,
    warn: Callable[[str], object] = lambda warning: None,
) -> PipelineInputs:
    """The profile's models and settings. A dry run never downloads: a model missing from the HF cache is planned
    from the profile's recorded configs instead. `warn` hears what the checkpoint checks warn about."""
    profile = load_profile(request.config)
    m = profile.model
    recorded_path = profile.recorded_configs_path(request.config)

    def recorded(ref: str) -> ModelSource:
        if recorded_path is None:
            raise DFlashTrtError(
                f"{ref} is not downloaded and the profile records no configs (model.recorded_configs) for a dry run "
                "without it; download it with --download or pass --hf_cache"
            )
        return recorded_source(ref, load_recorded_configs(recorded_path), recorded_path)

    target = _model_source(m.target, m.target_revision, request, recorded)
    draft = _model_source(m.draft, m.draft_revision, request, recorded)
    tokenizer = (
        _model_source(m.tokenizer, None, request, lambda ref: ModelSource(ref, None, None), read_config=False)
        if m.tokenizer
        else target
    )
    if target.config is not None and draft.config is not None:
        target_spec = parse_target_config(target.config, target.path)
        check_against_configs(profile, target_spec, parse_draft_config(draft.config, target_spec), draft.shown)
    if target.path is not None and draft.path is not None:
        for warning in checkpoint_warnings(profile, target.path, draft.path):
            warn(warning)
    settings = engine_settings(profile)
    if settings_override is not None:
        settings = settings_override(settings)
    tree = profile_tree(profile.gpu, settings.draft_tree, m.block_size - 1, "--draft_tree")
    settings = dataclasses.replace(settings, draft_tree=tree)
    schedule = _schedule(profile, target, draft, request.draft_len_schedule, tree)
    if schedule is not None:
        settings = dataclasses.replace(settings, draft_len_schedule=schedule.schedule)
    ws = workspace(profile, request.output_dir)
    quant = quantization_settings(profile, Path(request.config))
    check_output_apart(
        ws.root,
        {
            "--config": request.config,
            "the target model": target.path,
            "the drafter": draft.path,
            "the tokenizer": tokenizer.path,
            "the calibration dataset": quant.calib_dataset if quant else None,
            "--plugin_library": request.plugin_library,
        },
    )
    flag = request.draft_len_schedule
    return PipelineInputs(
        profile,
        Path(request.config),
        ws,
        target,
        draft,
        tokenizer,
        settings,
        request.plugin_library,
        schedule,
        None if flag is None else flag if isinstance(flag, str) else flag.text(),
    )


def _schedule(
    profile: BuildProfile,
    target: ModelSource,
    draft: ModelSource,
    override: DraftLenSchedule | str | None,
    tree: int | None,
) -> ResolvedSchedule | None:
    """The engine's draft-length schedule (`build --draft_len_schedule` over the profile's), node budgets for a draft
    tree of `tree` nodes; None for `auto` while the models' shapes are unknown."""
    choice = profile.engine.schedule_choice if override is None else override
    where = "engine.draft_len_schedule" if override is None else "--draft_len_schedule"
    if isinstance(choice, DraftLenSchedule):
        return ResolvedSchedule(choice.fitted_to(tree or profile.model.block_size - 1, where), f"given in {where}")
    if target.config is None or draft.config is None:
        return None
    target_spec = parse_target_config(target.config, target.path)
    drafter = dflash_from_spec(parse_draft_config(draft.config, target_spec))
    return derived_schedule(profile, target_from_spec(target_spec), drafter, tree)


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
    if inp.schedule is None:
        notes.append("draft_len_schedule auto: derived once the models' config.json fields are known")
    return notes
