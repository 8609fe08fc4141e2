"""The `trtllm-build` command line of a resolved plan, the BuildConfig dict it implies, and the flags after `--` it
refuses."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from dflash_trt.checkpoint.trtllm_config import ARCHITECTURE
from dflash_trt.errors import DFlashTrtError
from dflash_trt.trtllm.build_settings import EngineBuildSettings
from dflash_trt.trtllm.checkpoint_facts import CheckpointFacts
from dflash_trt.trtllm.eagle_layout import verified_drafts

TRTLLM_BUILD = "trtllm-build"
SPECULATIVE_DECODING_MODE = "eagle"
# tensorrt_llm.models.modeling_utils.SpeculativeDecodingMode is an IntFlag of auto() members; EAGLE is the sixth.
EAGLE_MODE_VALUE = 1 << 5
# trtllm-build flags that set a value the plan sets under another name, or replace the plan's settings wholesale
# (read in the 1.2.x sources of tensorrt_llm/commands/build.py, not run): refused after `--` like the plan's own.
OVERRIDING_BUILD_FLAGS = ("--max_decoder_seq_len", "--paged_kv_cache", "--build_config", "--model_config")


def _switch(flag: bool) -> str:
    return "enable" if flag else "disable"


def model_class_file() -> Path:
    """The file `trtllm-build --model_cls_file` loads; it registers DFlashForCausalLM in MODEL_MAP on import."""
    return Path(__file__).with_name("model.py")


def build_command(checkpoint_dir: str, output_dir: str, max_draft_len: int, settings: EngineBuildSettings) -> list[str]:
    """The trtllm-build command line of `resolve_settings`' output (every value the builder settles written out)."""
    assert settings.use_fp8_context_fmha is not None, "build_command takes resolved settings"
    return [
        TRTLLM_BUILD,
        "--checkpoint_dir",
        checkpoint_dir,
        "--output_dir",
        output_dir,
        "--model_cls_file",
        str(model_class_file()),
        "--model_cls_name",
        ARCHITECTURE,
        "--speculative_decoding_mode",
        SPECULATIVE_DECODING_MODE,
        "--max_draft_len",
        str(max_draft_len),
        "--max_batch_size",
        str(settings.max_batch_size),
        "--max_input_len",
        str(settings.max_input_len),
        "--max_seq_len",
        str(settings.max_seq_len),
        "--max_num_tokens",
        str(settings.max_num_tokens),
        "--max_beam_width",
        str(settings.max_beam_width),
        "--kv_cache_type",
        settings.kv_cache_type,
        "--gemm_plugin",
        settings.gemm_plugin,
        "--use_paged_context_fmha",
        _switch(settings.use_paged_context_fmha),
        "--use_fp8_context_fmha",
        _switch(settings.use_fp8_context_fmha),
        "--multiple_profiles",
        _switch(settings.multiple_profiles),
        "--tokens_per_block",
        str(settings.tokens_per_block),
        "--logits_dtype",
        settings.logits_dtype,
        # trtllm-build's worker pool cannot load our class: ranks run in parallel as separate processes instead.
        "--workers",
        "1",
        *settings.extra_flags,
    ]


def build_config_dict(facts: CheckpointFacts, settings: EngineBuildSettings) -> dict[str, Any]:
    """The dict `trtllm-build` hands to `BuildConfig.from_dict` for this command line (before build() adjusts it)."""
    return {
        "max_input_len": settings.max_input_len,
        "max_seq_len": settings.max_seq_len,
        "max_batch_size": settings.max_batch_size,
        "max_beam_width": settings.max_beam_width,
        "max_num_tokens": settings.max_num_tokens,
        "kv_cache_type": settings.kv_cache_type.upper(),
        "strongly_typed": True,
        "gather_context_logits": False,
        "max_draft_len": verified_drafts(facts, settings),
        "speculative_decoding_mode": EAGLE_MODE_VALUE,
        "plugin_config": {
            "gemm_plugin": None if settings.gemm_plugin == "disable" else settings.gemm_plugin,
            "use_paged_context_fmha": settings.use_paged_context_fmha,
            "use_fp8_context_fmha": settings.use_fp8_context_fmha,
            "multiple_profiles": settings.multiple_profiles,
            "tokens_per_block": settings.tokens_per_block,
            "paged_kv_cache": True,
            "remove_input_padding": True,
            "context_fmha": True,
        },
    }


def check_extra_flags(settings: EngineBuildSettings) -> None:
    """Flags after `--` may only add to the command: one the plan sets (or a prefix trtllm-build's argparse would
    expand to one) would win over the checked value while the BuildConfig and dflash_trt.json still claim ours."""
    ours = [token for token in build_command("C", "O", 1, replace(settings, extra_flags=())) if token.startswith("--")]
    for token in settings.extra_flags:
        name = token.split("=", 1)[0]
        if not name.startswith("--") or name == "--":
            continue
        taken = [flag for flag in (*ours, *OVERRIDING_BUILD_FLAGS) if flag.startswith(name)]
        if taken:
            raise DFlashTrtError(
                f"the trtllm-build flag {name} after `--` would override {taken[0]}, which dflash-trt build sets "
                "and checks itself; give it as a dflash-trt build flag, and after `--` only flags it does not set"
            )
