"""Our plugins, `DFlashKVInjection` and `DFlashAttention`, registered when the emulated plugin library is "loaded".

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

`DFlashAttention` executes what its kernels compute (`plugins/include/dflash_trt/attentionCta.h`): per generation
request (the qkv rows in request order; the requests are the last rows of the block table) the new tokens sit at
`sequence_length - n .. sequence_length - 1`; Q and K are rotated in float32 with the layer's cos/sin table and
rounded to the input type, K and V are written into the pool (the input type, or FP8 as `saturate(x *
kv_scale_orig_quant)`), and each query attends in float32 over the stored keys it sees: the past, then the new keys
up to itself (causal) or all of them (full), within the sliding window when there is one (counted from each query:
`window` or more positions behind is out, and, for a full block, as far ahead; counted from the block's anchor with
`window_from_anchor`: keys before `past - window` are out), or, with `block_mask` 2 (a draft tree's
verification), the new keys whose bit is set in the query's row of the runtime's `spec_decoding_packed_mask` (bit
j % 32 of word j // 32; rows request after request), its RoPE at `past + spec_decoding_position_offsets[r][t]`
while its K / V still go to slot `past + t`. P is rounded to the input type before the P V
product and the output once, as the tensor-core kernel does; the kernel's tile-by-tile running maximum is not
emulated (a difference within the input type's rounding). Formats as `attentionPlugin.cpp` accepts them, plus the
FLOAT `type_id` of float32 checkpoints.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dflash_trt.emulation import trt
from dflash_trt.emulation.functional import EmulationError, Tensor
from dflash_trt.emulation.kv_pool import pool_at, resolve_pool
from dflash_trt.reference.kv_injection import PagedKVCacheLayout, to_cache_dtype
from dflash_trt.trtllm.build_limits import DFLASH_ATTENTION_HEAD_DIMS
from dflash_trt.trtllm.plugin import ATTENTION_PLUGIN_NAME, PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION

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


class AttentionPlugin:
    def __init__(self, fields: dict[str, np.ndarray]):
        def scalar(name: str) -> int:
            return int(_field(fields, name)[0])

        self.heads, self.kv_heads, self.head_dim = (scalar(n) for n in ("num_heads", "num_kv_heads", "head_dim"))
        self.layer_idx, self.max_query_len = scalar("layer_idx"), scalar("max_query_len")
        self.block_mask, self.window = scalar("block_mask"), scalar("sliding_window")
        self.causal, self.tree = self.block_mask == 0, self.block_mask == 2
        self.window_from_anchor = scalar("window_from_anchor")
        self.max_positions, self.type_id = scalar("max_positions"), scalar("type_id")
        self.cache_fp8, self.q_scaling = scalar("cache_fp8"), float(_field(fields, "q_scaling")[0])
        if self.heads <= 0 or self.kv_heads <= 0 or self.heads % self.kv_heads:
            raise EmulationError(f"{ATTENTION_PLUGIN_NAME}: num_heads must be a positive multiple of num_kv_heads")
        if self.head_dim not in DFLASH_ATTENTION_HEAD_DIMS and self.type_id not in EMULATION_ONLY_TYPE_IDS:
            raise EmulationError(f"{ATTENTION_PLUGIN_NAME}: head_dim {self.head_dim} is not one of its kernels'")
        if self.block_mask not in (0, 1, 2) or self.window_from_anchor not in (0, 1) or self.window < 0:
            raise EmulationError(
                f"{ATTENTION_PLUGIN_NAME}: block_mask must be 0, 1 or 2, window_from_anchor 0 or 1, sliding_window >= 0"
            )
        if self.tree and self.window:
            raise EmulationError(f"{ATTENTION_PLUGIN_NAME}: a tree mask (block_mask 2) takes no sliding window")
        # Inputs after the eight of every call: the tree's position offsets and packed mask, then the FP8 scales.
        self.scales_at = 10 if self.tree else 8
        if self.type_id not in (*TYPE_IDS, *EMULATION_ONLY_TYPE_IDS):
            raise EmulationError(f"{ATTENTION_PLUGIN_NAME}: type_id must be HALF or BF16, got {self.type_id}")
        self.input_type = trt.DataType(self.type_id)

    def _formats(self) -> list[tuple[trt.DataType, ...]]:
        """Per input position, the types supportsFormatCombination accepts."""
        i32: tuple[trt.DataType, ...] = (trt.int32,)
        f32: tuple[trt.DataType, ...] = (trt.float32,)
        formats = [(self.input_type,), i32, i32, f32, i32, (trt.int64,), i32, i32]
        formats += [i32, i32] if self.tree else []
        return formats + [f32, f32] if self.cache_fp8 else formats

    def add_to_network(self, inputs: list[Tensor]) -> list[Tensor]:
        expected = len(self._formats())
        if len(inputs) != expected:
            raise EmulationError(f"{ATTENTION_PLUGIN_NAME} takes {expected} inputs, got {len(inputs)}")
        for position, (tensor, allowed) in enumerate(zip(inputs, self._formats(), strict=True)):
            if tensor.dtype not in allowed:
                raise EmulationError(
                    f"{ATTENTION_PLUGIN_NAME} input {position} is {tensor.dtype.name}; the plugin supports "
                    f"{' or '.join(t.name for t in allowed)} there (supportsFormatCombination)"
                )
        return [Tensor(thunk=lambda: self._execute(inputs))]

    def _execute(self, inputs: list[Tensor]) -> torch.Tensor:
        qkv, seq_lens, gen_lens, cos_sin, offsets, pointers, mapping, host_past = inputs[:8]
        if not (pointers.host and mapping.host and host_past.host):
            raise EmulationError("pool pointers, pool mapping and past-length bounds must be host tensors (inputs)")
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        x, dtype = qkv.data, qkv.data.dtype
        if x.dim() != 2 or x.shape[1] != (h + 2 * kvh) * d:
            raise EmulationError(f"{ATTENTION_PLUGIN_NAME}: qkv {tuple(x.shape)} does not match the plugin fields")
        lengths, ends = _int32(gen_lens, "generation_lengths", 1), _int32(seq_lens, "sequence_length", 1)
        requests, first_row = lengths.shape[0], offsets.shape[1] - lengths.shape[0]
        if ends.shape[0] != requests or first_row < 0 or host_past.shape[0] < requests:
            raise EmulationError(f"{ATTENTION_PLUGIN_NAME}: request counts of its inputs differ")
        if int(lengths.sum()) != x.shape[0] or bool((lengths > self.max_query_len).any()):
            raise EmulationError(f"{ATTENTION_PLUGIN_NAME}: generation lengths do not cover the qkv rows")
        table = cos_sin.data.reshape(-1, d // 2, 2)
        tree = self._tree_inputs(inputs, requests, x.shape[0]) if self.tree else None
        out = torch.zeros(x.shape[0], h * d, dtype=dtype)
        row = 0
        for r in range(requests):
            n, end = int(lengths[r]), int(ends[r])
            pages = resolve_pool(mapping, pointers, offsets, self.layer_idx, first_row + r)
            node = None if tree is None else (tree[0][r, :n], tree[1][row : row + n])
            out[row : row + n] = self._request(x[row : row + n], end - n, end, table, pages, inputs, node)
            row += n
        return out

    def _tree_inputs(self, inputs: list[Tensor], requests: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(position offsets [requests, >= n], [tokens, max_query_len] block visibility): bit j % 32 of word j // 32
        of a token's packed-mask row (rows request after request), as attentionMath.h packedMaskBit reads it."""
        offsets, packed = _int32(inputs[8], "position_offsets", 2), _int32(inputs[9], "packed_mask", 2)
        if offsets.shape[0] < requests or packed.shape[0] < tokens or 32 * packed.shape[1] < self.max_query_len:
            raise EmulationError(
                f"{ATTENTION_PLUGIN_NAME}: the tree's offsets need a row per request and its packed mask a row per "
                f"token of {self.max_query_len} bits"
            )
        bits = torch.arange(self.max_query_len)
        words = packed[:tokens].long() & 0xFFFFFFFF
        return offsets.long(), ((words[:, bits // 32] >> (bits % 32)) & 1).bool()

    def _request(
        self,
        x: torch.Tensor,
        past: int,
        end: int,
        table: torch.Tensor,
        pages: Any,
        inputs: list,
        node: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> Any:
        """One request's rows; `node` = a tree's (depths, block visibility rows) of its tokens."""
        h, kvh, d, n, dtype = self.heads, self.kv_heads, self.head_dim, x.shape[0], x.dtype
        positions = torch.arange(past, end)
        rotary = positions if node is None else past + node[0]
        if past < 0 or bool((rotary < 0).any()) or end > min(table.shape[0], self.max_positions):
            raise EmulationError(f"{ATTENTION_PLUGIN_NAME}: positions up to {end} beyond the RoPE table")
        q, k, v = x.split([h * d, kvh * d, kvh * d], dim=-1)
        cos, sin = table[rotary, :, 0], table[rotary, :, 1]
        q = _rotate_half(q.reshape(n, h, d).float(), cos, sin).to(dtype)
        k = _rotate_half(k.reshape(n, kvh, d).float(), cos, sin).to(dtype)
        v = v.reshape(n, kvh, d)
        orig_quant = float(inputs[self.scales_at].data.reshape(())) if self.cache_fp8 else None
        for kind, values in ((0, k), (1, v)):
            stored = values if orig_quant is None else (values.float() * orig_quant).clamp(-448.0, 448.0)
            if orig_quant is None and pages.dtype != dtype:
                raise EmulationError(f"a {pages.dtype} KV pool for {dtype} attention (the cache holds the input type)")
            pages.write(kind, positions, stored.to(pages.dtype))
        keys_at = torch.arange(end)
        dequant = float(inputs[self.scales_at + 1].data.reshape(())) if self.cache_fp8 else 1.0
        keys = (pages.read(0, keys_at).float() * dequant).repeat_interleave(h // kvh, dim=1)
        values = (pages.read(1, keys_at).float() * dequant).repeat_interleave(h // kvh, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), keys) / (d**0.5 * self.q_scaling)
        if node is None:
            visible = self._visible(positions, keys_at, end)
        else:  # every past key, and the block keys the node's packed-mask row sets
            visible = torch.cat([torch.ones(n, past, dtype=torch.bool), node[1][:, :n]], dim=1)
        scores = scores.masked_fill(~visible, float("-inf"))
        p = (scores - scores.amax(-1, keepdim=True)).exp()
        out = torch.einsum("hqk,khd->qhd", p.to(dtype).float(), values) / p.sum(-1).transpose(0, 1)[..., None]
        return out.reshape(n, h * d).to(dtype)

    def _visible(self, queries: torch.Tensor, keys: torch.Tensor, end: int) -> torch.Tensor:
        """[queries, keys]: what attentionMath.h keyVisible says."""
        q, k = queries[:, None], keys[None, :]
        visible = k < end
        if self.causal:
            visible = visible & (k <= q)
        if self.window and self.window_from_anchor:
            visible = visible & (k >= int(queries[0]) - self.window)
        elif self.window:
            visible = visible & (q - k < self.window)
            if not self.causal:
                visible = visible & (k - q < self.window)
        return visible


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1)


class AttentionCreator:
    name = ATTENTION_PLUGIN_NAME
    version = PLUGIN_VERSION

    def create_plugin(self, name: str, fields: list[trt.PluginField], phase: trt.TensorRTPhase) -> AttentionPlugin:
        return AttentionPlugin({f.name: f.data for f in fields})


class KVInjectionCreator:
    name = PLUGIN_NAME
    version = PLUGIN_VERSION

    def create_plugin(self, name: str, fields: list[trt.PluginField], phase: trt.TensorRTPhase) -> KVInjectionPlugin:
        return KVInjectionPlugin({f.name: f.data for f in fields})


def load_emulated_plugin_library(path: Any = None) -> None:
    """What dlopen + `initDflashTrtPlugins` do for a real engine: register the creators under our namespace."""
    registry = trt.get_plugin_registry()
    registry.register_creator(KVInjectionCreator(), PLUGIN_NAMESPACE)
    registry.register_creator(AttentionCreator(), PLUGIN_NAMESPACE)
