"""The stand-in `tensorrt_llm.layers.moe` pieces a Qwen3-MoE decoder layer builds: `MoeConfig`, `MOEWeightWrapper`
and `MixtureOfExperts` (= `MOE`), with the parameter names, shapes and routing of 1.2.x `layers/moe.py` [read, not
run], and the expert computation of its `MixtureOfExperts` plugin as that file feeds it.

Read in `layers/moe.py`: the router is `RowLinear(hidden, num_experts, bias=False, dtype="float32")` fed
`cast(hidden_states, float32)`; RENORMALIZE takes the top-k logits and softmaxes over them, NONE (`default_routing`)
keeps the top-k of the softmax over all experts. `fc` is `[experts, 2 * inter, hidden]` for a gated activation: per
`init_experts` (and `MoeOOTB.load_weights`, which hands rows `[:inter]` to the linear `gate` and `[inter:]` to the
activated `fc` of a GatedMLP) the first half is the linear branch and the second half the activated one; `proj` is
`[experts, hidden, inter]`. With FP8 (`quant_mode` given at construction; `quantize` does not swap MoE modules) the
plugin gets the input quantized with `fc.activation_scaling_factor`, dequantization by `fc.weights_scaling_factor[e]
* fc.activation_scaling_factor`, the intermediate quantized with `1 / proj.activation_scaling_factor` and dequantized
by `proj.weights_scaling_factor[e] * proj.activation_scaling_factor`; the output is the routing-weighted sum
(`token_final_scales`). The plugin kernels themselves (cutlass grouped GEMMs, their rounding) were never run.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dflash_trt.emulation.functional import EmulationError, Tensor, wrap_tensor
from dflash_trt.emulation.layers import RowLinear, fp8_round_trip
from dflash_trt.emulation.module import Module, Parameter
from dflash_trt.emulation.quantization import QuantMode
from dflash_trt.emulation.ranks import allreduce

# functional.py `is_gated_activation`: the activations whose fc holds both branches.
_GATED = {"swiglu": F.silu}


@dataclass
class MoeConfig:
    class ExpertScaleNormalizationMode(enum.IntEnum):
        NONE = 0
        RENORMALIZE = 1
        SPARSE_MIXER = 2
        DEVICE_LIMITED = 3
        DEVICE_LIMITED_RENORM = 4

    num_experts: int = 0
    shared_expert_intermediate_size: int = 0
    top_k: int = 0
    normalization_mode: int = ExpertScaleNormalizationMode.RENORMALIZE
    sparse_mixer_epsilon: float = 0.01
    tp_mode: int = 0
    device_limited_n_group: int = 0
    device_limited_topk_group: int = 0
    device_limited_routed_scaling_factor: float = 1.0

    def validate(self) -> MoeConfig:
        if (self.num_experts == 0) != (self.top_k == 0):
            raise ValueError("Both or neither MoeConfig's num_experts and top_k must be set to 0")
        return self

    def has_moe(self) -> bool:
        return self.num_experts > 1

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> MoeConfig:
        return cls(**config)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_Mode = MoeConfig.ExpertScaleNormalizationMode


class MOEWeightWrapper(Module):
    """One stacked expert weight (`mlp.fc` or `mlp.proj`) and, for FP8, its per-expert weight scales and one input
    scale for the stack."""

    def __init__(
        self, in_features: int, out_features: int, experts_per_node: int, quant_mode: QuantMode, dtype: Any, bias: bool
    ):
        super().__init__()
        if quant_mode.has_nvfp4():
            raise EmulationError("the emulation runs FP8 or unquantized experts (NVFP4 experts cannot be loaded)")
        fp8 = quant_mode.has_fp8_qdq()
        self.weight = Parameter(shape=(experts_per_node, out_features, in_features), dtype="fp8" if fp8 else dtype)
        if bias:
            self.bias = Parameter(shape=(experts_per_node, out_features), dtype=dtype)
        else:
            self.register_parameter("bias", None)
        if fp8:
            self.activation_scaling_factor = Parameter(shape=(1,), dtype="float32")
            self.weights_scaling_factor = Parameter(shape=(experts_per_node, 1), dtype="float32")
        else:
            self.register_parameter("activation_scaling_factor", None)
            self.register_parameter("weights_scaling_factor", None)

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert `e`'s GEMM on fp32 rows, with the FP8 plugin's input rounding and dequantization."""
        weight = self.weight.raw[e].float()
        if self.weights_scaling_factor is not None:
            x = fp8_round_trip(x, self.activation_scaling_factor.raw)
            weight = weight * self.weights_scaling_factor.raw[e].float()
        bias = None if self.bias is None else self.bias.raw[e].float()
        return F.linear(x, weight, bias)


