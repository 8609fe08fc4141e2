"""NVFP4 weight quantization, as TensorRT-LLM 1.2.x's `FP4Linear` loads it (Blackwell).

Format: FP4 E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) in blocks of 16 consecutive
in-features, each block with an FP8 E4M3 scale, the whole tensor with an FP32 global scale:
    w ~= e2m1 * weights_scaling_factor[block] * weights_scaling_factor_2
Packed two values per byte along the in-features: element 2k in the low nibble, 2k+1 in the high nibble;
nibble = sign << 3 | magnitude code (0..7).

Public functions:
- `nvfp4_global_scale(amax)`: `weights_scaling_factor_2`, fp32 0-dim = amax / (6 * 448).
- `quantize_nvfp4(weight, global_scale=None)`: `NVFP4Weight(weight: uint8 (out, in/2),
  weights_scaling_factor: float8_e4m3fn (out, in/16), weights_scaling_factor_2: float32 0-dim)`.
- `quantize_nvfp4_shared(weights)`: linears TensorRT-LLM fuses into one GEMM (mlp.fc + mlp.gate) share the
  global scale, the larger of their own; block scales stay per block.
- `dequantize_nvfp4(packed, block_scale, global_scale, dtype)`: the golden model's view of the weight.
- `unpack_e2m1(packed)`: the float values of the packed nibbles.
- `nvfp4_activation_scale(amax)`: `activation_scaling_factor` (fp32, 0-dim) = input amax / (6 * 448), the global
  scale of the engine's dynamic per-block FP4 input quantization.

Bit-exact with modelopt 0.47's TensorRT-LLM export (`NVFP4QTensor` with the default dynamic-block weight
quantizer): same global scale, same E4M3 block scales (an all-zero block gets 1.0, scales are clamped to
[2**-9, 448]), same rounding (nearest, ties to even, saturating at 6; a value rounding to zero keeps its sign),
same bytes. One deliberate difference: for an all-zero weight modelopt divides 0 by 0 and exports NaN scales;
we export global scale 1/448 (its FP8 exporter's zero-amax substitute, 6 / (6 * 448)), block scales 1.0 and
zero codes, which dequantize to exactly zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import NVFP4_BLOCK_SIZE
from dflash_trt.quant.checks import check_finite_amax, check_weight
from dflash_trt.quant.fp8 import FP8_E4M3_MAX

E2M1_MAX = 6.0
# Smallest block scale kept: E4M3's smallest subnormal, so no block scale underflows to zero.
_MIN_BLOCK_SCALE = 2.0**-9
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Elements rounded per step: the fp32/int32 temporaries stay in cache.
_CHUNK_ELEMENTS = 1 << 18
_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
# fp32 bit pattern >> 22 of 1.0 is 254 (biased exponent 127, top mantissa bit 0); E2M1 code of 1.0 is 2.
_CODE_OFFSET = 254 - 2


@dataclass(frozen=True)
class NVFP4Weight:
    """An NVFP4 linear weight and its scales, named as in the checkpoint."""

    weight: torch.Tensor
    weights_scaling_factor: torch.Tensor
    weights_scaling_factor_2: torch.Tensor


def check_nvfp4_in_features(in_features: int, what: str = "weight") -> None:
    """NVFP4 blocks run along the in-features, so they must come in whole blocks."""
    if in_features % NVFP4_BLOCK_SIZE:
        raise DFlashTrtError(
            f"NVFP4 needs in-features divisible by {NVFP4_BLOCK_SIZE}, but {what} has {in_features}; "
            "exclude it from quantization or choose another format."
        )


def _block_amax(weight: torch.Tensor) -> torch.Tensor:
    """Per-block absolute maximum (out, in/16), fp32.

    With the sign bit cleared, the bit patterns of finite floats order like their values, so the maximum runs on
    integers (several times faster than a float abs + max on CPU) and is exact; inf and NaN sort above every
    finite value, so `check_finite_amax` on the result still catches them."""
    int_dtype = _SAME_WIDTH_INT[weight.dtype]
    magnitude_mask = torch.iinfo(int_dtype).max
    out_features, in_features = weight.shape
    amax = torch.empty((out_features, in_features // NVFP4_BLOCK_SIZE), dtype=weight.dtype, device=weight.device)
    rows = max(1, _CHUNK_ELEMENTS // in_features)
    for start in range(0, out_features, rows):
        bits = weight[start : start + rows].view(int_dtype) & magnitude_mask
        amax[start : start + rows] = (
            bits.reshape(-1, in_features // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE).amax(-1).view(weight.dtype)
        )
    return amax.float()


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """`weights_scaling_factor_2` (fp32, 0-dim) for a per-tensor amax."""
    amax = amax.float().reshape(())
    amax = torch.where(amax == 0, torch.full_like(amax, E2M1_MAX), amax)
    return amax / (E2M1_MAX * FP8_E4M3_MAX)


def _block_scales(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    scale = block_amax / (E2M1_MAX * global_scale)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale.clamp(min=_MIN_BLOCK_SCALE, max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to E2M1 nibbles: nearest, ties to even, saturating at 6, sign kept on zero."""
    magnitude = scaled.abs()
    # Below 1 the grid is 0, 0.5, 1: round(2|x|) is the code (torch.round ties to even).
    small = torch.round(magnitude * 2)
    # From 1 up the grid is a 1-bit-mantissa float: round the fp32 bits to 1 mantissa bit (ties to even)
    # and read exponent and mantissa bit off as the code.
    bits = magnitude.view(torch.int32)
    bits = bits + ((1 << 21) - 1) + ((bits >> 22) & 1)
    large = ((bits >> 22) - _CODE_OFFSET).clamp(max=7)
    codes = torch.where(magnitude < 1, small.to(torch.int32), large).to(torch.uint8)
    return codes | ((scaled < 0).to(torch.uint8) << 3)


