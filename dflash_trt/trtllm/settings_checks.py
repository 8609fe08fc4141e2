"""The rules `trtllm-build` or the EAGLE runtime would enforce later (or silently override) on the build settings,
and the settings with every value the builder settles itself written out (`resolve_settings`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import NVFP4, fp8_context_fmha
from dflash_trt.gpu_targets import check_nvfp4_gpu
from dflash_trt.trtllm.build_limits import (
    GEMM_PLUGIN_CHOICES,
    KV_CACHE_TYPES,
    LOGITS_DTYPES,
    MAX_EAGLE_BATCH_SIZE,
    MAX_EAGLE_DRAFT_LEN,
    QUANTIZED_GEMM_PLUGINS,
    TOPK_MAX_K,
    XQA_TOKENS_PER_BLOCK,
)
from dflash_trt.trtllm.build_settings import EngineBuildSettings
from dflash_trt.trtllm.checkpoint_facts import CheckpointFacts, kv_cache_format, weights_qformat
from dflash_trt.trtllm.eagle_layout import verified_drafts
from dflash_trt.trtllm.engine_lengths import check_positions
from dflash_trt.trtllm.network_checks import check_kv_cache_format


def check_settings(facts: CheckpointFacts, settings: EngineBuildSettings) -> None:
    """Every rule `trtllm-build` or the EAGLE runtime would enforce later (or silently override), as one message."""
    check_engine_settings(settings)
    check_settings_against_checkpoint(facts, settings)


def check_engine_settings(settings: EngineBuildSettings) -> None:
    """The rules on the build settings alone, before any checkpoint is known (build profiles check them too)."""
    if settings.max_beam_width != 1:
        raise DFlashTrtError("speculative decoding engines support only --max_beam_width 1")
    if settings.kv_cache_type not in KV_CACHE_TYPES:
        raise DFlashTrtError(
            f"--kv_cache_type must be paged (EAGLE-mode engines need the paged KV cache), got "
            f"{settings.kv_cache_type!r}"
        )
    if not settings.use_paged_context_fmha:
        raise DFlashTrtError("EAGLE-mode engines need --use_paged_context_fmha enable")
    if settings.gemm_plugin not in GEMM_PLUGIN_CHOICES:
        raise DFlashTrtError(f"--gemm_plugin must be one of {', '.join(GEMM_PLUGIN_CHOICES)}")
    if settings.logits_dtype not in LOGITS_DTYPES:
        raise DFlashTrtError(
            "--logits_dtype must be float32 or float16 (the dtypes the in-graph verification is checked for)"
        )
    if not 1 <= settings.max_batch_size <= MAX_EAGLE_BATCH_SIZE:
        raise DFlashTrtError(f"--max_batch_size must lie in [1, {MAX_EAGLE_BATCH_SIZE}] for EAGLE-mode engines")
    if settings.max_input_len < 1 or settings.max_input_len > settings.max_seq_len:
        raise DFlashTrtError("--max_input_len must be at least 1 and at most --max_seq_len")
    if settings.workers < 1:
        raise DFlashTrtError("--workers must be at least 1")
    if settings.tokens_per_block not in XQA_TOKENS_PER_BLOCK:
        raise DFlashTrtError(
            f"--tokens_per_block must be one of {', '.join(map(str, XQA_TOKENS_PER_BLOCK))}: speculative decoding "
            "generates through XQA, whose kernels for fp16/bf16 KV caches take no other block size"
        )
    if settings.max_num_tokens > settings.max_seq_len * settings.max_batch_size:
        raise DFlashTrtError(
            f"--max_num_tokens ({settings.max_num_tokens}) exceeds max_seq_len x max_batch_size = "
            f"{settings.max_seq_len * settings.max_batch_size}, which TensorRT-LLM 1.2.x's builder would clip it to"
        )


def check_settings_against_checkpoint(facts: CheckpointFacts, settings: EngineBuildSettings) -> None:
    """The rules that need the checkpoint: its drafts per step (or tree), selector, block width and positions."""
    if facts.max_draft_len > MAX_EAGLE_DRAFT_LEN:
        raise DFlashTrtError(
            f"the drafter's {facts.max_draft_len} drafts per step exceed the EAGLE limit of {MAX_EAGLE_DRAFT_LEN}"
        )
    k = verified_drafts(facts, settings)
    if facts.selector_top_k is not None and facts.selector_top_k > TOPK_MAX_K:
        raise DFlashTrtError(
            f"the DFlash2 selector's top-k ({facts.selector_top_k}) exceeds TensorRT's TopK limit of {TOPK_MAX_K}"
        )
    width = k + 1
    if settings.max_num_tokens < settings.max_batch_size * width:
        raise DFlashTrtError(
            f"--max_num_tokens ({settings.max_num_tokens}) must be at least max_batch_size x (drafts + 1) = "
            f"{settings.max_batch_size} x {width} = {settings.max_batch_size * width}: every generation step "
            "verifies the drafts and the anchor of each request"
        )
    check_positions(facts, settings.max_seq_len)
    weights = weights_qformat(facts)
    check_gemm_plugin(settings.gemm_plugin, weights)
    if weights == NVFP4:
        check_nvfp4_gpu(settings.gpu, "the checkpoint's quantization")
    settings.draft_len_schedule.fitted_to(k)
    if facts.pp_size != 1:
        raise DFlashTrtError("pipeline parallelism is not supported: the drafter needs target taps from every layer")


def check_gemm_plugin(gemm_plugin: str, weights_qformat: str) -> None:
    """An fp8 / nvfp4 GEMM plugin runs only weights quantized in that format (the rule profiles apply too)."""
    if gemm_plugin in QUANTIZED_GEMM_PLUGINS and weights_qformat != gemm_plugin:
        raise DFlashTrtError(f"gemm_plugin {gemm_plugin} needs {gemm_plugin} weights, but they are {weights_qformat}")


def resolved_gemm_plugin(gemm_plugin: str, weights_qformat: str) -> str:
    """The GEMM plugin the engine gets. For NVFP4 weights builder.build() replaces every choice but an explicit
    `disable` by nvfp4 [read: builder.py `build`, plugin.py `PluginConfig.from_arguments`], so the plan says nvfp4
    itself for `auto` and refuses a dtype plugin the engine would not get."""
    check_gemm_plugin(gemm_plugin, weights_qformat)
    if weights_qformat != NVFP4 or gemm_plugin in ("disable", NVFP4):
        return gemm_plugin
    if gemm_plugin == "auto":
        return NVFP4
    raise DFlashTrtError(
        f"gemm_plugin {gemm_plugin} with nvfp4 weights: TensorRT-LLM 1.2.x's builder replaces it by nvfp4 (only "
        "`disable` keeps TensorRT's own GEMMs), so give auto, nvfp4 or disable"
    )


def check_fp8_context_fmha(requested: bool | None, weights: str, kv_cache: str) -> None:
    """A use_fp8_context_fmha the builder would override is refused rather than printed and then not built."""
    settled = fp8_context_fmha(weights, kv_cache)
    if requested is None or requested == settled:
        return
    if requested:
        raise DFlashTrtError(
            "use_fp8_context_fmha needs kv_cache_dtype fp8 and fp8 or nvfp4 weights: TensorRT-LLM 1.2.x's builder "
            "turns it off otherwise"
        )
    raise DFlashTrtError(
        f"use_fp8_context_fmha cannot be off with {weights} weights and an FP8 KV cache: TensorRT-LLM 1.2.x's builder "
        "turns it on, since the paged context FMHA EAGLE needs reads the FP8 cache through it; leave it unset"
    )


def resolve_settings(facts: CheckpointFacts, settings: EngineBuildSettings) -> EngineBuildSettings:
    """`settings` with every value builder.build() would settle itself written out, so the command leaves it nothing
    to override and the BuildConfig and dflash_trt.json say what the engine holds."""
    weights, kv_cache = weights_qformat(facts), kv_cache_format(facts)
    check_kv_cache_format(weights, kv_cache)
    check_fp8_context_fmha(settings.use_fp8_context_fmha, weights, kv_cache)
    return replace(
        settings,
        gemm_plugin=resolved_gemm_plugin(settings.gemm_plugin, weights),
        use_fp8_context_fmha=fp8_context_fmha(weights, kv_cache),
    )


def check_rank_files(checkpoint_dir: Path, facts: CheckpointFacts) -> None:
    """Every rank's weights must be there before trtllm-build spends minutes on the first rank."""
    from dflash_trt.conversion.convert import rank_file  # the converter imports torch; a plan reads no tensor

    ranks = range(facts.tp_size * facts.pp_size)
    missing = [rank_file(r) for r in ranks if not (checkpoint_dir / rank_file(r)).is_file()]
    if missing:
        raise DFlashTrtError(
            f"checkpoint directory {checkpoint_dir} lacks {', '.join(missing)} (tp_size {facts.tp_size}); "
            "convert it again"
        )
