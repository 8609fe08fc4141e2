"""Quantization formats of a converted checkpoint: their names, the TensorRT-LLM `quantization` config, which
modules stay in high precision, and the quantized tensors of each linear under the checkpoint's names.

Public:
- `QFORMATS` ("none", "fp8", "nvfp4") and `KV_CACHE_DTYPES` ("none", "fp8"): the `--qformat` /
  `--dflash_qformat` / `--kv_cache_dtype` choices; `quant_algo(qformat)` is TensorRT-LLM's name (or None).
- `EXCLUDE_MODULES`: engine modules kept in the checkpoint dtype (why: docs/quantization.md).
- `quantization_config(qformat, kv_cache_dtype)`: the `quantization` dict of config.json (top level and
  `dflash_config`), as TensorRT-LLM 1.2.x's `QuantConfig.from_dict` reads it.
- `is_excluded(module, exclude_modules)`: TensorRT-LLM's rule (fnmatch on the full module name).
- `quantized_linear(tensor_name)`: the module of a linear weight the format quantizes, else None.
- `fused_partners(module)`: modules TensorRT-LLM runs as one GEMM with it (mlp.fc with mlp.gate).
- `check_quantizable(tensor_name, shape, qformat, tp_size)`: NVFP4 needs whole 16-wide blocks per rank.
- `quantize_weight(tensor_name, weight, qformat, amax=None)`: {checkpoint name: tensor} for one linear weight;
  `amax` is the shared amax of its fused partners (`weight_amax` of each, maximum).
- `quantize_tensors(tensors, qformat)`: the same over a dict of full (unsharded) tensors, pairing partners itself.

Quantize full tensors, then shard: packed weights and NVFP4 block scales split like their weight (rows, or columns
in whole blocks), per-tensor scales are replicated. The activation and KV-cache scales come from calibration.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence

import torch

from dflash_trt.checkpoint import names
from dflash_trt.errors import DFlashTrtError
from dflash_trt.quant.fp8 import fp8_amax, fp8_weight_scale, quantize_fp8, quantize_fp8_experts
from dflash_trt.quant.nvfp4 import NVFP4_BLOCK_SIZE, check_nvfp4_in_features, nvfp4_global_scale, quantize_nvfp4

NONE, FP8, NVFP4 = "none", "fp8", "nvfp4"
QFORMATS = (NONE, FP8, NVFP4)
KV_CACHE_DTYPES = (NONE, FP8)
_QUANT_ALGO = {NONE: None, FP8: "FP8", NVFP4: "NVFP4"}

LM_HEAD_MODULE = names.LM_HEAD.removesuffix("." + names.WEIGHT)
DRAFT_FC_MODULE = names.DRAFT_FC.removesuffix("." + names.WEIGHT)
EXCLUDE_MODULES = (LM_HEAD_MODULE, DRAFT_FC_MODULE)

# Row-parallel linears split their in-features over TP ranks (see checkpoint.sharding).
_ROW_PARALLEL = (names.DENSE, names.MLP_PROJ)
_LAYER_PREFIXES = (names.TARGET_PREFIX + ".layers.", names.DRAFT_PREFIX + ".layers.")


def _check_choice(value: str, choices: Sequence[str], flag: str) -> None:
    if value not in choices:
        raise DFlashTrtError(f"{flag} must be one of {', '.join(choices)}, got {value!r}.")


def quant_algo(qformat: str) -> str | None:
    _check_choice(qformat, QFORMATS, "--qformat")
    return _QUANT_ALGO[qformat]


def quantization_config(
    qformat: str, kv_cache_dtype: str = NONE, exclude_modules: Iterable[str] = EXCLUDE_MODULES
) -> dict:
    """The `quantization` dict of a converted checkpoint's config.json."""
    _check_choice(kv_cache_dtype, KV_CACHE_DTYPES, "--kv_cache_dtype")
    algo = quant_algo(qformat)
    return {
        "quant_algo": algo,
        "kv_cache_quant_algo": _QUANT_ALGO[kv_cache_dtype],
        "group_size": NVFP4_BLOCK_SIZE,
        "exclude_modules": list(exclude_modules) if algo else [],
    }


def is_excluded(module: str, exclude_modules: Iterable[str] = EXCLUDE_MODULES) -> bool:
    return any(fnmatch.fnmatchcase(module, pattern) for pattern in exclude_modules)


def _linear_module(tensor_name: str) -> str | None:
    """Module path of any linear weight of the checkpoint (quantized or not)."""
    suffix = "." + names.WEIGHT
    if not tensor_name.endswith(suffix):
        return None
    module = tensor_name[: -len(suffix)]
    if module in (LM_HEAD_MODULE, DRAFT_FC_MODULE):
        return module
    for prefix in _LAYER_PREFIXES:
        if module.startswith(prefix):
            index, _, rest = module[len(prefix) :].partition(".")
            if index.isdigit() and rest in names.LINEAR_MODULES:
                return module
    return None


def quantized_linear(tensor_name: str, exclude_modules: Iterable[str] = EXCLUDE_MODULES) -> str | None:
    """The module of a linear weight that quantization replaces, or None (not a linear, or excluded)."""
    module = _linear_module(tensor_name)
    if module is None or is_excluded(module, exclude_modules):
        return None
    return module


def fused_partners(module: str) -> tuple[str, ...]:
    """The modules sharing one GEMM (and so one per-tensor scale) with `module`, itself included, in order."""
    for member in (names.MLP_FC, names.MLP_GATE):
        if module.endswith("." + member):
            stem = module[: -len(member)]
            return (stem + names.MLP_FC, stem + names.MLP_GATE)
    return (module,)


def check_quantizable(tensor_name: str, shape: Sequence[int], qformat: str, tp_size: int = 1) -> None:
    """Refuse a weight the format cannot hold: NVFP4 needs in-features, per TP rank, in whole blocks of 16, and
    stacked MoE experts stay out of NVFP4 (TensorRT-LLM 1.2.x's checkpoint loader takes only 2-D block scales)."""
    if qformat != NVFP4 or quantized_linear(tensor_name) is None:
        return
    if len(shape) == 3:
        raise DFlashTrtError(
            f"NVFP4 mixture-of-experts weights ({tensor_name}) cannot be loaded by TensorRT-LLM 1.2.x from a "
            "checkpoint (its NVFP4 preprocessing takes 2-D block scales only); use --qformat fp8 for MoE targets."
        )
    in_features = shape[1]
    check_nvfp4_in_features(in_features, tensor_name)
    module = _linear_module(tensor_name) or ""
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
        q = quantize_fp8_experts(weight)
        out[tensor_name] = q.weight
        out[f"{module}.{names.WEIGHTS_SCALING_FACTOR}"] = q.weights_scaling_factor
    elif qformat == FP8:
        q = quantize_fp8(weight, None if amax is None else fp8_weight_scale(amax))
        out[tensor_name] = q.weight
        out[f"{module}.{names.WEIGHTS_SCALING_FACTOR}"] = q.weights_scaling_factor
    else:
        q = quantize_nvfp4(weight, None if amax is None else nvfp4_global_scale(amax))
        out[tensor_name] = q.weight
        out[f"{module}.{names.WEIGHTS_SCALING_FACTOR}"] = q.weights_scaling_factor
        out[f"{module}.{names.WEIGHTS_SCALING_FACTOR_2}"] = q.weights_scaling_factor_2
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
