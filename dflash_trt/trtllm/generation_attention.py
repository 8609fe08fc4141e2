"""Generation requests of an attention layer on our DFlashAttention plugin, context requests on the stock one.

The stock `Attention.forward` (TensorRT-LLM 1.2.x layers/attention.py) projects qkv, applies the q/k norms, calls
its module's `gpt_attention(**kwargs)` and applies the dense projection. `dflash_attention(attention, block)`
replaces that one call while the layer adds itself to the network, so projection, norms, quantization and TP stay
the stock layer's; the replacement receives the very inputs the stock plugin would.

A step's packed batch holds its context requests first, then its generation requests; the stock plugin counts the
requests from `context_lengths`' shape and the context tokens from `host_context_lengths` [read:
GPTAttentionPlugin::enqueueImpl]. The runtime shapes `spec_decoding_generation_lengths` to the step's generation
requests and the host input `input_gen_tokens` to its generation tokens [read: EagleBuffers::reshape /
setFromInputs]. So the split is shape arithmetic, no data-dependent shapes: the first rows and requests go to the
stock plugin (spec decoding off: it never sees a generation request), the rest to DFlashAttention; the outputs are
concatenated in the same order. For the drafter's block every request is a generation request and nothing is split.

With FP8 context FMHA (`use_fp8_context_fmha`, which 1.2.x's builder turns on for FP8 / NVFP4 weights with an FP8 KV
cache) the stock plugin's output is FP8 e4m3, quantized with the `attention_output_orig_quant_scale` that
`Attention.forward` passes [read: gptAttentionPlugin.cpp `getOutputDataType`, layers/attention.py]; DFlashAttention's
is the type of `qkv`, and TensorRT's concatenation takes one type, never FP8 [read: TensorRT 10 operator reference,
Concatenation]. So the stock rows are dequantized to `qkv`'s type first (`stock_rows_as_generation_rows`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tensorrt_llm._common import default_net
from tensorrt_llm.functional import Tensor, cast, concat, div, shape, slice
from tensorrt_llm.quantization.functional import dequantize

from dflash_trt.trtllm.plugin import AttentionGeometry, dflash_attention_layer

# gpt_attention arguments that only make sense for shapes DFlashAttention does not take.
UNSUPPORTED = (
    "qkv_bias",
    "alibi_slopes",
    "relative_attention_bias",
    "logn_scaling",
    "mrope_rotary_cos_sin",
    "cross_kv",
)
SPEC_DECODING_TENSORS = (
    "spec_decoding_generation_lengths",
    "spec_decoding_position_offsets",
    "spec_decoding_packed_mask",
    "spec_decoding_use",
)


@dataclass(frozen=True)
class BlockAttention:
    """What DFlashAttention needs beyond the stock call's arguments: the block mask and window of the layer (or,
    for a draft tree's verification, `tree`: the runtime's packed mask and position offsets from the stock call's
    spec-decoding arguments), and, when the batch may hold context requests, the `input_gen_tokens` host input that
    counts the generation rows."""

    causal: bool
    window: int | None = None
    window_from_anchor: bool = False
    generation_tokens: Tensor | None = None
    tree: bool = False


# Layers building their part of the network at the same time (tensor-parallel ranks in threads) share the stock
# module: its name is rerouted while any of them needs it, and each thread sees only its own layer's block.
_building = threading.local()
_lock = threading.Lock()
_rerouted: dict[int, tuple[Any, int]] = {}  # id(module namespace) -> (the stock function, layers using it)


@contextlib.contextmanager
def dflash_attention(attention: Any, block: BlockAttention | None) -> Iterator[None]:
    """While `attention` (a stock Attention layer) adds itself to the network, its generation requests go to
    DFlashAttention (nothing changes when `block` is None); the stock name is restored afterwards."""
    if block is None:
        yield
        return
    namespace = type(attention).forward.__globals__
    key = id(namespace)
    with _lock:
        stock, users = _rerouted.get(key, (namespace["gpt_attention"], 0))
        if users == 0:
            namespace["gpt_attention"] = functools.partial(_dispatch, stock)
        _rerouted[key] = (stock, users + 1)
    blocks = _building.__dict__.setdefault("blocks", [])
    blocks.append(block)
    try:
        yield
    finally:
        blocks.pop()
        with _lock:
            stock, users = _rerouted.pop(key)
            if users == 1:
                namespace["gpt_attention"] = stock
            else:
                _rerouted[key] = (stock, users - 1)


def _dispatch(stock: Any, **kwargs: Any) -> tuple[Tensor, Any]:
    """The rerouted name: this thread's innermost layer block, or the stock plugin when it has none."""
    blocks = getattr(_building, "blocks", [])
    return _routed(stock, blocks[-1], **kwargs) if blocks else stock(**kwargs)


@dataclass(frozen=True)
class BatchSplit:
    """Where the step's generation requests begin: after `context_tokens` rows and `context_requests` requests."""

    context_tokens: Tensor
    generation_tokens: Tensor
    context_requests: Tensor
    generation_requests: Tensor


def batch_split(block: BlockAttention, kwargs: dict[str, Any]) -> BatchSplit:
    """The split from the shapes the runtime binds (see the module docstring)."""
    gen_tokens = shape(block.generation_tokens, 0)
    gen_requests = shape(kwargs["spec_decoding_generation_lengths"], 0)
    return BatchSplit(
        context_tokens=shape(kwargs["qkv"], 0) - gen_tokens,
        generation_tokens=gen_tokens,
        context_requests=shape(kwargs["sequence_length"], 0) - gen_requests,
        generation_requests=gen_requests,
    )


