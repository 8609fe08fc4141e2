"""`dflash_trt.json`, the manifest written beside an engine, and the engine config it records, to which
`check_engine_config` holds the built engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_trt import __version__
from dflash_trt.checkpoint.trtllm_config import ARCHITECTURE
from dflash_trt.errors import DFlashTrtError
from dflash_trt.jsonfile import read_json_object
from dflash_trt.sampling_rules import ENGINE_SAMPLING, HONOURED
from dflash_trt.trtllm.build_limits import REQUIRED_TRTLLM
from dflash_trt.trtllm.build_settings import EngineBuildSettings
from dflash_trt.trtllm.checkpoint_facts import CheckpointFacts
from dflash_trt.trtllm.eagle_layout import chain_eagle_choices, verified_drafts
from dflash_trt.trtllm.engine_lengths import engine_max_seq_len
from dflash_trt.trtllm.plugin import PLUGIN_NAMESPACE
from dflash_trt.trtllm.trtllm_build_command import SPECULATIVE_DECODING_MODE, build_config_dict

MANIFEST_NAME = "dflash_trt.json"
MANIFEST_FORMAT = 1


def manifest(facts: CheckpointFacts, settings: EngineBuildSettings, plugin_library: str) -> dict[str, Any]:
    """`dflash_trt.json`: what runners and the Triton repository generator need beyond TensorRT-LLM's config.json."""
    k = facts.max_draft_len
    return {
        "format": MANIFEST_FORMAT,
        "dflash_trt_version": __version__,
        "tensorrt_llm_version": REQUIRED_TRTLLM,
        "base_architecture": facts.base_architecture,
        "speculative_decoding_mode": SPECULATIVE_DECODING_MODE,
        "block_size": facts.block_size,
        "max_draft_len": verified_drafts(facts, settings),
        "draft_tree": settings.draft_tree,
        "drafter": facts.drafter,
        # The chain over the draft positions (num_eagle_layers): a request's first paths, checked against the
        # layers [read]; a tree engine emits its own paths every step after that.
        "eagle_choices": chain_eagle_choices(k),
        "mask_token_id": facts.mask_token_id,
        "target_layer_ids": list(facts.target_layer_ids),
        "num_target_layers": facts.num_target_layers,
        "num_draft_layers": facts.num_draft_layers,
        "draft_kv_layer_offset": facts.num_target_layers,
        "sampling": ENGINE_SAMPLING,
        "honoured_sampling_parameters": list(HONOURED),
        "plugin_library": plugin_library,
        "plugin_namespace": PLUGIN_NAMESPACE,
        "max_batch_size": settings.max_batch_size,
        "max_seq_len": engine_max_seq_len(facts, settings),
        "tp_size": facts.tp_size,
        "quant_algo": facts.quant_algo,
        "kv_cache_quant_algo": facts.kv_cache_quant_algo,
        "gpu": settings.gpu,
        "sm": settings.route.sm,
        "attention": settings.route.describe(facts.layer_types, tree=settings.draft_tree is not None),
        "draft_len_schedule": settings.draft_len_schedule.text(),
        "engine_config": engine_config(facts, settings),
    }


def engine_config(facts: CheckpointFacts, settings: EngineBuildSettings) -> dict[str, Any]:
    """What the engine's own config.json must hold for these resolved settings: the build_config fields the command
    sets or builder.build() adjusts (max_seq_len + 2K, opt_num_tokens, the plugin dtype, paged context FMHA), and the
    pretrained_config fields runners read. `check_engine_config` holds a built engine to it [read: builder.py
    `build`, `BuildConfig.to_dict`, `EngineConfig.to_dict`; _utils.py `check_max_num_tokens`]."""
    opt_num_tokens = None
    if not settings.multiple_profiles:
        opt_num_tokens = min(settings.max_batch_size * settings.max_beam_width, settings.max_num_tokens)
    build_config = build_config_dict(facts, settings)
    build_config.update(max_seq_len=engine_max_seq_len(facts, settings), opt_num_tokens=opt_num_tokens)
    build_config["plugin_config"]["dtype"] = facts.dtype
    return {
        "build_config": build_config,
        "pretrained_config": {
            "architecture": ARCHITECTURE,
            "dtype": facts.dtype,
            "quantization": {"quant_algo": facts.quant_algo, "kv_cache_quant_algo": facts.kv_cache_quant_algo},
        },
    }


def config_differences(recorded: Any, built: Any, where: str = "") -> list[str]:
    """Every leaf of `recorded` the built config does not hold, as `path: built X, recorded Y`."""
    if isinstance(recorded, dict):
        if not isinstance(built, dict):
            return [f"{where}: built {built!r}, recorded an object"]
        return [
            line
            for key, value in recorded.items()
            for line in config_differences(value, built.get(key), f"{where}.{key}" if where else key)
        ]
    return [] if recorded == built else [f"{where}: built {built!r}, recorded {recorded!r}"]


def check_engine_config(engine_dir: str | Path) -> None:
    """A built engine's config.json must hold what its dflash_trt.json recorded (`engine_config`): otherwise the dry
    run, the manifest and the engine disagree, and what was checked is not what was built."""
    engine_dir = Path(engine_dir)
    manifest_path = engine_dir / MANIFEST_NAME
    recorded = read_json_object(manifest_path, f"{engine_dir} has no {MANIFEST_NAME}").get("engine_config")
    if not isinstance(recorded, dict):
        raise DFlashTrtError(f"{manifest_path} records no engine_config (an engine from an older dflash-trt)")
    built = read_json_object(engine_dir / "config.json", f"{engine_dir} has no config.json")
    differences = config_differences(recorded, built)
    if differences:
        raise DFlashTrtError(
            f"the engine in {engine_dir} differs from what dflash-trt planned: " + "; ".join(differences)
        )
