"""RMSNorm exactly as HF Qwen3 / Llama compute it; shared by every torch reference so rounding matches."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Statistics in fp32, scale applied in the input dtype (HF's order of operations)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)