def _routed(stock: Any, block: BlockAttention, **kwargs: Any) -> tuple[Tensor, None]:
    if block.generation_tokens is None:
        return _generation(block, kwargs, kwargs["qkv"], kwargs["sequence_length"]), None
    qkv, sequence_length = kwargs["qkv"], kwargs["sequence_length"]
    split = batch_split(block, kwargs)
    width = shape(qkv, 1)
    context_only = dict(kwargs)
    context_only.update({name: None for name in SPEC_DECODING_TENSORS})
    context_only.update(
        qkv=slice(qkv, [0, 0], concat([split.context_tokens, width])),
        sequence_length=slice(sequence_length, [0], concat([split.context_requests])),
        context_lengths=slice(kwargs["context_lengths"], [0], concat([split.context_requests])),
        spec_decoding_is_generation_length_variable=False,
    )
    context, _ = stock(**context_only)
    context = stock_rows_as_generation_rows(context, kwargs)
    generation = _generation(
        block,
        kwargs,
        slice(qkv, concat([split.context_tokens, 0]), concat([split.generation_tokens, width])),
        slice(sequence_length, concat([split.context_requests]), concat([split.generation_requests])),
    )
    return concat([context, generation], dim=0), None


def stock_rows_as_generation_rows(context: Tensor, kwargs: dict[str, Any]) -> Tensor:
    """The stock plugin's rows in `qkv`'s type, ready to be concatenated with DFlashAttention's.

    The plugin's output is FP8 exactly when the plugin config's `use_fp8_context_fmha` is on (`mFP8ContextFMHA &&
    mEnableContextFMHA`; context FMHA is always on here, as paged context FMHA, which EAGLE engines force, needs it);
    its values are then e4m3 `q = round(x * s_oq)` with `s_oq` the call's `attention_output_orig_quant_scale`.
    They are dequantized as `FP8RowLinear.forward` dequantizes an FP8 input: `dequantize` with the scale (here
    1 / s_oq) cast to the output type [read: quantization/layers.py, quantization/functional.py].

    Why nothing changes for FP8 weights: `s_oq` is 1 / the dense layer's activation scale `s` [read:
    modeling_utils.py `set_fp8_context_fhma`], and the FP8 dense re-quantizes a non-FP8 input with that same `s`.
    `q * s` rounded to bf16 / fp16 and divided by `s` again is `q` times a factor within 3 * 2^-8 of 1 (three
    roundings to the 16-bit type: this scale, the product, the dense's own cast of `s`), while rounding `q` to
    another e4m3 value takes a relative move of at least 2^-5 (half the spacing of 3 mantissa bits; e4m3's evenly
    spaced subnormals move by far less than their half-spacing, and for fp16 so do its own subnormals while `s`
    exceeds 2^-15), so the dense's quantization returns exactly `q`, the FP8 input a Hopper engine's dense receives
    straight from the plugin (saturation at 448 included). For NVFP4 weights `s_oq` is the reciprocal of the FP4
    dense's input scale, over 6 [read: layers/attention.py `_get_output_orig_quant_scale`]: the kernel's e4m3
    rounding of the attention output (relative error up to 2^-4) happens on any route and the golden model applies
    it too (`reference.quantized.fp8_attention_rows`); this path adds one rounding to bf16 / fp16 (up to 2^-8 / 2^-11
    relative) before the dense's dynamic FP4 quantization, which moves an FP4 value only where it lies that close
    to a rounding boundary."""
    if not default_net().plugin_config.use_fp8_context_fmha:
        return context
    orig_quant = kwargs.get("attention_output_orig_quant_scale")
    if orig_quant is None:
        raise ValueError("FP8 context FMHA: the stock attention call carries no attention_output_orig_quant_scale")
    dtype = kwargs["qkv"].dtype
    return dequantize(context, cast(div(1.0, orig_quant), dtype), -1, dtype)


def _generation(block: BlockAttention, kwargs: dict[str, Any], qkv: Tensor, sequence_length: Tensor) -> Tensor:
    """DFlashAttention over the generation requests' rows, from the stock call's arguments."""
    for name in UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"DFlashAttention does not take gpt_attention's {name}")
    head_dim = kwargs["hidden_size_per_head"]
    if kwargs["rotary_embedding_dim"] != head_dim or kwargs["rotary_cos_sin"] is None:
        raise ValueError("DFlashAttention rotates the whole head with the plugin's cos/sin table (rotate-half RoPE)")
    geometry = AttentionGeometry(
        num_heads=kwargs["num_heads"],
        num_kv_heads=kwargs["num_kv_heads"],
        head_dim=head_dim,
        layer_idx=kwargs["layer_idx"],
        tokens_per_block=default_net().plugin_config.tokens_per_block,
        max_query_len=kwargs["spec_decoding_max_generation_length"],
        causal=block.causal,
        window=block.window,
        window_from_anchor=block.window_from_anchor,
        max_positions=kwargs["rotary_embedding_max_positions"],
        q_scaling=kwargs["q_scaling"],
        tree=block.tree,
    )
    # Indexed from the step's first generation request, so they serve the generation rows as they come [read:
    # GPTAttentionPlugin::enqueueSome]; the mask rows follow one another request by request.
    tree = (kwargs["spec_decoding_position_offsets"], kwargs["spec_decoding_packed_mask"]) if block.tree else None
    return dflash_attention_layer(
        qkv,
        sequence_length,
        kwargs["spec_decoding_generation_lengths"],
        kwargs["rotary_cos_sin"],
        kwargs["kv_cache_block_offsets"],
        kwargs["host_kv_cache_pool_pointers"],
        kwargs["host_kv_cache_pool_mapping"],
        kwargs["host_past_key_value_lengths"],
        geometry,
        kv_scale_orig_quant=kwargs.get("kv_orig_quant_scale"),
        kv_scale_quant_orig=kwargs.get("kv_quant_orig_scale"),
        tree=tree,
    )
