"""The stand-in `tensorrt_llm.layers`: Embedding, Column/RowLinear (plain, FP8, NVFP4), RmsNorm, GatedMLP and the
GPT attention plugin's paged-KV attention, with the parameter names and constructor arguments of 1.2.x
(layers/{embedding,linear,normalization,mlp,attention}.py, quantization/layers.py).

`Attention.forward` projects qkv, applies the q/k norms, calls this module's `gpt_attention(**kwargs)` with
functional.gpt_attention's keyword arguments and applies the dense projection, as 1.2.x's does; so the engine can
route one layer's call elsewhere (trtllm/generation_attention.py) exactly as it does on a GPU.

`gpt_attention` executes what the stock plugin does for one layer [read in gptAttentionPlugin.cpp / attentionOp,
not run]: the requests are `context_lengths`' rows, context requests first (`host_request_types`); a context
request's `host_context_lengths[b]` rows sit at cache positions `sequence_length[b] - context_lengths[b] + i` and
attend causally; a generation request's rows (`spec_decoding_generation_lengths[g]` with variable-length spec
decoding) sit at `sequence_length[b] - n + j`, take RoPE at `past + spec_decoding_position_offsets[g, j]`, see
every past key and the in-block keys whose bit is set in `spec_decoding_packed_mask` (row = the request's first
mask row + j, bit j' of word j' // 32). XQA's packed-mask handling was only read, never run. K/V are written to the
paged pool (after RoPE and k_norm, FP8-rounded with `kv_orig_quant_scale` when the cache is FP8) and read back
from it, so the current tokens see the stored values. Device past lengths above the host bound
`host_past_key_value_lengths` (what the kernels size their work by) are refused, and so is a position past the RoPE
table's rows (the kernel would read other memory), and what 1.2.x's dispatch cannot run on the emulated GPU
(`Network.device_sm`): multi-token generation on SM100 / SM103, whose XQA dispatcher has no speculative-decoding
kernel (attentionOp.cpp asserts "No available XQA kernels are found for speculative decoding mode"). With q/k norms
the fused qkv rows are split as 1.2.x's `Attention.forward` splits them: [Q | K | V] when a rank holds more query
than KV heads, interleaved per head when the counts are equal. Context requests of a network whose builder turns FP8
context FMHA on (FP8 / NVFP4 weights, FP8 cache) attend as `reference.quantized.fp8_context_attention` defines it,
and the plugin's whole output is then e4m3 at the `attention_output_orig_quant_scale` `Attention.forward` passes
(`reference.quantized.fp8_attention_output`), which the FP8 / FP4 dense layers take as 1.2.x's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dflash_trt.emulation import trt
from dflash_trt.emulation.functional import (
    AttentionMaskType,
    EmulationError,
    LayerNormType,
    PositionEmbeddingType,
    Tensor,
    default_net,
    rms_norm,
    trt_dtype,
    wrap_tensor,
)
from dflash_trt.emulation.kv_pool import resolve_pool
from dflash_trt.emulation.module import Module, Parameter
from dflash_trt.emulation.quantization import FP8, NVFP4, QuantMode
from dflash_trt.emulation.ranks import allgather, allreduce
from dflash_trt.emulation.rope import cos_sin_table
from dflash_trt.quant.nvfp4 import NVFP4_BLOCK_SIZE, dequantize_nvfp4, quantize_nvfp4
from dflash_trt.reference.quantized import fp8_attention_output, fp8_context_attention
from dflash_trt.trtllm.attention_route import BLACKWELL_SMS

FP8_MAX = 448.0


def _dtype(dtype: Any) -> Any:
    return dtype if dtype is not None else "float32"


def _torch_dtype(dtype: Any) -> torch.dtype:
    return trt.TORCH_DTYPES[trt_dtype(_dtype(dtype))]


def _typed(x: Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """The strongly-typed network's rule: a layer built for `dtype` takes exactly that (no implicit cast)."""
    if x.data.dtype != dtype:
        raise EmulationError(f"{what} built for {dtype} fed a {x.data.dtype} tensor (the network is strongly typed)")
    return x.data


