"""Quantized tensors of each linear, under the checkpoint's names.

Public:
- `check_quantizable(tensor_name, shape, qformat, tp_size)`: NVFP4 needs whole 16-wide blocks per rank.
- `quantize_weight(tensor_name, weight, qformat, amax=None)`: {checkpoint name: tensor} for one linear weight;
  `amax` is the shared amax of its fused partners (`weight_amax` of each, maximum).
- `quantize_tensors(tensors, qformat)`: the same over a dict of full (unsharded) tensors, pairing partners itself.

Quantize full tensors, then shard: packed weights and NVFP4 block scales split like their weight (rows, or columns
in whole blocks), per-tensor scales are replicated. The activation and KV-cache scales come from calibration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dflash_trt import tensor_names as names
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import FP8, NONE, NVFP4, NVFP4_BLOCK_SIZE, fused_partners, quant_algo, quantized_linear
from dflash_trt.quant.fp8 import fp8_amax, fp8_weight_scale, quantize_fp8, quantize_fp8_experts
from dflash_trt.quant.nvfp4 import check_nvfp4_in_features, nvfp4_global_scale, quantize_nvfp4

# Row-parallel linears split their in-features over TP ranks (see checkpoint.sharding).
_ROW_PARALLEL = (names.DENSE, names.MLP_PROJ)


def check_quantizable(tensor_name: str, shape: Sequence[int], qformat: str, tp_size: int = 1) -> None:
    """Refuse a weight the format cannot hold: NVFP4 needs in-features, per TP rank, in whole blocks of 16."""
    if qformat != NVFP4 or quantized_linear(tensor_name) is None:
        return
    if len(shape) == 3:
        raise DFlashTrtError(
            f"NVFP4 mixture-of-experts weights ({tensor_name}) cannot be loaded by TensorRT-LLM 1.2.x from a "
            "checkpoint (its NVFP4 preprocessing takes 2-D block scales only); use --qformat fp8 for MoE targets."
        )
    in_features = shape[1]
    check_nvfp4_in_features(in_features, tensor_name)
    module = quantized_linear(tensor_name) or ""
    if tp_size > 1 and module.endswith(_ROW_PARALLEL) and in_features % (NVFP4_BLOCK_SIZE * tp_size):
        raise DFlashTrtError(
            f"NVFP4 with tp_size {tp_size} needs {tensor_name}'s {in_features} in-features to split into whole "
            f"blocks of {NVFP4_BLOCK_SIZE} per rank; choose another tp_size or --qformat fp8."
        )


def weight_amax(weight: torch.Tensor) -> torch.Tensor:
    """Per-tensor absolute maximum, in the weight's dtype; fused partners share the maximum of theirs."""
    return fp8_amax(weight)


def quantize_weight(
    tensor_name: str, weight: torch.Tensor, qformat: str, amax: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors replacing `tensor_name`: itself unchanged when the format leaves it in high precision."""
    quant_algo(qformat)
    module = quantized_linear(tensor_name)
    if qformat == NONE or module is None:
        return {tensor_name: weight}
    check_quantizable(tensor_name, weight.shape, qformat)
    out: dict[str, torch.Tensor] = {}
    if weight.dim() == 3:  # stacked MoE experts: one scale per expert
        fp8 = quantize_fp8_experts(weight)
        out[tensor_name] = fp8.weight
        out[f"{module}.{names.WEIGHTS_SCALING_FACTOR}"] = fp8.weights_scaling_factor
    elif qformat == FP8:
        fp8 = quantize_fp8(weight, None if amax is None else fp8_weight_scale(amax))
        out[tensor_name] = fp8.weight
        out[f"{module}.{names.WEIGHTS_SCALING_FACTOR}"] = fp8.weights_scaling_factor
    else:
        nvfp4 = quantize_nvfp4(weight, None if amax is None else nvfp4_global_scale(amax))
        out[tensor_name] = nvfp4.weight
        out[f"{module}.{names.WEIGHTS_SCALING_FACTOR}"] = nvfp4.weights_scaling_factor
        out[f"{module}.{names.WEIGHTS_SCALING_FACTOR_2}"] = nvfp4.weights_scaling_factor_2
    return out


def quantize_tensors(tensors: Mapping[str, torch.Tensor], qformat: str) -> dict[str, torch.Tensor]:
    """Quantize every linear weight of a dict of full tensors; everything else passes through unchanged."""
    quant_algo(qformat)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = quantized_linear(name)
        amax = None
        partners = fused_partners(module) if module is not None and tensor.dim() == 2 else ()
        if qformat != NONE and len(partners) > 1:
            weights = [f"{m}.{names.WEIGHT}" for m in partners]
            missing = [w for w in weights if w not in tensors]
            if missing:
                raise DFlashTrtError(f"{name} shares its scale with {missing[0]}, which is missing.")
            amax = torch.stack([weight_amax(tensors[w]) for w in weights]).max()
        out.update(quantize_weight(name, tensor, qformat, amax))
    return out
