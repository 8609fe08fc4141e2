"""Our plugin, `DFlashKVInjection`, registered when the emulated plugin library is "loaded".

It is built from the creation fields `plugin_fields` defines and receives the inputs in `kv_injection_layer`'s
order. K = RoPE(rmsnorm(k) * w) with the RoPE table rebuilt from its `rope_inv_freq` / `rope_attention_scaling`
fields, V as is, computed in fp32 and rounded once; it writes through `PagedKVCacheLayout` and `to_cache_dtype` of
the torch definition (`dflash_trt.reference.kv_injection`), resolving each layer's pool from
`host_kv_cache_pool_mapping[offset + l]`. Its output is a lazy copy of `passthrough`: the write happens when the
consumer reads it (see functional.py).

Formats, as `plugins/src/kvInjectionPlugin.cpp` accepts them: `type_id` HALF or BF16 (its config validation),
`ctx_kv` and `k_norm_weight` of that type, the index inputs int32, the pool pointers int64, `passthrough` FLOAT,
HALF, BF16 or INT32 and the output of its type, the FP8 scale FLOAT (`supportsFormatCombination`); the cache holds
the input type, or FP8. One emulation-only extension: `type_id` FLOAT for float32 checkpoints, which no engine is
built from (`formats.ENGINE_DTYPES`) but which the emulation runs to compare with the golden model bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dflash_trt.emulation import trt
from dflash_trt.emulation.functional import EmulationError, Tensor
from dflash_trt.emulation.kv_pool import pool_at
from dflash_trt.reference.kv_injection import PagedKVCacheLayout, to_cache_dtype
from dflash_trt.trtllm.plugin import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION

# kvInjectionPlugin.cpp: the input types its kernels are instantiated for; FLOAT only in the emulation (above).
TYPE_IDS = (int(trt.DataType.HALF), int(trt.DataType.BF16))
EMULATION_ONLY_TYPE_IDS = (int(trt.DataType.FLOAT),)


def _int32(t: Tensor, what: str, rank: int) -> torch.Tensor:
    if t.dtype != trt.int32 or t.rank() != rank:
        raise EmulationError(f"{what} must be int32 of rank {rank}, got {t.dtype.name} rank {t.rank()}")
    return t.data


def _field(fields: dict[str, Any], name: str) -> Any:
    if name not in fields:
        raise EmulationError(f"{PLUGIN_NAME} created without the field '{name}'")
    return fields[name]


class KVInjectionPlugin:
    def __init__(self, fields: dict[str, np.ndarray]):
        def scalar(name: str) -> int:
            return int(_field(fields, name)[0])

        self.num_layers, self.num_kv_heads, self.head_dim = (
            scalar(n) for n in ("num_layers", "num_kv_heads", "head_dim")
        )
        self.layer_idx_offset, self.tokens_per_block = scalar("layer_idx_offset"), scalar("tokens_per_block")
        self.type_id, self.cache_fp8 = scalar("type_id"), scalar("cache_fp8")
        self.eps = float(_field(fields, "eps")[0])
        self.inv_freq = torch.from_numpy(np.asarray(_field(fields, "rope_inv_freq"), dtype=np.float32))
        self.attention_scaling = float(_field(fields, "rope_attention_scaling")[0])
        if self.inv_freq.numel() * 2 != self.head_dim:
            raise EmulationError("rope_inv_freq must hold head_dim / 2 frequencies")
        if self.type_id not in (*TYPE_IDS, *EMULATION_ONLY_TYPE_IDS):
            raise EmulationError(f"{PLUGIN_NAME}: type_id must be HALF or BF16, got {self.type_id}")
        self.input_type = trt.DataType(self.type_id)

    def _formats(self) -> list[tuple[trt.DataType, ...]]:
        """Per input position, the types supportsFormatCombination accepts."""
        index = (trt.int32,)
        formats: list[tuple[trt.DataType, ...]] = [(self.input_type,), (self.input_type,), index, index, index, index]
        formats.append(index)
        formats += [(trt.int64,), index]
        formats.append((trt.float32, trt.float16, trt.bfloat16, trt.int32))
        if self.cache_fp8:
            formats.append((trt.float32,))
        return formats

    def add_to_network(self, inputs: list[Tensor]) -> list[Tensor]:
        expected = 11 if self.cache_fp8 else 10
        if len(inputs) != expected:
            raise EmulationError(f"{PLUGIN_NAME} takes {expected} inputs, got {len(inputs)}")
        for position, (tensor, allowed) in enumerate(zip(inputs, self._formats(), strict=False)):
            if tensor.dtype not in allowed:
                names = " or ".join(t.name for t in allowed)
                raise EmulationError(
                    f"{PLUGIN_NAME} input {position} is {tensor.dtype.name}; the plugin supports {names} there "
                    "(supportsFormatCombination)"
                )
        passthrough = inputs[9]
        return [Tensor(thunk=lambda: self._execute(inputs, passthrough))]

    def _execute(self, inputs: list[Tensor], passthrough: Tensor) -> torch.Tensor:
        ctx_kv, k_norm, positions, cache_positions, seq_slots, valid, offsets, pointers, mapping = inputs[:9]
        if not (pointers.host and mapping.host):
            raise EmulationError("host_kv_cache_pool_pointers / _mapping must be host tensors (network inputs)")
        layers, heads, dim = self.num_layers, self.num_kv_heads, self.head_dim
        if ctx_kv.shape[-1] != layers * 2 * heads * dim or tuple(k_norm.shape) != (layers, dim):
            raise EmulationError(f"ctx_kv {ctx_kv.shape} / k_norm {k_norm.shape} do not match the plugin fields")
        tokens = ctx_kv.shape[0]
        index = {
            name: _int32(t, name, 1)
            for name, t in (
                ("positions", positions),
                ("cache_positions", cache_positions),
                ("seq_slots", seq_slots),
                ("valid", valid),
            )
        }
        if any(v.shape[0] != tokens for v in index.values()):
            raise EmulationError("positions, cache_positions, seq_slots and valid need one entry per ctx_kv row")
        keep = index["valid"].bool()
        pos, slots = index["positions"][keep], index["seq_slots"][keep]
        at = index["cache_positions"][keep]
        x = ctx_kv.data[keep].float().reshape(-1, layers, 2, heads, dim)
        k, v = self._k(x[:, :, 0], k_norm.data.float(), pos), x[:, :, 1]
        scale = None
        if self.cache_fp8:
            scale = float(inputs[10].data.reshape(()))
        table = mapping.data
        for layer in range(layers):
            pool_index, layer_in_pool = (int(t) for t in table[self.layer_idx_offset + layer])
            pool = pool_at(int(pointers.data[pool_index, 0]))
            if pool is None:
                raise EmulationError(f"no KV pool at the pointer of pool {pool_index}")
            cache = torch.float8_e4m3fn if self.cache_fp8 else trt.TORCH_DTYPES[self.input_type]
            if pool.dtype != cache:
                raise EmulationError(f"a {pool.dtype} KV pool; the plugin writes {cache} (type_id, cache_fp8)")
            block_offsets = offsets.data[pool_index]
            layout = PagedKVCacheLayout(heads, dim, self.tokens_per_block, block_offsets.shape[-1], layer_in_pool)
            flat = pool.data.view(-1)
            for kind, values in ((0, k[:, layer]), (1, v[:, layer])):
                stored = values if pool.dtype == torch.float32 else to_cache_dtype(values, pool.dtype, scale)
                _, elements = layout.element_offsets(block_offsets, slots, at, 0, kind)
                flat[elements.reshape(-1)] = stored.reshape(-1)
        return passthrough.data.clone()

    def _k(self, k: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[n, layers, heads, dim]: rmsnorm * weight, then GPT-NeoX RoPE at `positions`."""
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + self.eps) * weight[None, :, None, :]
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos = (angles.cos() * self.attention_scaling)[:, None, None, :]
        sin = (angles.sin() * self.attention_scaling)[:, None, None, :]
        half = k.shape[-1] // 2
        k1, k2 = k[..., :half], k[..., half:]
        return torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)


class KVInjectionCreator:
    name = PLUGIN_NAME
    version = PLUGIN_VERSION

    def create_plugin(self, name: str, fields: list[trt.PluginField], phase: trt.TensorRTPhase) -> KVInjectionPlugin:
        return KVInjectionPlugin({f.name: f.data for f in fields})


def load_emulated_plugin_library(path: Any = None) -> None:
    """What dlopen + `initDflashTrtPlugins` do for a real engine: register the creator under our namespace."""
    trt.get_plugin_registry().register_creator(KVInjectionCreator(), PLUGIN_NAMESPACE)
