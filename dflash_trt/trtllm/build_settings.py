"""The settings a build is planned from (`EngineBuildSettings`) and their record in a plan's JSON (`settings_dict`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dflash_trt.draft_schedule import FIXED, DraftLenSchedule
from dflash_trt.gpu_targets import ASSUMED_GPU, gpu_sm
from dflash_trt.trtllm.attention_route import AttentionRoute
from dflash_trt.trtllm.build_limits import DEFAULT_MAX_INPUT_LEN, DEFAULT_MAX_SEQ_LEN, TOKENS_PER_BLOCK


@dataclass(frozen=True)
class EngineBuildSettings:
    """The `trtllm-build` knobs a DFlash engine exposes; defaults suit one H200/B300 serving a few dozen users."""

    max_batch_size: int = 64
    max_input_len: int = DEFAULT_MAX_INPUT_LEN
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    max_num_tokens: int = 8192
    max_beam_width: int = 1
    gemm_plugin: str = "auto"
    use_paged_context_fmha: bool = True
    # None: what builder.build() settles on for the checkpoint (`fp8_context_fmha`); a value that differs is refused.
    use_fp8_context_fmha: bool | None = None
    multiple_profiles: bool = False
    kv_cache_type: str = "paged"
    tokens_per_block: int = TOKENS_PER_BLOCK
    logits_dtype: str = "float32"
    workers: int = 1
    extra_flags: tuple[str, ...] = ()
    # The GPU the engine is built for (and runs on): it decides the attention kernel of each pass.
    gpu: str = ASSUMED_GPU

    @property
    def route(self) -> AttentionRoute:
        return AttentionRoute(gpu_sm(self.gpu))

    # Resolved before planning (`auto` is the planner's, analysis/draft_schedule.py); built in via SCHEDULE_ENV.
    draft_len_schedule: DraftLenSchedule = FIXED
    draft_tree: int | None = None  # nodes of the draft tree verified per request; None: the chain


def settings_dict(settings: EngineBuildSettings) -> dict[str, Any]:
    data = asdict(settings)
    data["extra_flags"] = list(settings.extra_flags)
    data["draft_len_schedule"] = settings.draft_len_schedule.text()
    return data
