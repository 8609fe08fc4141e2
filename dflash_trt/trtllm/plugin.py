"""The DFlash plugins inside a TensorRT-LLM 1.2.x network: KV injection, and the generation-step attention.

    kv_injection_layer(
        ctx_kv,                       # [tokens, num_layers * 2 * num_kv_heads * head_dim] fp16/bf16: the one fused
                                      #   K/V GEMM of hidden_norm(fc(taps)) for all draft layers, laid out
                                      #   [layer][k|v][kv_head][head_dim] along the last dim
        k_norm_weight,                # [num_layers, head_dim], same dtype as ctx_kv
        positions,                    # int32 [tokens]: absolute (RoPE) position of each token
        cache_positions,              # int32 [tokens]: the cache slot each token is written at: its position, or
                                      #   for a draft tree's node the slot the runtime's rewind will move it from
        seq_slots,                    # int32 [tokens]: row of kv_cache_block_offsets (the request's batch index)
        valid,                        # int32 [tokens]: 0 = skip (padding / rejected tokens keep shapes static)
        kv_cache_block_offsets,       # int32 [num_pools, batch, 2, max_blocks_per_seq]  (KeyValueCacheParams)
        host_kv_cache_pool_pointers,  # int64 [num_pools, 2] host                       (KeyValueCacheParams)
        host_kv_cache_pool_mapping,   # int32 [num_layers_total, 2] host                (KeyValueCacheParams)
        passthrough,                  # any fp32/fp16/bf16/int32 tensor; returned copied, ordered after the write
        geometry,                     # KVInjectionGeometry: draft layers, heads, cache blocks, RoPE, eps
        kv_scale_orig_quant=None,     # float32 [1]: FP8 KV cache when given (1 / kv_cache_scaling_factor)
    ) -> Tensor                       # the copy of `passthrough`

Feed the returned tensor to the drafter's block attention so TensorRT cannot schedule that attention before the
cache write. The semantics are `dflash_trt.reference.kv_injection.kv_injection`.

    dflash_attention_layer(
        qkv,                          # [tokens, (heads + 2 kv_heads) * head_dim] fp16/bf16: the generation
                                      #   requests' rows, packed in request order, after the q/k norms
        sequence_length,              # int32 [requests]: past + new tokens
        generation_lengths,           # int32 [requests]: new tokens (K + 1 verified, or the draft block)
        rotary_cos_sin,               # float32: the attention plugin's (cos, sin) table of this layer's RoPE
        kv_cache_block_offsets,       # int32 [num_pools, seqs, 2, max_blocks_per_seq]; the requests are its last rows
        host_kv_cache_pool_pointers,  # int64 [num_pools, 2] host
        host_kv_cache_pool_mapping,   # int32 [num_layers_total, 2] host
        host_past_key_value_lengths,  # int32 [seqs] host: the runtime's length bounds (size the key split only)
        geometry,                     # AttentionGeometry: heads, layer, block mask, window, RoPE table size
        kv_scale_orig_quant=None,     # float32 [1] with kv_scale_quant_orig: an FP8 KV cache
        kv_scale_quant_orig=None,
        tree=None,                    # with geometry.tree: (spec_decoding_position_offsets [requests, >= n],
                                      #   spec_decoding_packed_mask [tokens, words]) int32, the runtime's own
    ) -> Tensor                       # [tokens, heads * head_dim], the input type

writes the new tokens' K / V into the pool (RoPE'd from the table, as the GPT attention plugin's generation step
writes them) and attends over past + new keys with a causal or full block mask and an optional sliding window, or
with a draft tree's packed mask and position offsets (block_mask 2: node t at RoPE position past + offsets[t], cache
slot past + t, sees the past and the block keys its mask row sets; docs/plugin.md). The library must be loaded
(`load_plugin_library`) in every process that builds or deserializes the engine (Triton: `LD_PRELOAD`). TensorRT and
TensorRT-LLM are imported only inside the functions that need them.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashTrtError
from dflash_trt.rope import RopeConfig, inv_freq_and_scale

PLUGIN_NAME = "DFlashKVInjection"
ATTENTION_PLUGIN_NAME = "DFlashAttention"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "dflash_trt"
LIBRARY_NAME = "libdflash_trt_plugins.so"
LIBRARY_ENV = "DFLASH_TRT_PLUGIN_LIB"

_loaded: ctypes.CDLL | None = None


def default_library_path() -> Path:
    """`$DFLASH_TRT_PLUGIN_LIB`, else the CMake build folder of this source tree (`plugins/build`)."""
    env = os.environ.get(LIBRARY_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "plugins" / "build" / LIBRARY_NAME


def load_plugin_library(path: str | os.PathLike | None = None) -> ctypes.CDLL:
    """dlopen the plugin library once and register its creators under the `dflash_trt` namespace."""
    global _loaded
    if _loaded is not None:
        return _loaded
    lib_path = Path(path) if path is not None else default_library_path()
    if not lib_path.is_file():
        raise DFlashTrtError(f"plugin library {lib_path} not found: build plugins/ with CMake or set {LIBRARY_ENV}.")
    try:
        handle = ctypes.CDLL(str(lib_path), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise DFlashTrtError(f"cannot load {lib_path}: {exc}") from exc
    handle.initDflashTrtPlugins.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    handle.initDflashTrtPlugins.restype = ctypes.c_bool
    if not handle.initDflashTrtPlugins(None, PLUGIN_NAMESPACE.encode()):
        raise DFlashTrtError(f"{lib_path} failed to register its TensorRT plugin creators.")
    _loaded = handle
    return handle


@dataclass(frozen=True)
class KVInjectionGeometry:
    """The plugin's creation parameters that describe the draft layers and the paged cache, per TP rank."""

    num_layers: int
    num_kv_heads: int  # after TP
    head_dim: int
    layer_idx_offset: int  # model layer index of draft layer 0 (= target num_hidden_layers for a single call)
    tokens_per_block: int  # the engine's paged-KV block size (power of two)
    rope: RopeConfig  # the drafter's
    eps: float  # k_norm epsilon