class MixtureOfExperts(Module):
    def __init__(
        self,
        moe_config: MoeConfig,
        hidden_size: int,
        ffn_hidden_size: int,
        hidden_act: str,
        mapping: Any = None,
        bias: bool = True,
        dtype: Any = None,
        tp_group: Any = None,
        tp_size: int = 1,
        quant_mode: QuantMode | None = None,
        **unused: Any,
    ):
        super().__init__()
        if hidden_act not in _GATED:
            raise EmulationError(f"the emulation runs gated (swiglu) experts, got {hidden_act}")
        if moe_config.normalization_mode not in (_Mode.NONE, _Mode.RENORMALIZE):
            raise EmulationError("the emulation routes with normalization_mode NONE or RENORMALIZE")
        quant_mode = quant_mode or QuantMode()
        if quant_mode.has_fp8_qdq() and bias:
            raise ValueError("MixtureOfExperts - Bias is not supported with FP8")
        self.moe_config = moe_config
        self.num_experts, self.top_k = moe_config.num_experts, moe_config.top_k
        self.hidden_act = hidden_act
        # Rank r runs experts group `moe_ep_rank` (num_experts / moe_ep of them), each on its slice `moe_tp_rank` of
        # the intermediate features; the ranks' partial outputs are all-reduced over the tp group.
        moe_tp, moe_ep = (mapping.moe_tp_size, mapping.moe_ep_size) if mapping is not None else (1, 1)
        if self.num_experts % moe_ep or ffn_hidden_size % moe_tp:
            raise EmulationError(
                f"{self.num_experts} experts of {ffn_hidden_size} do not split over ep {moe_ep} x tp {moe_tp}"
            )
        self.experts_per_node = self.num_experts // moe_ep
        self.first_expert = (mapping.moe_ep_rank if mapping is not None else 0) * self.experts_per_node
        self.tp_group, self.tp_size = tp_group, tp_size
        self.expert_inter_size = ffn_hidden_size // moe_tp
        inter, experts = self.expert_inter_size, self.experts_per_node
        self.router = RowLinear(hidden_size, self.num_experts, bias=False, dtype="float32")
        self.fc = MOEWeightWrapper(hidden_size, 2 * inter, experts, quant_mode, dtype, bias)
        self.proj = MOEWeightWrapper(inter, hidden_size, experts, quant_mode, dtype, bias)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token_selected_experts, token_final_scales), each [tokens, top_k]."""
        if self.moe_config.normalization_mode == _Mode.RENORMALIZE:
            scores, chosen = torch.topk(logits, self.top_k, dim=-1)
            return chosen, torch.softmax(scores, dim=-1)
        scales, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return chosen, scales

    def forward(self, hidden_states: Tensor, lora_layer_params: Any = None, **unused: Any) -> Tensor:
        x = hidden_states.data
        logits = self.router(wrap_tensor(x.float())).data
        chosen, scales = self.route(logits)
        rows = x.float().reshape(-1, x.shape[-1])
        out = torch.zeros_like(rows)
        inter = self.expert_inter_size
        for e in chosen.unique().tolist():
            local = e - self.first_expert
            if not 0 <= local < self.experts_per_node:
                continue
            token, slot = (chosen.reshape(-1, self.top_k) == e).nonzero(as_tuple=True)
            # Each grouped GEMM's output and the activation are in the activations' dtype; the routing-weighted sum
            # accumulates in fp32 and is rounded once (the plugin's finalize step).
            fused = self.fc.expert(rows[token], local).to(x.dtype)
            hidden = (_GATED[self.hidden_act](fused[:, inter:]) * fused[:, :inter]).float()
            expert_out = self.proj.expert(hidden, local).to(x.dtype).float()
            out.index_add_(0, token, expert_out * scales.reshape(-1, self.top_k)[token, slot, None])
        result = wrap_tensor(out.reshape(x.shape).to(x.dtype))
        if self.tp_size > 1 and self.tp_group is not None:
            result = allreduce(result, self.tp_group)
        return result


MOE = MixtureOfExperts
