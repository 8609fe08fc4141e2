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
- `share_prequantized(parts, qformat)`: each HF member's tensors under our leaf names (`weight`,
  `weights_scaling_factor`, [`weights_scaling_factor_2`], `activation_scaling_factor`) with the per-tensor
  scales of its fused group shared (gate/up → mlp.fc / mlp.gate).
- `fuse_prequantized(parts, qformat)`: the same, concatenated into one TensorRT-LLM linear (q, k, v → qkv).
- `prequantized_module_tensors(hf_tensors, hf_layer_prefix, layer_prefix, module, fmt)`: one of our linears
  (qkv with the layer's KV-cache scale); `prequantized_layer_tensors(...)`: all of a decoder layer's; `hf_members`:
  the HF modules one of our linears is built from. Norms and biases stay the converter's.
- `prequantized_kv_cache_scale(k_scale, v_scale)`: `kv_cache_scaling_factor`, the larger of the two, unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_trt import tensor_names as names
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import FP8, NONE, NVFP4

if TYPE_CHECKING:
    import torch

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


def _share_fp8(parts: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    import torch

    from dflash_trt.quant.fp8 import dequantize_fp8, quantize_fp8

    scales = [_require(p, HF_WEIGHT_SCALE, i).float().reshape(1) for i, p in enumerate(parts)]
    shared = torch.stack(scales).max(dim=0).values
    out = []
    for i, (part, scale) in enumerate(zip(parts, scales, strict=True)):
        weight = _require(part, HF_WEIGHT, i)
        if weight.dtype != torch.float8_e4m3fn:
            raise DFlashTrtError(f"pre-quantized FP8 linear (member {i}) stores {weight.dtype}, not float8_e4m3fn.")
        if not torch.equal(scale, shared):
            weight = quantize_fp8(dequantize_fp8(weight, scale), shared).weight
        out.append({names.WEIGHT: weight, names.WEIGHTS_SCALING_FACTOR: shared.clone()})
    return out


def _share_nvfp4(parts: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    import torch

    globals_ = [_require(p, HF_WEIGHT_SCALE_2, i).float().reshape(()) for i, p in enumerate(parts)]
    shared = torch.stack(globals_).max()
    out = []
    for i, (part, global_scale) in enumerate(zip(parts, globals_, strict=True)):
        weight, block = _require(part, HF_WEIGHT, i), _require(part, HF_WEIGHT_SCALE, i)
        if weight.dtype != torch.uint8 or block.dtype != torch.float8_e4m3fn:
            raise DFlashTrtError(f"pre-quantized NVFP4 linear (member {i}) is not packed uint8 with E4M3 scales.")
        if not torch.equal(global_scale, shared):
            # Keep each block's product block_scale * global_scale: rescale the block scales (one E4M3 rounding).
            block = (block.float() * global_scale / shared).clamp(min=2.0**-9, max=448.0).to(torch.float8_e4m3fn)
        out.append(
            {names.WEIGHT: weight, names.WEIGHTS_SCALING_FACTOR: block, names.WEIGHTS_SCALING_FACTOR_2: shared.clone()}
        )
    return out


def share_prequantized(parts: Sequence[Mapping[str, torch.Tensor]], qformat: str) -> list[dict[str, torch.Tensor]]:
    """Each HF member's tensors, by our leaf names, with the per-tensor scales its fused group must share."""
    import torch

    if not parts:
        raise DFlashTrtError("a fused linear needs at least one member.")
    if qformat not in (FP8, NVFP4):
        raise DFlashTrtError(f"cannot carry pre-quantized tensors of format {qformat!r}.")
    input_scale = torch.stack([_require(p, HF_INPUT_SCALE, i).float().reshape(()) for i, p in enumerate(parts)]).max()
    members = _share_fp8(parts) if qformat == FP8 else _share_nvfp4(parts)
    for member in members:
        member[names.ACTIVATION_SCALING_FACTOR] = input_scale.reshape(1) if qformat == FP8 else input_scale.clone()
    return members


def fuse_prequantized(parts: Sequence[Mapping[str, torch.Tensor]], qformat: str) -> dict[str, torch.Tensor]:
    """Tensors of one TensorRT-LLM linear, by leaf name, from its HF members (q, k, v / one linear) in order."""
    import torch

    members = share_prequantized(parts, qformat)
    fused = dict(members[0])
    for leaf in (names.WEIGHT, names.WEIGHTS_SCALING_FACTOR):
        if fused[leaf].dim() >= 2:
            fused[leaf] = torch.cat([m[leaf] for m in members])
    return fused


# HF modules of one decoder layer → our modules, grouped by the scale they share.
_HF_GROUPS = (
    (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), (names.QKV,)),
    (("self_attn.o_proj",), (names.DENSE,)),
    (("mlp.gate_proj", "mlp.up_proj"), (names.MLP_FC, names.MLP_GATE)),
    (("mlp.down_proj",), (names.MLP_PROJ,)),
)


def prequantized_module_tensors(
    hf_tensors: Mapping[str, torch.Tensor],
    hf_layer_prefix: str,
    layer_prefix: str,
    module: str,
    fmt: PrequantizedFormat,
) -> dict[str, torch.Tensor]:
    """One of our linears (`names.QKV`, ...) of a decoder layer from its HF members, under our checkpoint names;
    qkv also carries the layer's KV-cache scale when the checkpoint has an FP8 KV cache.

    `hf_tensors` needs at least the members' tensors; `hf_layer_prefix` is e.g. "model.layers.3", `layer_prefix`
    e.g. `names.target_layer(3)`."""

    def part(hf_module: str) -> dict[str, torch.Tensor]:
        prefix = f"{hf_layer_prefix}.{hf_module}."
        return {name[len(prefix) :]: t for name, t in hf_tensors.items() if name.startswith(prefix)}

    hf_modules, modules = next((h, m) for h, m in _HF_GROUPS if module in m)
    parts = [part(m) for m in hf_modules]
    if len(modules) == 1:
        tensors = fuse_prequantized(parts, fmt.qformat)
    else:
        tensors = share_prequantized(parts, fmt.qformat)[modules.index(module)]
    out = {f"{layer_prefix}.{module}.{leaf}": t for leaf, t in tensors.items()}
    if module == names.QKV and fmt.kv_cache_dtype == FP8:
        k, v = part("self_attn.k_proj").get("k_scale"), part("self_attn.v_proj").get("v_scale")
        if k is None or v is None:
            raise DFlashTrtError(f"{hf_layer_prefix} has no k_scale / v_scale for its FP8 KV cache.")
        out[names.kv_cache_scale(layer_prefix)] = prequantized_kv_cache_scale(k, v)
    return out


def hf_members(module: str) -> tuple[str, ...]:
    """HF modules (relative to a layer) that one of our linears is built from."""
    return next(h for h, m in _HF_GROUPS if module in m)


def prequantized_layer_tensors(
    hf_tensors: Mapping[str, torch.Tensor], hf_layer_prefix: str, layer_prefix: str, fmt: PrequantizedFormat
) -> dict[str, torch.Tensor]:
    """Every quantized linear tensor (and the KV-cache scale) of one decoder layer, under our checkpoint names."""
    out: dict[str, torch.Tensor] = {}
    for _, modules in _HF_GROUPS:
        for module in modules:
            out.update(prequantized_module_tensors(hf_tensors, hf_layer_prefix, layer_prefix, module, fmt))
    return out


def prequantized_kv_cache_scale(k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """TensorRT-LLM keeps one KV-cache scale per layer; the checkpoint's K and V scales merge by maximum."""
    import torch

    return torch.maximum(k_scale.float().reshape(1), v_scale.float().reshape(1))