def _pad_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def fp8_round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize with a per-tensor scale (x / scale, saturated) to E4M3 and back, in fp32."""
    scale = scale.float().reshape(())
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


class Linear(Module):
    """The GEMM of ColumnLinear / RowLinear on one rank; `quantize_as` turns it into FP8Linear / FP4Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: Any):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.dtype = _dtype(dtype)
        self.quant_algo: str | None = None
        self.weight = Parameter(shape=(out_features, in_features), dtype=self.dtype)
        if bias:
            self.bias = Parameter(shape=(out_features,), dtype=self.dtype)
        else:
            self.register_parameter("bias", None)

    def quantize_as(self, algo: str) -> None:
        out, inp = self.out_features, self.in_features
        self.quant_algo = algo
        if algo == FP8:
            self.weight = Parameter(shape=(out, inp), dtype="fp8")
            self.weights_scaling_factor = Parameter(shape=(1,), dtype="float32")
            self.activation_scaling_factor = Parameter(shape=(1,), dtype="float32")
        elif algo == NVFP4:
            if inp % NVFP4_BLOCK_SIZE:
                raise EmulationError("Input features must be a multiple of 16 for FP4 GEMM")
            self.weight = Parameter(shape=(out, inp), dtype=trt.fp4)
            self.weights_block_scaling_factor = Parameter(shape=(out, inp // NVFP4_BLOCK_SIZE), dtype="fp8")
            self.weights_block_scaling_factor_interleaved = Parameter(
                shape=(_pad_up(out, 128), _pad_up(inp // NVFP4_BLOCK_SIZE, 4)), dtype="fp8"
            )
            self.weights_global_scaling_factor = Parameter(shape=(1,), dtype="float32")
            self.activation_global_scaling_factor = Parameter(shape=(1,), dtype="float32")
            self.alpha = Parameter(shape=(1,), dtype="float32")
        else:
            raise EmulationError(f"unsupported quantization {algo}")

    def _dequantized_weight(self) -> torch.Tensor:
        w = self.weight.raw
        if self.quant_algo == FP8:
            return w.float() * self.weights_scaling_factor.raw.float()
        if self.quant_algo == NVFP4:
            return dequantize_nvfp4(
                w, self.weights_block_scaling_factor.raw, self.weights_global_scaling_factor.raw.reshape(())
            )
        return w.float()

    def _rounded_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_algo == FP8:
            return fp8_round_trip(x, self.activation_scaling_factor.raw)
        if self.quant_algo == NVFP4:  # dynamic per-16 block scales under the static global scale
            flat = x.reshape(-1, x.shape[-1]).float()
            q = quantize_nvfp4(flat, self.activation_global_scaling_factor.raw.float().reshape(()))
            values = dequantize_nvfp4(q.weight, q.weights_scaling_factor, q.weights_scaling_factor_2)
            return values.reshape(x.shape)
        return x

    def _gemm(self, x: Tensor, with_bias: bool) -> torch.Tensor:
        """The GEMM with fp32 accumulation, its output rounded once to the layer's dtype (a cuBLAS / plugin GEMM);
        `with_bias` adds the bias in the same fp32 epilogue."""
        dtype = _torch_dtype(self.dtype)
        bias = self.bias.raw.float() if with_bias and self.bias is not None else None
        if x.data.dtype == torch.float8_e4m3fn:
            return F.linear(self._fp8_input(x.data), self._dequantized_weight(), bias).to(dtype)
        data = _typed(x, dtype, "a linear layer")
        return F.linear(self._rounded_input(data.float()), self._dequantized_weight(), bias).to(dtype)

    def _fp8_input(self, x: torch.Tensor) -> torch.Tensor:
        """An FP8 input (the attention plugin's output with FP8 context FMHA) as the quantized linears take it
        [read: quantization/layers.py]: `FP8RowLinear` uses it as its quantized input (scale: its activation scale);
        `FP4RowLinear` dequantizes it with its FP4 input scale times 6 and quantizes that to FP4 (the WAR for FP8
        output attention; the FP4 quantize plugin takes FP8 input too)."""
        if self.quant_algo == FP8:
            return x.float() * self.activation_scaling_factor.raw.float().reshape(())
        if self.quant_algo == NVFP4:
            return self._rounded_input(x.float() * (self.activation_global_scaling_factor.raw.float().reshape(()) * 6))
        raise EmulationError("an FP8 tensor fed to an unquantized linear layer (the network is strongly typed)")

    def _bias(self, y: torch.Tensor) -> torch.Tensor:
        """The bias as a separate elementwise add in the activations' dtype."""
        return y if self.bias is None else y + self.bias.raw.to(y.dtype)


class ColumnLinear(Linear):
    """Output features split over the tp ranks (weight `[out / tp, in]`); `gather_output` all-gathers them back
    (layers/linear.py `ColumnLinear`: bias on the local slice, then `allgather(x, tp_group, gather_dim=-1)`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: Any = None,
        tp_group: Any = None,
        tp_size: int = 1,
        gather_output: bool = True,
        is_qkv: bool = False,
        **unused: Any,
    ):
        if out_features % tp_size:
            raise EmulationError(f"ColumnLinear: {out_features} output features do not split over tp {tp_size}")
        super().__init__(in_features, out_features // tp_size, bias, dtype)
        self.tp_group, self.tp_size, self.gather_output = tp_group, tp_size, gather_output

    def forward(self, x: Tensor, lora_runtime_params: Any = None, **unused: Any) -> Tensor:
        out = wrap_tensor(self._gemm(x, with_bias=True))
        if self.gather_output and self.tp_size > 1 and self.tp_group is not None:
            out = allgather(out, self.tp_group, gather_dim=-1)
        return out


class RowLinear(Linear):
    """Input features split over the tp ranks (weight `[out, in / tp]`); the partial products are all-reduced
    before the bias is added (layers/linear.py `RowLinear`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: Any = None,
        tp_group: Any = None,
        tp_size: int = 1,
        **unused: Any,
    ):
        if in_features % tp_size:
            raise EmulationError(f"RowLinear: {in_features} input features do not split over tp {tp_size}")
        super().__init__(in_features // tp_size, out_features, bias, dtype)
        self.tp_group, self.tp_size = tp_group, tp_size

    def forward(self, x: Tensor, lora_runtime_params: Any = None, **unused: Any) -> Tensor:
        if self.tp_size == 1 or self.tp_group is None:
            return wrap_tensor(self._gemm(x, with_bias=True))
        return wrap_tensor(self._bias(allreduce(wrap_tensor(self._gemm(x, with_bias=False)), self.tp_group).data))


class Embedding(Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: Any = None,
        tp_size: int = 1,
        tp_group: Any = None,
        **unused: Any,
    ):
        super().__init__()
        self.weight = Parameter(shape=(num_embeddings, embedding_dim), dtype=_dtype(dtype))

    def forward(self, x: Tensor, *unused: Any) -> Tensor:
        if x.dtype != trt.int32:
            raise EmulationError(f"embedding lookup of {x.dtype.name} ids (the engine's input_ids are int32)")
        table = self.weight.raw
        if x.data.numel() and (int(x.data.min()) < 0 or int(x.data.max()) >= table.shape[0]):
            raise EmulationError("embedding index out of range")
        return wrap_tensor(table[x.data.long()])


class RmsNorm(Module):
    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-06,
        elementwise_affine: bool = True,
        dtype: Any = None,
        **unused: Any,
    ):
        super().__init__()
        self.normalized_shape = normalized_shape
        self.eps = eps
        self.weight = Parameter(shape=(normalized_shape,), dtype=_dtype(dtype))

    def forward(self, x: Tensor, normalized_shape: Any = None) -> Tensor:
        if x.shape[-1] != self.normalized_shape:
            raise EmulationError(f"RmsNorm over {x.shape[-1]} features, built for {self.normalized_shape}")
        weight = self.weight.raw
        return wrap_tensor(rms_norm(_typed(x, weight.dtype, "an RmsNorm"), weight, self.eps))


_ACTIVATIONS: dict[str, Any] = {"silu": F.silu, "swiglu": F.silu, "gelu": F.gelu, "relu": F.relu}


class GatedMLP(Module):
    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        hidden_act: str,
        bias: bool = True,
        dtype: Any = None,
        tp_group: Any = None,
        tp_size: int = 1,
        quant_mode: Any = None,
        **unused: Any,
    ):
        super().__init__()
        if hidden_act not in _ACTIVATIONS:
            raise EmulationError(f"unsupported activation function: {hidden_act}")
        self.hidden_act = hidden_act
        split = {"dtype": dtype, "tp_group": tp_group, "tp_size": tp_size}
        self.fc = ColumnLinear(hidden_size, ffn_hidden_size, bias=bias, gather_output=False, **split)
        self.gate = ColumnLinear(hidden_size, ffn_hidden_size, bias=bias, gather_output=False, **split)
        self.proj = RowLinear(ffn_hidden_size, hidden_size, bias=bias, **split)

    def forward(self, hidden_states: Tensor, lora_layer_params: Any = None, **unused: Any) -> Tensor:
        inter = _ACTIVATIONS[self.hidden_act](self.fc(hidden_states).data)
        return self.proj(wrap_tensor(inter * self.gate(hidden_states).data))


# --------------------------------------------------------------------------------------------------------- attention


@dataclass
class KeyValueCacheParams:
    past_key_value: Any = None
    host_past_key_value_lengths: Any = None
    host_max_attention_window_sizes: Any = None
    host_sink_token_length: Any = None
    kv_cache_block_offsets: Any = None
    host_kv_cache_block_offsets: Any = None
    host_kv_cache_pool_pointers: Any = None
    host_kv_cache_pool_mapping: Any = None
    cache_indirection: Any = None
    past_key_value_length: Any = None
    cross_kv_cache_block_offsets: Any = None
    host_cross_kv_cache_block_offsets: Any = None
    host_cross_kv_cache_pool_pointers: Any = None
    host_cross_kv_cache_pool_mapping: Any = None


@dataclass
class SpecDecodingParams:
    spec_decoding_is_generation_length_variable: bool = False
    spec_decoding_max_generation_length: int = 1
    spec_decoding_generation_lengths: Any = None
    spec_decoding_position_offsets: Any = None
    spec_decoding_packed_mask: Any = None
    spec_decoding_use: Any = None


@dataclass
class AttentionParams:
    sequence_length: Any = None
    context_lengths: Any = None
    host_context_lengths: Any = None
    max_context_length: int | None = None
    host_request_types: Any = None
    encoder_input_lengths: Any = None
    encoder_max_input_length: Any = None
    host_runtime_perf_knobs: Any = None
    host_context_progress: Any = None
    embed_positions: Any = None
    rotary_inv_freq: Any = None
    embed_positions_for_gpt_attention: Any = None


def _host(t: Tensor | None, what: str) -> np.ndarray:
    """A host input of the plugin: computed (device) tensors cannot be bound there."""
    if t is None:
        raise EmulationError(f"attention input {what} missing")
    if not t.host:
        raise EmulationError(f"attention input {what} must be a host tensor (a network input), got a device tensor")
    return t.data.cpu().numpy()


class Attention(Module):
    attention_output_orig_quant_scale: Parameter | None

    def __init__(
        self,
        *,
        local_layer_idx: int,
        hidden_size: int,
        num_attention_heads: int,
        num_kv_heads: int | None = None,
        max_position_embeddings: int = 1024,
        attention_head_size: int | None = None,
        qk_layernorm: bool = False,
        layernorm_type: LayerNormType = LayerNormType.LayerNorm,
        eps: float = 1e-05,
        attention_mask_type: AttentionMaskType = AttentionMaskType.padding,
        bias: bool = True,
        dtype: Any = None,
        position_embedding_type: Any = PositionEmbeddingType.learned_absolute,
        rotary_embedding_base: float = 10000.0,
        rotary_embedding_scaling: Any = None,
        tp_group: Any = None,
        tp_size: int = 1,
        tp_rank: int = 0,
        quant_mode: QuantMode | None = None,
        q_scaling: float = 1.0,
        dense_bias: bool | None = None,
        **unused: Any,
    ):
        super().__init__()
        self.local_layer_idx = local_layer_idx
        if num_attention_heads % tp_size:
            raise EmulationError(f"{num_attention_heads} attention heads do not split over tp {tp_size}")
        self.num_attention_heads = num_attention_heads // tp_size
        # KV heads are replicated when there are fewer than ranks (attention.py: ceil division).
        self.num_attention_kv_heads = (
            (num_kv_heads + tp_size - 1) // tp_size if num_kv_heads is not None else self.num_attention_heads
        )
        self.attention_head_size = attention_head_size or hidden_size // num_attention_heads
        self.attention_mask_type = attention_mask_type
        self.position_embedding_type = position_embedding_type
        self.max_position_embeddings = max_position_embeddings
        self.q_scaling = q_scaling
        self.quant_mode = quant_mode or QuantMode()
        d = self.attention_head_size
        self.qkv = ColumnLinear(
            hidden_size,
            tp_size * (self.num_attention_heads + 2 * self.num_attention_kv_heads) * d,
            bias=bias,
            dtype=dtype,
            tp_group=tp_group,
            tp_size=tp_size,
            gather_output=False,
            is_qkv=True,
        )
        self.dense = RowLinear(
            tp_size * self.num_attention_heads * d,
            hidden_size,
            bias=bias if dense_bias is None else dense_bias,
            dtype=dtype,
            tp_group=tp_group,
            tp_size=tp_size,
        )
        self.qk_layernorm = qk_layernorm
        if qk_layernorm:
            if layernorm_type != LayerNormType.RmsNorm:
                raise EmulationError("the emulation implements RmsNorm q/k norms")
            self.q_layernorm = RmsNorm(d, eps=eps, dtype=dtype)
            self.k_layernorm = RmsNorm(d, eps=eps, dtype=dtype)
        # Set by `models.set_fp8_context_fhma` when the builder turns FP8 context FMHA on.
        self.register_parameter("attention_output_orig_quant_scale", None)
        if self.quant_mode.has_kv_cache_quant():
            self.kv_cache_scaling_factor = Parameter(shape=(1,), dtype="float32")
            self.kv_cache_rcp_scaling_factor = Parameter(shape=(1,), dtype="float32")
        else:
            self.register_parameter("kv_cache_scaling_factor", None)
            self.register_parameter("kv_cache_rcp_scaling_factor", None)

    @staticmethod
    def create_attention_const_params(model_cls: Module, config: Any) -> None:
        """The model-wide RoPE table every attention layer's plugin call receives (from the model config)."""
        if PositionEmbeddingType.from_string(config.position_embedding_type) != PositionEmbeddingType.rope_gpt_neox:
            raise EmulationError("the emulation implements rope_gpt_neox position embeddings")
        dim = config.rotary_embedding_dim or config.head_size
        table = cos_sin_table(config.max_position_embeddings, dim, config.rotary_base, config.rotary_scaling)
        model_cls.embed_positions_for_gpt_attention = Parameter(
            torch.from_numpy(table), dtype="float32", is_buffer=True
        )

    @staticmethod
    def fill_attention_params(model_cls: Module, attention_params: AttentionParams) -> AttentionParams:
        table: Parameter = getattr(model_cls, "embed_positions_for_gpt_attention")  # noqa: B009 (set on the model)
        attention_params.embed_positions_for_gpt_attention = table.value
        return attention_params

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Any = None,
        use_cache: bool = False,
        spec_decoding_params: SpecDecodingParams | None = None,
        kv_cache_params: KeyValueCacheParams | None = None,
        attention_params: AttentionParams | None = None,
        lora_layer_params: Any = None,
        **unused: Any,
    ) -> Any:
        if not use_cache or kv_cache_params is None or attention_params is None:
            raise EmulationError("the emulation runs the paged-KV attention plugin path only")
        if self.attention_mask_type != AttentionMaskType.causal:
            raise EmulationError("spec-decoding generation needs a causal mask type (XQA)")
        h, kvh, d = self.num_attention_heads, self.num_attention_kv_heads, self.attention_head_size
        q, k, v = self._split_qkv(self.qkv(hidden_states).data)
        tokens = q.shape[0]
        spec = spec_decoding_params or SpecDecodingParams()
        kv, params = kv_cache_params, attention_params
        scaled = self.kv_cache_scaling_factor is not None
        context, _ = gpt_attention(
            qkv=wrap_tensor(
                torch.cat([q.reshape(tokens, h * d), k.reshape(tokens, kvh * d), v.reshape(tokens, kvh * d)], dim=-1)
            ),
            past_key_value=None,
            sequence_length=params.sequence_length,
            host_past_key_value_lengths=kv.host_past_key_value_lengths,
            host_max_attention_window_sizes=kv.host_max_attention_window_sizes,
            host_sink_token_length=kv.host_sink_token_length,
            context_lengths=params.context_lengths,
            cache_indirection=kv.cache_indirection,
            host_request_types=params.host_request_types,
            layer_idx=self.local_layer_idx,
            num_heads=h,
            num_kv_heads=kvh,
            hidden_size_per_head=d,
            q_scaling=self.q_scaling,
            rotary_embedding_dim=d,
            rotary_embedding_max_positions=self.max_position_embeddings,
            position_embedding_type=self.position_embedding_type,
            rotary_cos_sin=params.embed_positions_for_gpt_attention,
            kv_orig_quant_scale=self.kv_cache_rcp_scaling_factor.value if scaled else None,
            kv_quant_orig_scale=self.kv_cache_scaling_factor.value if scaled else None,
            attention_output_orig_quant_scale=self._get_output_orig_quant_scale(),
            max_context_length=params.max_context_length,
            mask_type=self.attention_mask_type,
            kv_cache_block_offsets=kv.kv_cache_block_offsets,
            host_kv_cache_block_offsets=kv.host_kv_cache_block_offsets,
            host_kv_cache_pool_pointers=kv.host_kv_cache_pool_pointers,
            host_kv_cache_pool_mapping=kv.host_kv_cache_pool_mapping,
            host_context_lengths=params.host_context_lengths,
            use_cache=True,
            spec_decoding_is_generation_length_variable=spec.spec_decoding_is_generation_length_variable,
            spec_decoding_max_generation_length=spec.spec_decoding_max_generation_length,
            spec_decoding_generation_lengths=spec.spec_decoding_generation_lengths,
            spec_decoding_position_offsets=spec.spec_decoding_position_offsets,
            spec_decoding_packed_mask=spec.spec_decoding_packed_mask,
            spec_decoding_use=spec.spec_decoding_use,
        )
        return self.dense(context), None

    def _get_output_orig_quant_scale(self) -> Tensor | None:
        """As 1.2.x's: the scale the FP8 attention output is quantized with; for NVFP4 the FP4 dense layer's (an
        FP4 x FP8 scale) divided by 6, FP4's largest value, so that it quantizes to FP8 [read: layers/attention.py]."""
        if self.attention_output_orig_quant_scale is None:
            return None
        scale = self.attention_output_orig_quant_scale.value
        if default_net().plugin_config.gemm_plugin == "nvfp4" or self.quant_mode.has_nvfp4():
            return wrap_tensor(scale.data / 6.0)
        return scale

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[tokens, heads, d]`, k and v `[tokens, kv_heads, d]`, q/k-normed, read from the fused rows as 1.2.x's
        `Attention.forward` reads them: with q/k norms and as many KV heads as query heads on the rank it views
        the rows interleaved per head (`[tokens, heads, 3, d]`), otherwise as [Q | K | V]."""
        h, kvh, d = self.num_attention_heads, self.num_attention_kv_heads, self.attention_head_size
        tokens = qkv.shape[0]
        if self.qk_layernorm and h == kvh:
            q, k, v = qkv.reshape(tokens, h, 3, d).unbind(2)
        else:
            q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
            q, k, v = q.reshape(tokens, h, d), k.reshape(tokens, kvh, d), v.reshape(tokens, kvh, d)
        if self.qk_layernorm:
            q = self.q_layernorm(wrap_tensor(q.contiguous())).data
            k = self.k_layernorm(wrap_tensor(k.contiguous())).data
        return q, k, v


def gpt_attention(**kwargs: Any) -> tuple[Tensor, None]:
    """The stock GPT attention plugin over one layer's packed rows (see the module docstring)."""
    call = _StockCall(kwargs)
    qkv = kwargs["qkv"].data
    h, kvh, d = call.heads, call.kv_heads, call.head_dim
    tokens, dtype = qkv.shape[0], qkv.dtype
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.reshape(tokens, h, d), k.reshape(tokens, kvh, d), v.reshape(tokens, kvh, d)
    # The kernels rotate in fp32 and keep q and the cached k in the activations' dtype; softmax(QK^T)V
    # accumulates in fp32 and its output is rounded once (to e4m3 when the output is FP8).
    out = torch.zeros(tokens, h, d, dtype=torch.float32)
    for rows, positions, rope_positions, visible in call.requests(tokens):
        sl = rows.slice
        cos, sin = call.rope(rope_positions)
        qr = _rotate(q[sl].float(), cos, sin).to(dtype)
        kr = _rotate(k[sl].float(), cos, sin).to(dtype)
        keys, values = call.cache_write_read(rows.batch, positions, kr, v[sl], visible.shape[1])
        scale = 1.0 / (call.q_scaling * d**0.5)
        if rows.context and call.fp8_context_fmha:
            out[sl] = _attend_fp8(qr, keys, values, visible, scale, kwargs["kv_quant_orig_scale"].data)
        else:
            out[sl] = _attend(qr.float(), keys, values, visible, scale)
    out = out.reshape(tokens, h * d)
    if call.output_orig_quant is None:
        return wrap_tensor(out.to(dtype)), None
    return wrap_tensor(fp8_attention_output(out, call.output_orig_quant.data)), None


class _StockCall:
    """One call of the stock plugin: its arguments, and the requests, RoPE and cache access they describe."""

    def __init__(self, kwargs: dict[str, Any]):
        self.kw = kwargs
        self.heads, self.kv_heads = kwargs["num_heads"], kwargs["num_kv_heads"]
        self.head_dim, self.q_scaling = kwargs["hidden_size_per_head"], kwargs["q_scaling"]
        if kwargs["rotary_embedding_dim"] != self.head_dim or kwargs["rotary_cos_sin"] is None:
            raise EmulationError("the emulation implements full-head rope_gpt_neox through the cos/sin table")
        packed = kwargs.get("spec_decoding_packed_mask")
        self.spec = packed is not None
        if self.spec and any(kwargs.get(n) is None for n in ("spec_decoding_generation_lengths", "spec_decoding_use")):
            raise EmulationError("spec decoding needs its generation lengths, position offsets, mask and use flag")
        # FP8 context FMHA, as the builder turns it on (FP8 / NVFP4 weights and an FP8 cache:
        # `formats.fp8_context_fmha`).
        self.fp8_context_fmha = (
            default_net().plugin_config.use_fp8_context_fmha and kwargs.get("kv_quant_orig_scale") is not None
        )
        # With FP8 context FMHA the plugin's whole output is FP8, quantized with the scale it then takes as an input
        # (gptAttentionPlugin.cpp `getOutputDataType`, `isEntryUsed`); functional.gpt_attention refuses the scale
        # without FP8 context FMHA.
        self.output_orig_quant = kwargs.get("attention_output_orig_quant_scale")
        if (self.output_orig_quant is not None) != default_net().plugin_config.use_fp8_context_fmha:
            raise EmulationError(
                "FP8 Context FMHA needs to be enabled"
                if self.output_orig_quant is not None
                else "FP8 context FMHA without attention_output_orig_quant_scale (the plugin's FP8 output needs it)"
            )

    def requests(self, tokens: int) -> Any:
        """Per request: its rows, cache positions, RoPE positions and the [rows, keys] visibility."""
        kw = self.kw
        types = _host(kw["host_request_types"], "host_request_types")
        host_ctx = _host(kw["host_context_lengths"], "host_context_lengths")
        host_past = _host(kw["host_past_key_value_lengths"], "host_past_key_value_lengths")
        seq_len = kw["sequence_length"].data.long()
        ctx_len = kw["context_lengths"].data.long()
        batch = ctx_len.shape[0]  # the plugin counts requests by context_lengths' rows
        num_ctx = int((types[:batch] == 0).sum())
        if (types[:num_ctx] != 0).any() or (types[num_ctx:batch] != 1).any():
            raise EmulationError("context requests must precede generation requests in the batch")
        row = mask_row = 0
        for b in range(batch):
            if types[b] == 0:
                n = int(host_ctx[b])
                if n != int(ctx_len[b]):
                    raise EmulationError(f"request {b}: host and device context lengths differ")
                past = int(seq_len[b]) - n
                positions = torch.arange(past, past + n)
                rope = positions
                visible = torch.arange(past + n)[None, :] <= positions[:, None]
            else:
                n, offsets, mask = self._generation_rows(b - num_ctx, mask_row)
                mask_row += n
                past = int(seq_len[b]) - n
                if past > int(host_past[b]):
                    raise EmulationError(f"request {b}: past length {past} above its host bound {int(host_past[b])}")
                positions = torch.arange(past, past + n)
                rope = past + offsets
                visible = torch.cat([torch.ones(n, past, dtype=torch.bool), mask], dim=1)
            if past < 0:
                raise EmulationError(f"request {b}: sequence_length below its input length")
            if row + n > tokens:
                raise EmulationError(f"request {b}'s rows end at {row + n}, the input has {tokens}")
            yield _Rows(b, row, row + n, bool(types[b] == 0)), positions, rope, visible
            row += n
        if row != tokens:
            raise EmulationError(f"the requests cover {row} rows, the input has {tokens}")

    def _generation_rows(self, g: int, mask_row: int) -> Any:
        kw = self.kw
        if not self.spec or int(kw["spec_decoding_use"].data[0]) == 0:
            return 1, torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool)
        if default_net().device_sm in BLACKWELL_SMS:
            raise EmulationError(
                f"No available XQA kernels are found for speculative decoding mode (SM{default_net().device_sm}: "
                "1.2.x's XQA dispatcher routes SM100-family GPUs to TRTLLM-GEN kernels, which refuse it)"
            )
        if not kw["spec_decoding_is_generation_length_variable"]:
            raise EmulationError("the runtime's EAGLE inputs use variable generation lengths")
        lengths = kw["spec_decoding_generation_lengths"].data
        offsets = kw["spec_decoding_position_offsets"].data
        packed = kw["spec_decoding_packed_mask"].data
        for t, name in ((lengths, "generation_lengths"), (offsets, "position_offsets"), (packed, "packed_mask")):
            if t.dtype != torch.int32:
                raise EmulationError(f"spec_decoding_{name} must be int32")
        n = int(lengths[g])
        if n > kw["spec_decoding_max_generation_length"]:
            raise EmulationError(f"generation length {n} above spec_decoding_max_generation_length")
        words = packed[mask_row : mask_row + n].long() & 0xFFFFFFFF
        bits = torch.arange(n)
        mask = ((words[:, bits // 32] >> (bits % 32)) & 1).bool()
        return n, offsets[g, :n].long(), mask

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.kw["rotary_cos_sin"].data
        largest = int(positions.max())
        if largest >= table.shape[0]:
            raise EmulationError("a position beyond max_position_embeddings")
        network = default_net()
        network.largest_position = max(network.largest_position, largest)
        return table[positions, :, 0], table[positions, :, 1]

    def cache_write_read(
        self, batch_index: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_count: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kw = self.kw
        pages = resolve_pool(
            kw["host_kv_cache_pool_mapping"],
            kw["host_kv_cache_pool_pointers"],
            kw["kv_cache_block_offsets"],
            kw["layer_idx"],
            batch_index,
        )
        rcp, scale = kw.get("kv_orig_quant_scale"), kw.get("kv_quant_orig_scale")
        if pages.dtype == torch.float8_e4m3fn and (rcp is None or scale is None):
            raise EmulationError("an FP8 KV pool needs the layer's KV cache scales")
        if rcp is None and pages.dtype != k.dtype:
            raise EmulationError(f"a {pages.dtype} KV pool for {k.dtype} attention (the cache holds the activations)")
        for kind, values in ((0, k), (1, v)):
            stored = values if rcp is None else (values.float() * rcp.data.float()).clamp(-FP8_MAX, FP8_MAX)
            pages.write(kind, positions, stored.to(pages.dtype))
        read = []
        for kind in (0, 1):
            values = pages.read(kind, torch.arange(key_count)).float()
            read.append(values if scale is None else values * scale.data.float())
        return read[0], read[1]


@dataclass
class _Rows:
    batch: int
    start: int
    end: int
    context: bool  # a context request (prompt chunk) rather than a generation step

    @property
    def slice(self) -> slice:
        return slice(self.start, self.end)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX RoPE on [n, heads, d] with cos/sin [n, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _attend_fp8(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, kv_scale: torch.Tensor
) -> torch.Tensor:
    """`_attend` as FP8 context FMHA computes it (`reference.quantized.fp8_context_attention`), same shapes."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).transpose(0, 1)
    v = v.repeat_interleave(groups, dim=1).transpose(0, 1)
    return fp8_context_attention(q.transpose(0, 1), k, v, visible[None], scale, kv_scale).transpose(0, 1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, h, d], k/v [keys, kv_heads, d], visible [n, keys] -> [n, h, d] (GQA by head groups)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).transpose(0, 1)
    v = v.repeat_interleave(groups, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=visible[None], scale=scale)
    return out.transpose(0, 1)
