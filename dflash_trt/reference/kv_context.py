"""Context K/V of the drafter from projected tap features: k = RoPE(k_norm(k_raw)), v = v_raw."""

from __future__ import annotations

import torch

from dflash_trt.reference.norm import rms_norm
from dflash_trt.reference.rope import RopeConfig, apply_rope, rope_cos_sin


def inject_context_kv(
    k_raw: torch.Tensor,
    v_raw: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    rope: RopeConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k_raw/v_raw `[..., tokens, kv_heads, head_dim]`, positions `[..., tokens]`."""
    cos, sin = rope_cos_sin(positions, rope)
    k = apply_rope(rms_norm(k_raw, k_norm, eps), cos[..., None, :], sin[..., None, :])
    return k, v_raw