def plugin_fields(geometry: KVInjectionGeometry, *, type_id: int, cache_fp8: bool) -> list[tuple[str, Any, str]]:
    """(name, numpy value, PluginFieldType name) triples: the plugin's creation fields, defined once."""
    import numpy as np

    g = geometry
    if g.rope.head_dim != g.head_dim:
        raise DFlashTrtError(f"rope head_dim {g.rope.head_dim} differs from the KV head_dim {g.head_dim}.")
    if g.tokens_per_block <= 0 or g.tokens_per_block & (g.tokens_per_block - 1):
        raise DFlashTrtError(f"tokens_per_block must be a power of two, got {g.tokens_per_block}.")
    inv_freq, attention_scaling = inv_freq_and_scale(g.rope)

    def i32(v: int) -> Any:
        return np.array([v], dtype=np.int32)

    return [
        ("num_layers", i32(g.num_layers), "INT32"),
        ("num_kv_heads", i32(g.num_kv_heads), "INT32"),
        ("head_dim", i32(g.head_dim), "INT32"),
        ("layer_idx_offset", i32(g.layer_idx_offset), "INT32"),
        ("tokens_per_block", i32(g.tokens_per_block), "INT32"),
        ("type_id", i32(type_id), "INT32"),
        ("cache_fp8", i32(int(cache_fp8)), "INT32"),
        ("eps", np.array([g.eps], dtype=np.float32), "FLOAT32"),
        ("rope_inv_freq", inv_freq.numpy().astype(np.float32), "FLOAT32"),
        ("rope_attention_scaling", np.array([attention_scaling], dtype=np.float32), "FLOAT32"),
    ]


@dataclass(frozen=True)
class AttentionGeometry:
    """The DFlashAttention creation parameters of one attention layer, per TP rank."""

    num_heads: int  # after TP
    num_kv_heads: int  # after TP
    head_dim: int
    layer_idx: int  # the layer's row of host_kv_cache_pool_mapping
    tokens_per_block: int
    max_query_len: int  # new tokens per request at most (K + 1, or the draft block)
    causal: bool  # block mask: causal (the verified chain, causal draft layers) or full (DFlash's block)
    window: int | None  # sliding window, or None
    max_positions: int  # rows of the RoPE table
    q_scaling: float = 1.0
    window_from_anchor: bool = False  # the window counts back from the block's anchor (speculators), not each query
    tree: bool = False  # a draft tree's verification: the runtime's packed mask and position offsets, not `causal`


def attention_plugin_fields(
    geometry: AttentionGeometry, *, type_id: int, cache_fp8: bool
) -> list[tuple[str, Any, str]]:
    """(name, numpy value, PluginFieldType name) triples: DFlashAttention's creation fields, defined once."""
    import numpy as np

    g = geometry
    if g.tokens_per_block <= 0 or g.tokens_per_block & (g.tokens_per_block - 1):
        raise DFlashTrtError(f"tokens_per_block must be a power of two, got {g.tokens_per_block}.")
    if g.window is not None and g.window < 1:
        raise DFlashTrtError(f"a sliding window must be at least 1, got {g.window}.")
    if g.tree and g.window is not None:
        raise DFlashTrtError("a draft tree's verification (tree mask) takes no sliding window.")

    def i32(v: int) -> Any:
        return np.array([v], dtype=np.int32)

    return [
        ("num_heads", i32(g.num_heads), "INT32"),
        ("num_kv_heads", i32(g.num_kv_heads), "INT32"),
        ("head_dim", i32(g.head_dim), "INT32"),
        ("layer_idx", i32(g.layer_idx), "INT32"),
        ("tokens_per_block", i32(g.tokens_per_block), "INT32"),
        ("max_query_len", i32(g.max_query_len), "INT32"),
        ("block_mask", i32(2 if g.tree else 0 if g.causal else 1), "INT32"),
        ("sliding_window", i32(g.window or 0), "INT32"),
        ("window_from_anchor", i32(int(g.window_from_anchor)), "INT32"),
        ("max_positions", i32(g.max_positions), "INT32"),
        ("type_id", i32(type_id), "INT32"),
        ("cache_fp8", i32(int(cache_fp8)), "INT32"),
        ("q_scaling", np.array([g.q_scaling], dtype=np.float32), "FLOAT32"),
    ]


