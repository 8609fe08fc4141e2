"""Pre-quantized modelopt "unified HF" checkpoints: their formats and scales, under our checkpoint's names.

modelopt's `export_hf_checkpoint` writes `hf_quant_config.json` and, per quantized HF linear, `weight`,
`weight_scale`, `weight_scale_2` (NVFP4), `input_scale`, plus `k_proj.k_scale` / `v_proj.v_scale` for an FP8 KV
cache. TensorRT-LLM fuses q/k/v into `qkv` and runs gate/up as one GEMM, so those members must share their
per-tensor scales. modelopt 0.47's HF export already shares NVFP4 global scales and input scales across them,
so their bytes concatenate unchanged; FP8 weight scales it leaves per projection, and a member whose scale is not
the group's largest is re-rounded to the largest (at most one FP8 rounding per element, as TensorRT-LLM's own
loaders do when they fuse).

Public:
- `read_hf_quant_config(model_dir)`: `PrequantizedFormat(qformat, kv_cache_dtype, exclude_modules)`, or None for a
  checkpoint without `hf_quant_config.json`.
- `fuse_prequantized(parts, qformat)`: one TensorRT-LLM linear's tensors (`weight`, `weights_scaling_factor`,
  [`weights_scaling_factor_2`], `activation_scaling_factor`) from its HF members' tensors, in fused order.
- `prequantized_kv_cache_scale(k_scale, v_scale)`: `kv_cache_scaling_factor`, the larger of the two, unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_trt.checkpoint import names
from dflash_trt.errors import DFlashTrtError
from dflash_trt.quant.formats import FP8, NONE, NVFP4
from dflash_trt.quant.fp8 import dequantize_fp8, quantize_fp8

HF_QUANT_CONFIG = "hf_quant_config.json"
_ALGOS = {"FP8": FP8, "NVFP4": NVFP4}
# HF tensor leaves of one quantized linear.
HF_WEIGHT = "weight"
HF_WEIGHT_SCALE = "weight_scale"
HF_WEIGHT_SCALE_2 = "weight_scale_2"
HF_INPUT_SCALE = "input_scale"


@dataclass(frozen=True)
class PrequantizedFormat:
    qformat: str
    kv_cache_dtype: str
    exclude_modules: tuple[str, ...]


def read_hf_quant_config(model_dir: str | Path) -> PrequantizedFormat | None:
    path = Path(model_dir) / HF_QUANT_CONFIG
    if not path.is_file():
        return None
    try:
        section = json.loads(path.read_text())["quantization"]
        algo, kv = section.get("quant_algo"), section.get("kv_cache_quant_algo")
        exclude = tuple(section.get("exclude_modules") or ())
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise DFlashTrtError(f"{path} is not a modelopt quantization config.") from None
    if algo not in _ALGOS or kv not in (None, "FP8"):
        raise DFlashTrtError(
            f"{path}: quant_algo {algo!r} / kv_cache_quant_algo {kv!r} is not supported (FP8 or NVFP4 weights, "
            "FP8 or no KV-cache quantization)."
        )
    if algo == "NVFP4" and section.get("group_size", 16) != 16:
        raise DFlashTrtError(f"{path}: NVFP4 group_size must be 16, got {section.get('group_size')}.")
    return PrequantizedFormat(_ALGOS[algo], FP8 if kv == "FP8" else NONE, exclude)


def _require(part: Mapping[str, torch.Tensor], leaf: str, index: int) -> torch.Tensor:
    if leaf not in part:
        raise DFlashTrtError(f"pre-quantized linear (member {index}) has no '{leaf}' tensor.")
    return part[leaf]


def _fuse_fp8(parts: Sequence[Mapping[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    scales = [_require(p, HF_WEIGHT_SCALE, i).float().reshape(1) for i, p in enumerate(parts)]
    shared = torch.stack(scales).max(dim=0).values
    weights = []
    for i, (part, scale) in enumerate(zip(parts, scales, strict=True)):
        weight = _require(part, HF_WEIGHT, i)
        if weight.dtype != torch.float8_e4m3fn:
            raise DFlashTrtError(f"pre-quantized FP8 linear (member {i}) stores {weight.dtype}, not float8_e4m3fn.")
        if not torch.equal(scale, shared):
            weight = quantize_fp8(dequantize_fp8(weight, scale), shared).weight
        weights.append(weight)
    return torch.cat(weights), shared


def _fuse_nvfp4(parts: Sequence[Mapping[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    globals_ = [_require(p, HF_WEIGHT_SCALE_2, i).float().reshape(()) for i, p in enumerate(parts)]
    shared = torch.stack(globals_).max()
    weights, block_scales = [], []
    for i, (part, global_scale) in enumerate(zip(parts, globals_, strict=True)):
        weight, block = _require(part, HF_WEIGHT, i), _require(part, HF_WEIGHT_SCALE, i)
        if weight.dtype != torch.uint8 or block.dtype != torch.float8_e4m3fn:
            raise DFlashTrtError(f"pre-quantized NVFP4 linear (member {i}) is not packed uint8 with E4M3 scales.")
        if not torch.equal(global_scale, shared):
            # Keep each block's product block_scale * global_scale: rescale the block scales (one E4M3 rounding).
            block = (block.float() * global_scale / shared).clamp(min=2.0**-9, max=448.0).to(torch.float8_e4m3fn)
        weights.append(weight)
        block_scales.append(block)
    return torch.cat(weights), torch.cat(block_scales), shared


def fuse_prequantized(parts: Sequence[Mapping[str, torch.Tensor]], qformat: str) -> dict[str, torch.Tensor]:
    """Tensors of one TensorRT-LLM linear, by leaf name, from its HF members (q, k, v / gate, up / one linear)."""
    if not parts:
        raise DFlashTrtError("a fused linear needs at least one member.")
    input_scales = [_require(p, HF_INPUT_SCALE, i).float() for i, p in enumerate(parts)]
    input_scale = torch.stack([s.reshape(()) for s in input_scales]).max()
    if qformat == FP8:
        weight, scale = _fuse_fp8(parts)
        return {names.WEIGHT: weight, names.WEIGHTS_SCALING_FACTOR: scale,
                names.ACTIVATION_SCALING_FACTOR: input_scale.reshape(1)}
    if qformat == NVFP4:
        weight, block, global_scale = _fuse_nvfp4(parts)
        return {names.WEIGHT: weight, names.WEIGHTS_SCALING_FACTOR: block,
                names.WEIGHTS_SCALING_FACTOR_2: global_scale, names.ACTIVATION_SCALING_FACTOR: input_scale}
    raise DFlashTrtError(f"cannot fuse pre-quantized tensors of format {qformat!r}.")


def prequantized_kv_cache_scale(k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """TensorRT-LLM keeps one KV-cache scale per layer; the checkpoint's K and V scales merge by maximum."""
    return torch.maximum(k_scale.float().reshape(1), v_scale.float().reshape(1))
