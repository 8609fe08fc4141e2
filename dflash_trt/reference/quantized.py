"""What a quantized engine computes, in torch: dequantized weights, quantize-dequantized inputs and KV cache.

The golden model runs FP8 / NVFP4 checkpoints through these, so its tokens are the quantized engine's tokens:
weights exactly as stored (dequantized once at load), each quantized linear's input rounded with its static
`activation_scaling_factor` (NVFP4: dynamic 16-element blocks under that global scale), K/V rounded to FP8 with
`kv_cache_scaling_factor` when the cache is FP8, and context attention as FP8 context FMHA computes it where the engine
runs it (`fp8_context_attention`), its output rounded to e4m3 as the kernel writes it (`fp8_attention_rows`).
"""

from __future__ import annotations

import torch

from dflash_trt import tensor_names as names
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import FP8, NONE, NVFP4
from dflash_trt.quant.fp8 import dequantize_fp8, dequantize_fp8_experts
from dflash_trt.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from dflash_trt.reference.kv_injection import FP8_E4M3_MAX, to_cache_dtype


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


def fp8_context_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, kv_scale: torch.Tensor
) -> torch.Tensor:
    """softmax(Q Kᵀ) V as FP8 context FMHA computes it, which TensorRT-LLM 1.2.x engines run for context requests with
    FP8 / NVFP4 weights and an FP8 KV cache (`formats.fp8_context_fmha`). Q is rounded to e4m3 with the KV cache's
    own scale (K and V come from the FP8 cache) and the logits taken in fp32 [read: unfusedAttentionKernels
    `applyBiasRopeUpdateKVCacheV2`: one scale for Q, K and V, bmm1 scale q_scale x k_scale x softmax scale]; each
    probability exp(s - rowmax) is rounded to e4m3 after mapping 1 to e4m3's largest value, as XQA does (mha_sm90.cu,
    "map 1 to fp8_max before conversion to fp8"), before it weights V, and the row is normalised by the unrounded
    sum. Read, not run: the context kernels' own probability scale (assumed XQA's) and their running maximum per key
    tile (here the row's), so a GPU may differ in the last bits of FP8's resolution.

    q `[..., t, d]`, k / v `[..., n, d]` (heads matched already), visible `[..., t, n]` -> `[..., t, d]` float32.
    """
    rounded_q = fake_quantize_fp8(q.float(), kv_scale)
    logits = (rounded_q @ k.float().transpose(-1, -2)) * scale
    logits = logits.masked_fill(~visible, float("-inf"))
    probabilities = torch.exp(logits - logits.amax(-1, keepdim=True))
    total = probabilities.sum(-1, keepdim=True)
    rounded = (probabilities * FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() / FP8_E4M3_MAX
    return (rounded @ v.float()) / total


def reciprocal_input_scale(dense_input_scale: torch.Tensor) -> torch.Tensor:
    """The attention layer's `attention_output_orig_quant_scale` parameter: 1 / the dense layer's input scale, taken
    in double and stored as float32 [read: models/modeling_utils.py `set_fp8_context_fhma`]."""
    return (1.0 / dense_input_scale.double()).float().reshape(1)


def attention_output_orig_quant_scale(dense_input_scale: torch.Tensor, dense_format: str) -> torch.Tensor:
    """The scale TensorRT-LLM 1.2.x quantizes an FP8 attention output with: the parameter above, divided by 6 in
    float32 for NVFP4, whose input scale is an FP4 x FP8 one [read: layers/attention.py
    `Attention._get_output_orig_quant_scale`]."""
    scale = reciprocal_input_scale(dense_input_scale)
    return scale / 6.0 if dense_format == NVFP4 else scale


def fp8_attention_output(out: torch.Tensor, orig_quant: torch.Tensor) -> torch.Tensor:
    """The attention plugin's FP8 output: the fp32 result times the orig->quant scale, saturated, rounded to e4m3."""
    scaled = out.float() * orig_quant.float().reshape(())
    return scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_attention_rows(out: torch.Tensor, orig_quant: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows FP8 context FMHA computes, as the engine's dense layer receives them on B200 / B300: the plugin's e4m3
    output dequantized to `dtype` with the reciprocal scale cast to `dtype` (trtllm/generation_attention.py
    `stock_rows_as_generation_rows`). For FP8 weights the dense's own input rounding makes this exact to leave out;
    for NVFP4 it is the extra e4m3 rounding before the FP4 quantizer."""
    reciprocal = (1.0 / orig_quant.float()).to(dtype).float().reshape(())
    return (fp8_attention_output(out, orig_quant).float() * reciprocal).to(dtype)
