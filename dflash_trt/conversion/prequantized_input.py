"""A pre-quantized target (modelopt "unified HF" checkpoint) as converter input: its quantized linears are carried
over (fused, scales shared) instead of quantized again, and its activation / KV scales are kept as calibrated.

The drafter, usually released in bf16, is still quantized and calibrated by the converter, on the features the
carried-over target produces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_trt import tensor_names as names
from dflash_trt.checkpoint.hf_reader import HFCheckpointReader
from dflash_trt.checkpoint.layout import OutputTensor
from dflash_trt.checkpoint.sharding import Split
from dflash_trt.checkpoint.stored import QuantSettings
from dflash_trt.conversion.prequantized import (
    HF_INPUT_SCALE,
    HF_WEIGHT_SCALE,
    HF_WEIGHT_SCALE_2,
    PrequantizedFormat,
    hf_members,
    prequantized_module_tensors,
    share_prequantized,
)
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import NONE, NVFP4, quantized_linear
from dflash_trt.spec import TargetSpec, hf_expert

if TYPE_CHECKING:
    import torch

HF_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
HF_KV_SCALES = {"self_attn.k_proj": "k_scale", "self_attn.v_proj": "v_scale"}


def hf_linears(target: TargetSpec, layer: int) -> tuple[str, ...]:
    """The quantized HF linears of one target layer, relative to `model.layers.{layer}.`: a sparse layer's MLP is
    its experts' gate/up/down projections (the router stays unquantized)."""
    moe = target.moe
    if moe is None or not moe.is_sparse(layer):
        return HF_LINEARS
    experts = tuple(
        hf_expert("", e, leaf).removesuffix(".weight")
        for e in range(moe.num_experts)
        for leaf in ("gate_proj", "up_proj", "down_proj")
    )
    return (*HF_LINEARS[:4], *experts)


def carried_weights(target: TargetSpec) -> set[str]:
    """HF weights a pre-quantized target stores quantized (exempt from the float dtype check)."""
    return {f"model.layers.{i}.{m}.weight" for i in range(target.num_hidden_layers) for m in hf_linears(target, i)}


def quant_settings(
    fmt: PrequantizedFormat, qformat: str, dflash_qformat: str | None, kv_cache_dtype: str | None
) -> QuantSettings:
    """The target keeps the checkpoint's weight format (asking for another is an error, not a silent requantization);
    the KV cache follows the checkpoint unless `kv_cache_dtype` says otherwise."""
    if qformat not in (NONE, fmt.qformat):
        raise DFlashTrtError(
            f"the target is pre-quantized as {fmt.qformat}; --qformat must be {fmt.qformat} or omitted"
        )
    kv = fmt.kv_cache_dtype if kv_cache_dtype is None else kv_cache_dtype  # "none" drops the carried KV scales
    return QuantSettings(fmt.qformat, fmt.qformat if dflash_qformat is None else dflash_qformat, kv)


def source_expectations(
    target: TargetSpec, fmt: PrequantizedFormat, expected: dict[str, tuple[int, ...]]
) -> tuple[dict[str, tuple[int, ...]], tuple[str, ...]]:
    """Target tensor shapes of a pre-quantized checkpoint (NVFP4 weights pack two values a byte) and the scale
    tensors it may hold besides."""
    expected = dict(expected)
    extra = []
    for i in range(target.num_hidden_layers):
        for module in hf_linears(target, i):
            prefix = f"model.layers.{i}.{module}."
            if fmt.qformat == NVFP4:
                out_features, in_features = expected[prefix + "weight"]
                expected[prefix + "weight"] = (out_features, in_features // 2)
            extra += [prefix + leaf for leaf in (HF_WEIGHT_SCALE, HF_WEIGHT_SCALE_2, HF_INPUT_SCALE)]
            if module in HF_KV_SCALES:
                extra.append(prefix + HF_KV_SCALES[module])
    return expected, tuple(extra)


def carried_tensors(
    fmt: PrequantizedFormat | None, out: OutputTensor, reader: HFCheckpointReader
) -> dict[str, torch.Tensor] | None:
    """Full stored tensors of a target linear taken from the pre-quantized checkpoint; None for anything else."""
    if fmt is None or not out.name.startswith(names.TARGET_PREFIX + ".layers."):
        return None
    module = quantized_linear(out.name)
    if module is None:
        return None
    if out.split in (Split.EXPERT_FC, Split.EXPERT_PROJ):
        return _carried_experts(fmt, out, module, reader)
    index = int(out.name.split(".")[2])
    layer, hf_layer = names.target_layer(index), f"model.layers.{index}"
    relative = module[len(layer) + 1 :]
    wanted = tuple(f"{hf_layer}.{member}." for member in hf_members(relative))
    hf_tensors = {name: reader.get(name) for name in reader.names() if name.startswith(wanted)}
    return prequantized_module_tensors(hf_tensors, hf_layer, layer, relative, fmt)


def _carried_experts(
    fmt: PrequantizedFormat, out: OutputTensor, module: str, reader: HFCheckpointReader
) -> dict[str, torch.Tensor]:
    """Stacked experts from per-expert HF linears: each expert's gate and up share their larger scale (as for a
    dense gate/up pair), the per-expert scales stack to `[experts, 1]`, and the one input scale the MoE plugin takes
    is the largest of the experts' (as TensorRT-LLM's own MoE weight loader takes it)."""
    import torch

    def part(weight_name: str) -> dict[str, torch.Tensor]:
        prefix = weight_name.removesuffix("weight")
        return {name[len(prefix) :]: reader.get(name) for name in reader.names() if name.startswith(prefix)}

    num_experts = out.shape[0]
    per_expert = len(out.sources) // num_experts
    weights, scales, inputs = [], [], []
    for expert in range(num_experts):
        sources = [name for _, name in out.sources[expert * per_expert : (expert + 1) * per_expert]]
        if out.split is Split.EXPERT_FC:  # sources are (up, gate); the shared scale is the pair's
            gate, up = share_prequantized([part(sources[1]), part(sources[0])], fmt.qformat)
            members = [up, gate]
        else:
            members = share_prequantized([part(sources[0])], fmt.qformat)
        weights.append(torch.cat([m[names.WEIGHT] for m in members]))
        scales.append(members[0][names.WEIGHTS_SCALING_FACTOR].reshape(1))
        inputs.append(members[0][names.ACTIVATION_SCALING_FACTOR].reshape(1))
    return {
        f"{module}.{names.WEIGHT}": torch.stack(weights),
        f"{module}.{names.WEIGHTS_SCALING_FACTOR}": torch.stack(scales),
        f"{module}.{names.ACTIVATION_SCALING_FACTOR}": torch.stack(inputs).max(dim=0).values,
    }


def carried_scales(
    fmt: PrequantizedFormat, layout: list[OutputTensor], reader: HFCheckpointReader
) -> dict[str, torch.Tensor]:
    """The checkpoint's own activation and KV-cache scales, under our names (they replace calibrated ones)."""
    scales = {}
    for out in layout:
        for name, tensor in (carried_tensors(fmt, out, reader) or {}).items():
            if name.endswith((names.ACTIVATION_SCALING_FACTOR, names.KV_CACHE_SCALING_FACTOR)):
                scales[name] = tensor
    return scales
