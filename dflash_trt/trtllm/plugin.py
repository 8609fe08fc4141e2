"""The DFlash KV-injection plugin inside a TensorRT-LLM 1.2.x network.

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
cache write. The semantics are `dflash_trt.reference.kv_injection.kv_injection`; the library must be loaded
(`load_plugin_library`) in every process that builds or deserializes the engine (Triton: `LD_PRELOAD`).
TensorRT and TensorRT-LLM are imported only inside the functions that need them.
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
    import tensorrt as trt
    from tensorrt_llm._common import default_trtnet
    from tensorrt_llm.functional import _create_tensor

    load_plugin_library()
    creator = trt.get_plugin_registry().get_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE)
    if creator is None:
        raise DFlashTrtError(f"TensorRT has no {PLUGIN_NAMESPACE}::{PLUGIN_NAME} creator after loading the library.")
    fields = plugin_fields(geometry, type_id=int(ctx_kv.dtype), cache_fp8=kv_scale_orig_quant is not None)
    collection = trt.PluginFieldCollection(
        [trt.PluginField(name, value, getattr(trt.PluginFieldType, kind)) for name, value, kind in fields]
    )
    plugin = creator.create_plugin("dflash_kv_injection", collection, trt.TensorRTPhase.BUILD)
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
    layer = default_trtnet().add_plugin_v3([t.trt_tensor for t in inputs], [], plugin)
    return _create_tensor(layer.get_output(0), layer)
