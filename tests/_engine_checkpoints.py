"""Hand-made converted checkpoints for engine-planning tests: a config.json from small HF configs and empty rank
files (planning reads only the config and checks that the rank files exist)."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_trt.checkpoint.trtllm_config import checkpoint_config
from dflash_trt.spec import parse_draft_config, parse_target_config

TARGET_HF = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
}
DRAFT_HF = {
    "architectures": ["DFlashDraftModel"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rope_theta": 1000000.0,
    "block_size": 16,
    "dflash_config": {"mask_token_id": 999, "target_layer_ids": [1, 4]},
}


def write_checkpoint(root: Path, target_hf: dict = TARGET_HF, draft_hf: dict = DRAFT_HF, **overrides) -> Path:
    target = parse_target_config(target_hf)
    draft = parse_draft_config(draft_hf, target)
    config = checkpoint_config(target, draft, "bfloat16")
    config.update(overrides)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    mapping = config.get("mapping") or {}
    for rank in range(mapping.get("tp_size", 1) * mapping.get("pp_size", 1)):  # planning checks only their presence
        (root / f"rank{rank}.safetensors").touch()
    return root
