"""The Triton `tensorrtllm` backend knobs that are not part of the engine, as one schema.

Build profiles (their `serving` section), `dflash-trt triton` flags and `RepositorySettings` are all checked
against it, so a bad value is refused the same way wherever it comes from.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dflash_trt.errors import DFlashTrtError

MAX_REPLICAS = 64  # copies of the engine one node serves


class ServingSettings(BaseModel):
    """Triton `tensorrtllm` backend knobs that are not part of the engine; `dflash-trt triton` flags are checked
    against this same schema.

    Chunked context defaults to off: the tensorrtllm backend's own EAGLE CI turns it off as unsupported, and our
    engine's prefill has not been run in chunks on a GPU yet. KV block reuse is refused: the last anchor's drafter
    K/V in a stored block is written by the block pass rather than by injection, so a request reusing that block
    would draft from a context the golden model never sees (outputs stay lossless, acceptance drops). An attention
    window shorter than max_seq_len is refused too (a cyclic cache against absolute injection pages).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # `true` is not 1, "false" not true

    kv_cache_free_gpu_mem_fraction: float = Field(default=0.9, gt=0.0, lt=1.0, allow_inf_nan=False)
    batch_scheduler_policy: Literal["guaranteed_no_evict", "max_utilization"] = "guaranteed_no_evict"
    enable_chunked_context: bool = False
    enable_kv_cache_reuse: bool = False
    max_queue_delay_microseconds: int = Field(default=0, ge=0)
    instance_count: int = Field(default=1, ge=1, description="pre/post-processing Python model instances")
    max_attention_window_size: int | None = None

    @field_validator("max_attention_window_size")
    @classmethod
    def _no_attention_window(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError(
                "must stay unset (the engine's max_seq_len): a shorter window makes the KV cache cyclic while "
                "KV injection writes absolute pages, so the drafter would read pages never written"
            )
        return v

    replicas: int = Field(
        default=1, ge=1, le=MAX_REPLICAS, description="copies of the engine, each on its own tp_size GPUs of the node"
    )

    @field_validator("enable_kv_cache_reuse")
    @classmethod
    def _no_block_reuse(cls, v: bool) -> bool:
        if v:
            raise ValueError(
                "must stay false: a reused KV block holds drafter K/V written by the block pass, not by KV "
                "injection, so reuse would lower acceptance"
            )
        return v


def override_serving(base: ServingSettings, overrides: dict) -> ServingSettings:
    """`base` with command-line overrides, validated by the profile schema; a bad value names its flag."""
    try:
        return ServingSettings.model_validate({**base.model_dump(), **overrides})
    except ValidationError as exc:
        first = exc.errors()[0]
        flag = "--" + ".".join(str(p) for p in first["loc"])
        raise DFlashTrtError(f"{flag}: {first['msg'].removeprefix('Value error, ')}") from None
