"""A build profile's draft-length schedule, resolved for its engine: a table as written, or `auto` derived by the
roofline (`analysis/draft_schedule.py`) for the profile's GPU, TP, formats, sweep lengths and `max_batch_size`,
with TensorRT-LLM's committed calibration and the pair's lowest published acceptance (or the stated assumption for
a pair with none)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.analysis.draft_schedule import ENGINE_HARNESS, DerivedSchedule, default_acceptance, derive_schedule
from dflash_trt.analysis.gpus import get_gpu
from dflash_trt.analysis.harness_fits import calibration
from dflash_trt.analysis.model import PRECISION, Acceptance, Deployment, DFlashShape, TargetShape, mean_context
from dflash_trt.analysis.published import pair_for_models
from dflash_trt.draft_schedule import DraftLenSchedule
from dflash_trt.pipeline.profiles import BuildProfile


@dataclass(frozen=True)
class ResolvedSchedule:
    """The table the engine is built with, where it came from, and (for `auto`) the predictions behind it."""

    schedule: DraftLenSchedule
    source: str
    derived: DerivedSchedule | None = None


def engine_deployment(profile: BuildProfile) -> Deployment:
    q = profile.quantization
    return Deployment(
        get_gpu(profile.gpu),
        PRECISION[q.qformat],
        PRECISION[q.kv_cache_dtype],
        profile.checkpoint.tp_size,
        calibration(ENGINE_HARNESS),
    )


def profile_acceptance(profile: BuildProfile, drafter: DFlashShape) -> Acceptance:
    """What a profile's `auto` plans with: the pair's lowest published acceptance, or the stated assumption."""
    return default_acceptance(pair_for_models(profile.model.target, profile.model.draft), drafter.block_size)[0]


def derived_schedule(
    profile: BuildProfile, target: TargetShape, drafter: DFlashShape, tree: int | None
) -> ResolvedSchedule:
    """`auto` for this profile's engine: draft lengths for the chain, node budgets for a draft tree of `tree` nodes."""
    pair = pair_for_models(profile.model.target, profile.model.draft)
    acceptance, note = default_acceptance(pair, drafter.block_size)
    ctx = mean_context(profile.sweep.input_len, profile.sweep.output_len)
    derived = derive_schedule(
        target, drafter, acceptance, engine_deployment(profile), ctx, profile.engine.max_batch_size, tree or 0
    )
    source = (
        f"auto: {ENGINE_HARNESS} calibration, {profile.gpu} x{profile.checkpoint.tp_size} "
        f"{profile.quantization.qformat}, {profile.sweep.input_len}/{profile.sweep.output_len} tokens, batches "
        f"1..{profile.engine.max_batch_size}, {note}"
    )
    return ResolvedSchedule(derived.schedule, source, derived)


def profile_schedule(profile: BuildProfile, target: TargetShape, drafter: DFlashShape) -> ResolvedSchedule:
    """`engine.draft_len_schedule` for this profile's engine (its `engine.draft_tree` or the chain): the table as
    written, or `auto` derived."""
    choice = profile.engine.schedule_choice
    tree = profile.engine.draft_tree
    if isinstance(choice, DraftLenSchedule):
        where = "engine.draft_len_schedule"
        return ResolvedSchedule(choice.fitted_to(tree or drafter.block_size - 1, where), f"given in {where}")
    return derived_schedule(profile, target, drafter, tree)