def _add_plugin(name: str, layer_name: str, fields: list[tuple[str, Any, str]], inputs: list[Any]) -> Any:
    """One IPluginV3 layer of our library in the current network; returns its first output."""
    import tensorrt as trt
    from tensorrt_llm._common import default_trtnet
    from tensorrt_llm.functional import _create_tensor

    load_plugin_library()
    creator = trt.get_plugin_registry().get_creator(name, PLUGIN_VERSION, PLUGIN_NAMESPACE)
    if creator is None:
        raise DFlashTrtError(f"TensorRT has no {PLUGIN_NAMESPACE}::{name} creator after loading the library.")
    collection = trt.PluginFieldCollection(
        [trt.PluginField(field, value, getattr(trt.PluginFieldType, kind)) for field, value, kind in fields]
    )
    plugin = creator.create_plugin(layer_name, collection, trt.TensorRTPhase.BUILD)
    layer = default_trtnet().add_plugin_v3([t.trt_tensor for t in inputs], [], plugin)
    return _create_tensor(layer.get_output(0), layer)


def dflash_attention_layer(
    qkv: Any,
    sequence_length: Any,
    generation_lengths: Any,
    rotary_cos_sin: Any,
    kv_cache_block_offsets: Any,
    host_kv_cache_pool_pointers: Any,
    host_kv_cache_pool_mapping: Any,
    host_past_key_value_lengths: Any,
    geometry: AttentionGeometry,
    kv_scale_orig_quant: Any | None = None,
    kv_scale_quant_orig: Any | None = None,
    tree: tuple[Any, Any] | None = None,
) -> Any:
    """Add one DFlashAttention layer (the generation requests of one attention layer) to the current network."""
    if (kv_scale_orig_quant is None) != (kv_scale_quant_orig is None):
        raise DFlashTrtError("an FP8 KV cache needs both kv_scale_orig_quant and kv_scale_quant_orig.")
    if geometry.tree != (tree is not None):
        raise DFlashTrtError("a tree mask takes the runtime's position offsets and packed mask, and only it does.")
    cache_fp8 = kv_scale_orig_quant is not None
    fields = attention_plugin_fields(geometry, type_id=int(qkv.dtype), cache_fp8=cache_fp8)
    inputs = [
        qkv,
        sequence_length,
        generation_lengths,
        rotary_cos_sin,
        kv_cache_block_offsets,
        host_kv_cache_pool_pointers,
        host_kv_cache_pool_mapping,
        host_past_key_value_lengths,
        *(tree or ()),
    ]
    if cache_fp8:
        inputs += [kv_scale_orig_quant, kv_scale_quant_orig]
    return _add_plugin(ATTENTION_PLUGIN_NAME, "dflash_attention", fields, inputs)


def kv_injection_layer(
    ctx_kv: Any,
    k_norm_weight: Any,
    positions: Any,
    cache_positions: Any,
    seq_slots: Any,
    valid: Any,
    kv_cache_block_offsets: Any,
    host_kv_cache_pool_pointers: Any,
    host_kv_cache_pool_mapping: Any,
    passthrough: Any,
    geometry: KVInjectionGeometry,
    kv_scale_orig_quant: Any | None = None,
) -> Any:
    """Add one DFlashKVInjection layer (all draft layers, all tokens) to the current TensorRT-LLM network."""
    fields = plugin_fields(geometry, type_id=int(ctx_kv.dtype), cache_fp8=kv_scale_orig_quant is not None)
    inputs = [
        ctx_kv,
        k_norm_weight,
        positions,
        cache_positions,
        seq_slots,
        valid,
        kv_cache_block_offsets,
        host_kv_cache_pool_pointers,
        host_kv_cache_pool_mapping,
        passthrough,
    ]
    if kv_scale_orig_quant is not None:
        inputs.append(kv_scale_orig_quant)
    return _add_plugin(PLUGIN_NAME, "dflash_kv_injection", fields, inputs)