def _pack_pairs(codes: torch.Tensor) -> torch.Tensor:
    pairs = codes.reshape(codes.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _pack(weight: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """Divide, round and pack chunk by chunk, so the fp32 temporaries stay in cache."""
    out_features, in_features = weight.shape
    packed = torch.empty((out_features, in_features // 2), dtype=torch.uint8, device=weight.device)
    rows = max(1, _CHUNK_ELEMENTS // in_features)
    for start in range(0, out_features, rows):
        stop = start + rows
        blocks = weight[start:stop].float().reshape(-1, in_features // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
        packed[start:stop] = _pack_pairs(_e2m1_codes(blocks / divisor[start:stop].unsqueeze(-1)))
    return packed


def quantize_nvfp4(weight: torch.Tensor, global_scale: torch.Tensor | None = None) -> NVFP4Weight:
    """Quantize a 2-D linear weight; `global_scale` (from `nvfp4_global_scale` of an amax covering it) overrides
    its own."""
    check_weight(weight)
    check_nvfp4_in_features(weight.shape[1])
    block_amax = _block_amax(weight)
    if global_scale is None:
        amax = block_amax.max()
        check_finite_amax(amax)
        global_scale = nvfp4_global_scale(amax)
    global_scale = global_scale.to(device=weight.device, dtype=torch.float32).reshape(())
    block_scale = _block_scales(block_amax, global_scale)
    packed = _pack(weight, block_scale.float() * global_scale)
    return NVFP4Weight(weight=packed, weights_scaling_factor=block_scale, weights_scaling_factor_2=global_scale)


def quantize_nvfp4_shared(weights: Sequence[torch.Tensor]) -> list[NVFP4Weight]:
    """Quantize linears that run as one GEMM with one global scale: the largest of their own."""
    for w in weights:
        check_weight(w)
        check_nvfp4_in_features(w.shape[1])
    amax = torch.stack([_block_amax(w).max() for w in weights]).max()
    check_finite_amax(amax)
    global_scale = nvfp4_global_scale(amax)
    return [quantize_nvfp4(w, global_scale) for w in weights]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Float32 values of the packed nibbles, shape (..., 2 * packed.shape[-1])."""
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)
    return table[codes.long()]


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """E2M1 value times (block scale times global scale), in fp32, cast to `dtype`."""
    values = unpack_e2m1(packed)
    values = values.reshape(*values.shape[:-1], -1, NVFP4_BLOCK_SIZE)
    scale = block_scale.float() * global_scale.float()
    return (values * scale.unsqueeze(-1)).reshape(*packed.shape[:-1], -1).to(dtype)


def nvfp4_activation_scale(amax: torch.Tensor) -> torch.Tensor:
    """`activation_scaling_factor` (fp32, 0-dim) for a calibrated per-tensor input amax."""
    return nvfp4_global_scale(amax)
