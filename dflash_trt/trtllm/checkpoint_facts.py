"""A converted checkpoint as the build sees it: its config.json read back through the converter's own reader
(`specs_from_config`), and its formats under our flag names."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_trt.checkpoint.trtllm_config import specs_from_config
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import FP8, NONE, QFORMATS, quant_algo
from dflash_trt.jsonfile import read_json_object
from dflash_trt.rope import RopeConfig
from dflash_trt.spec import TARGET_ARCHITECTURES, DraftSpec


@dataclass(frozen=True)
class CheckpointFacts:
    """What the build needs from a converted checkpoint's config.json, already validated."""

    base_architecture: str
    dtype: str
    num_target_layers: int
    target_heads: int
    target_kv_heads: int
    target_head_size: int
    num_draft_layers: int
    draft_heads: int
    draft_kv_heads: int
    draft_head_size: int
    block_size: int
    max_draft_len: int  # drafts per step: block_size - 1, or block_size when the anchor's slot drafts
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]
    causal: tuple[bool, ...]
    sliding_window: int | None
    tp_size: int
    pp_size: int
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    target_rope: RopeConfig
    draft_rope: RopeConfig
    max_position_embeddings: int
    draft_quant_algo: str | None = None
    draft_kv_cache_quant_algo: str | None = None
    sparse_layers: tuple[int, ...] = ()  # mixture-of-experts layers of a Qwen3-MoE target
    drafter: dict[str, Any] = field(default_factory=dict)  # what the manifest records about the drafter's kind
    selector_top_k: int | None = None  # DFlash2's candidates per slot


def read_checkpoint_facts(checkpoint_dir: str | Path) -> CheckpointFacts:
    """Read the converted checkpoint's config.json back into specs (the converter's contract) and keep the facts."""
    path = Path(checkpoint_dir) / "config.json"
    config = read_json_object(
        path, f"checkpoint directory {checkpoint_dir} has no config.json; run `dflash-trt convert` first"
    )
    target, draft = specs_from_config(config)
    if target.architecture not in TARGET_ARCHITECTURES:
        raise DFlashTrtError(
            f"{path}: base architecture {target.architecture!r} is not one of {', '.join(TARGET_ARCHITECTURES)}"
        )
    if config.get("max_draft_len") != draft.num_drafts:
        raise DFlashTrtError(f"{path}: max_draft_len must equal the drafter's drafts per step, {draft.num_drafts}")
    mapping = config.get("mapping") or {}
    quant = config.get("quantization") or {}
    draft_quant = config["dflash_config"].get("quantization") or {}
    return CheckpointFacts(
        base_architecture=target.architecture,
        dtype=str(config.get("dtype")),
        num_target_layers=target.num_hidden_layers,
        target_heads=target.num_attention_heads,
        target_kv_heads=target.num_key_value_heads,
        target_head_size=target.head_dim,
        num_draft_layers=draft.num_hidden_layers,
        draft_heads=draft.num_attention_heads,
        draft_kv_heads=draft.num_key_value_heads,
        draft_head_size=draft.head_dim,
        block_size=draft.block_size,
        mask_token_id=draft.mask_token_id,
        target_layer_ids=tuple(draft.target_layer_ids),
        layer_types=tuple(draft.layer_types),
        causal=tuple(draft.causal),
        sliding_window=draft.sliding_window,
        tp_size=int(mapping.get("tp_size", 1)),
        pp_size=int(mapping.get("pp_size", 1)),
        quant_algo=quant.get("quant_algo"),
        kv_cache_quant_algo=quant.get("kv_cache_quant_algo"),
        target_rope=target.rope,
        draft_rope=draft.rope,
        max_position_embeddings=target.max_position_embeddings,
        draft_quant_algo=draft_quant.get("quant_algo"),
        draft_kv_cache_quant_algo=draft_quant.get("kv_cache_quant_algo"),
        sparse_layers=target.moe.sparse_layers if target.moe is not None else (),
        max_draft_len=draft.num_drafts,
        drafter=drafter_record(draft),
        selector_top_k=None if draft.dflash2 is None else draft.dflash2.selector_top_k,
    )


def drafter_record(draft: DraftSpec) -> dict[str, Any]:
    """The drafter's kind as `dflash_trt.json` states it."""
    conv = draft.dflash2
    return {
        "architecture": draft.architecture,
        "checkpoint_format": draft.checkpoint_format,
        "sample_from_anchor": draft.sample_from_anchor,
        "draft_vocab_size": draft.draft_vocab_size,
        "dflash2": None if conv is None else dict(vars(conv)),
    }


def weights_qformat(facts: CheckpointFacts) -> str:
    """The checkpoint's weight format under our --qformat names."""
    by_algo = {quant_algo(qformat): qformat for qformat in QFORMATS}
    return by_algo.get(facts.quant_algo, str(facts.quant_algo))


def kv_cache_format(facts: CheckpointFacts) -> str:
    """The checkpoint's KV-cache format under our --kv_cache_dtype names."""
    return FP8 if facts.kv_cache_quant_algo == quant_algo(FP8) else NONE
