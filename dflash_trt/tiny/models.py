"""Shapes of the tiny target (HF Qwen3) and its DFlash drafter (z-lab format)."""

from __future__ import annotations

from typing import Any

from transformers import Qwen3Config

VOCAB_SIZE = 128  # tokenizer has 99 entries; rows above are padding, like real checkpoints' padded vocab
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 512
TARGET_LAYERS = 5
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
ROPE_THETA = 10000.0
MAX_POSITIONS = 256
RMS_NORM_EPS = 1e-6

DRAFT_LAYERS = 2
BLOCK_SIZE = 16
TARGET_LAYER_IDS = [1, 3]


# Attention and block shapes the target and the drafter share (the drafter reuses the target's embeddings).
SHARED: dict[str, Any] = dict(
    num_attention_heads=NUM_HEADS,
    num_key_value_heads=NUM_KV_HEADS,
    head_dim=HEAD_DIM,
    hidden_act="silu",
    max_position_embeddings=MAX_POSITIONS,
    rms_norm_eps=RMS_NORM_EPS,
    rope_theta=ROPE_THETA,
    tie_word_embeddings=False,
    attention_bias=False,
    dtype="float32",
)


def target_config(eos_token_id: int, pad_token_id: int) -> Qwen3Config:
    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=TARGET_LAYERS,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=eos_token_id,
        **SHARED,
    )


def eos_token_id(target: Qwen3Config) -> int:
    """The tiny target's one end-of-sequence id (the padding of its training rows)."""
    eos = target.eos_token_id
    if not isinstance(eos, int):
        raise ValueError(f"the tiny target has one end-of-sequence id, got {eos!r}")
    return eos


def draft_config(target: Qwen3Config, mask_token_id: int) -> Qwen3Config:
    """Same hidden size as the target (the drafter reuses its embeddings and lm_head)."""
    return Qwen3Config(
        architectures=["DFlashDraftModel"],
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=DRAFT_LAYERS,
        **_dflash_keys(target, mask_token_id),
        **SHARED,
    )


def _dflash_keys(target: Qwen3Config, mask_token_id: int) -> dict[str, Any]:
    """The z-lab drafter's keys, which a Qwen3Config carries as extra attributes."""
    return {
        "num_target_layers": target.num_hidden_layers,
        "block_size": BLOCK_SIZE,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(TARGET_LAYER_IDS)},
    }
