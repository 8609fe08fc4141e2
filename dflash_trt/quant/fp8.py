"""FP8 (E4M3) per-tensor weight quantization, as TensorRT-LLM 1.2.x's `FP8Linear` loads it.

Public functions:
- `fp8_amax(weight)`: the per-tensor absolute maximum, in the weight's dtype (what modelopt's max calibrator keeps).
- `fp8_weight_scale(amax)`: `weights_scaling_factor`, fp32 of shape (1,) = amax / 448.
- `quantize_fp8(weight, scale=None)`: `FP8Weight(weight: float8_e4m3fn (out, in), weights_scaling_factor)`.
- `quantize_fp8_shared(weights)`: several linears TensorRT-LLM fuses into one GEMM (mlp.fc + mlp.gate), quantized
  with one shared scale, the larger of their own.
- `quantize_fp8_experts(stacked)` / `dequantize_fp8_experts(weight, scale, dtype)`: stacked MoE experts
  `[experts, out, in]`, one scale per expert (`[experts, 1]`).
- `dequantize_fp8(weight, scale, dtype)`: what the engine multiplies back, for the golden model.
- `fp8_activation_scale(amax)`: `activation_scaling_factor` (fp32, (1,)) from a calibrated input amax; the same
  formula as the weight scale (modelopt's `get_scaling_factor`).
- `kv_cache_scale(k_amax, v_amax)`: `kv_cache_scaling_factor` (fp32, (1,)): the larger of the K and V scales,
  at least 1.0 (modelopt clamps FP8 KV scales to >= 1 and TensorRT-LLM keeps one scale for K and V).

Bit-exact with modelopt 0.47's TensorRT-LLM export, including its edge cases: an all-zero weight exports
scale 1.0 (modelopt substitutes maxbound for a zero amax), and the amax is clamped to the smallest normal of the
weight's dtype first (which matters for fp16 weights below 6.1e-5). The weight is divided by the scale in fp32 and
rounded to nearest-even by torch's cast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_trt.quant.checks import check_finite_amax, check_weight

FP8_E4M3_MAX = 448.0
# Rows quantized per step: keeps the fp32 temporary small enough to stay in cache.
_CHUNK_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class FP8Weight:
    """An FP8 linear weight and its per-tensor scale, named as in the checkpoint."""

    weight: torch.Tensor
    weights_scaling_factor: torch.Tensor


def fp8_amax(weight: torch.Tensor) -> torch.Tensor:
    """Absolute maximum of the whole tensor, a 0-dim tensor in the weight's dtype."""
    check_weight(weight)
    low, high = torch.aminmax(weight)
    amax = torch.maximum(low.abs(), high.abs())
    check_finite_amax(amax)
    return amax


def fp8_weight_scale(amax: torch.Tensor) -> torch.Tensor:
    """`weights_scaling_factor` (fp32, shape (1,)) for a per-tensor amax in the weight's dtype."""
    amax = amax.reshape(())
    amax = torch.where(amax == 0, torch.full_like(amax, FP8_E4M3_MAX), amax)
    info = torch.finfo(amax.dtype)
    amax = amax.clamp(min=info.tiny, max=info.max)
    return (amax.float() / FP8_E4M3_MAX).reshape(1)


def quantize_fp8(weight: torch.Tensor, scale: torch.Tensor | None = None) -> FP8Weight:
    """Quantize a 2-D linear weight; `scale` (from `fp8_weight_scale` of an amax covering it) overrides its own."""
    check_weight(weight)
    if scale is None:
        scale = fp8_weight_scale(fp8_amax(weight))
    scale = scale.to(device=weight.device, dtype=torch.float32).reshape(1)
    out = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    rows = max(1, _CHUNK_ELEMENTS // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], rows):
        block = weight[start : start + rows]
        out[start : start + rows] = torch.div(block.float(), scale).to(torch.float8_e4m3fn)
    return FP8Weight(weight=out, weights_scaling_factor=scale.clone())


def quantize_fp8_experts(stacked: torch.Tensor) -> FP8Weight:
    """Stacked expert weights `[experts, out, in]` with one scale per expert (`[experts, 1]`), as TensorRT-LLM's
    MoE plugin takes them and modelopt's stacked-expert export writes them. An expert's fc block holds its up and
    gate rows, so its own amax is the larger of the two: the scale modelopt's gate/up fusion shares."""
    scales = torch.stack([fp8_weight_scale(fp8_amax(expert)) for expert in stacked])
    out = torch.empty(stacked.shape, dtype=torch.float8_e4m3fn, device=stacked.device)
    for index, (expert, scale) in enumerate(zip(stacked, scales, strict=True)):
        out[index] = quantize_fp8(expert, scale).weight
    return FP8Weight(weight=out, weights_scaling_factor=scales)


def dequantize_fp8_experts(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Stacked FP8 experts times their per-expert scales."""
    return (weight.float() * scale.float().reshape(-1, 1, 1)).to(dtype)


def quantize_fp8_shared(weights: Sequence[torch.Tensor]) -> list[FP8Weight]:
    """Quantize linears that run as one GEMM with one scale: the largest of their own scales."""
    amax = torch.stack([fp8_amax(w) for w in weights]).max()
    scale = fp8_weight_scale(amax)
    return [quantize_fp8(w, scale) for w in weights]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 weight times its scale, computed in fp32 and cast to `dtype`."""
    return (weight.float() * scale.float()).to(dtype)


def fp8_activation_scale(amax: torch.Tensor) -> torch.Tensor:
    """`activation_scaling_factor` (fp32, shape (1,)) for a calibrated per-tensor input amax."""
    return fp8_weight_scale(amax)


def kv_cache_scale(k_amax: torch.Tensor, v_amax: torch.Tensor) -> torch.Tensor:
    """`kv_cache_scaling_factor` (fp32, shape (1,)) for calibrated K and V amaxes of one attention layer."""
    return torch.maximum(
        torch.maximum(fp8_weight_scale(k_amax), fp8_weight_scale(v_amax)), torch.ones(1, dtype=torch.float32)
    )
