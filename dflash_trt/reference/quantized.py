"""What a quantized engine computes, in torch: dequantized weights, quantize-dequantized inputs and KV cache.

The golden model runs FP8 / NVFP4 checkpoints through these, so its tokens are the quantized engine's tokens:
weights exactly as stored (dequantized once at load), each quantized linear's input rounded with its static
`activation_scaling_factor` (NVFP4: dynamic 16-element blocks under that global scale), K/V rounded to FP8 with
`kv_cache_scaling_factor` when the cache is FP8.
"""

from __future__ import annotations

import torch

from dflash_trt import tensor_names as names
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import FP8, NONE, NVFP4
from dflash_trt.quant.fp8 import dequantize_fp8, dequantize_fp8_experts
from dflash_trt.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from dflash_trt.reference.kv_injection import to_cache_dtype


def weight_format(weight: torch.Tensor) -> str:
    """The checkpoint stores FP8 weights as float8_e4m3fn and NVFP4 weights as packed uint8."""
    if weight.dtype == torch.float8_e4m3fn:
        return FP8
    if weight.dtype == torch.uint8:
        return NVFP4
    return NONE


def dequantized_weight(tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """`module`'s weight as the engine's GEMM sees it, in fp32."""
    weight = tensors[f"{module}.{names.WEIGHT}"]
    kind = weight_format(weight)
    if kind == NONE:
        return weight
    try:
        scale = tensors[f"{module}.{names.WEIGHTS_SCALING_FACTOR}"]
        if kind == FP8:
            return dequantize_fp8(weight, scale) if weight.dim() == 2 else dequantize_fp8_experts(weight, scale)
        return dequantize_nvfp4(weight, scale, tensors[f"{module}.{names.WEIGHTS_SCALING_FACTOR_2}"])
    except KeyError as exc:
        raise DFlashTrtError(f"quantized weight of {module} has no {exc.args[0]}") from None


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round to FP8 E4M3 under a per-tensor scale (multiply by its reciprocal, saturate), then scale back."""
    scale = scale.float().reshape(())
    stored = to_cache_dtype(x.float(), torch.float8_e4m3fn, float(1.0 / scale))
    return (stored.float() * scale).to(x.dtype)


def fake_quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Dynamic NVFP4 quantization of an activation: per 16-element block of the last dim, under a global scale."""
    flat = x.reshape(-1, x.shape[-1]).float()
    q = quantize_nvfp4(flat, global_scale.float().reshape(()))
    values = dequantize_nvfp4(q.weight, q.weights_scaling_factor, q.weights_scaling_factor_2)
    return values.reshape(x.shape).to(x.dtype)


def fake_quantize_input(x: torch.Tensor, scale: torch.Tensor | None, kind: str) -> torch.Tensor:
    if scale is None or kind == NONE:
        return x
    return fake_quantize_fp8(x, scale) if kind == FP8 else fake_quantize_nvfp4(x, scale)
