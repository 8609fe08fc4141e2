"""KV injection: the definition that the `DFlashKVInjection` plugin and its CUDA kernel are tested against.

DFlash draft layers attend to context K/V computed from target features, not from their own tokens. One GEMM of
`hidden_norm(fc(taps))` with the stacked K/V weights of all draft layers gives `ctx_kv [tokens, layers, 2, kv_heads,
head_dim]`; per token and layer the cache then receives `k = RoPE(k_norm(k_raw))` and `v = v_raw`, rounded (or FP8
quantized) once, in the paged KV pool of TensorRT-LLM 1.2.x.

Paged layout, as `cpp/tensorrt_llm/kernels/kvCacheUtils.h` (`KVBlockArray`), `kvCacheIndex.h` and the GPT attention
plugin's enqueue address it (we mirror it so the stock attention reads what we write):
- `kv_cache_block_offsets[pool][seq][k|v][page]` holds an int32 block index; bit 31 selects the secondary pool.
  For one pool the KV cache manager stores `(block * layers_in_pool) * 2 + k|v`.
- A block (page) holds `[kv_heads, tokens_per_block, head_dim]` elements of one layer's K or V.
- Layer `l` of a pool is reached by adding `2 * l` blocks to the pool pointer (the plugin's `layerOffset`).
- Token at position `p` lives in page `p // tokens_per_block`, row `p % tokens_per_block`.
So element `(layer, k|v, head, p, d)` of sequence `s` sits at flat element
`(index + 2 * layer) * kv_heads * tokens_per_block * head_dim + (head * tokens_per_block + p % tokens_per_block) *
head_dim + d` of the pool that bit 31 of `index = kv_cache_block_offsets[s][k|v][p // tokens_per_block]` selects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.errors import DFlashTrtError
from dflash_trt.rope import RopeConfig, apply_rope, rope_cos_sin

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
FP8_E4M3_MAX = 448.0
SECONDARY_POOL_FLAG = 1 << 31
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16}


@dataclass(frozen=True)
class PagedKVCacheLayout:
    """Geometry of one KV pool as the attention plugin sees it; `layer_idx_in_pool` is draft layer 0's slot."""

    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    max_blocks_per_seq: int
    layer_idx_in_pool: int = 0

    def __post_init__(self) -> None:
        tpb = self.tokens_per_block
        if tpb <= 0 or tpb & (tpb - 1):
            raise DFlashTrtError(f"tokens_per_block must be a power of two, got {tpb}.")
        if self.num_kv_heads <= 0 or self.head_dim <= 0 or self.head_dim % 2:
            raise DFlashTrtError(f"bad KV head geometry {self.num_kv_heads} x {self.head_dim}.")
        if self.max_blocks_per_seq <= 0 or self.layer_idx_in_pool < 0:
            raise DFlashTrtError("max_blocks_per_seq must be positive and layer_idx_in_pool non-negative.")

    @property
    def block_elements(self) -> int:
        return self.num_kv_heads * self.tokens_per_block * self.head_dim

    def element_offsets(
        self, block_offsets: torch.Tensor, seq_slots: torch.Tensor, positions: torch.Tensor, layer: int, kv: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(secondary-pool flags [T], flat element offsets [T, kv_heads, head_dim]) of K (kv=0) or V (kv=1)."""
        pages = positions.long() // self.tokens_per_block
        if bool((pages >= self.max_blocks_per_seq).any()) or bool((positions < 0).any()):
            raise DFlashTrtError("a token position lies outside the pages of its sequence.")
        raw = block_offsets.reshape(-1, 2, self.max_blocks_per_seq)[seq_slots.long(), kv, pages].long() & 0xFFFFFFFF
        secondary = (raw & SECONDARY_POOL_FLAG) != 0
        index = raw & (SECONDARY_POOL_FLAG - 1)
        base = (index + 2 * (self.layer_idx_in_pool + layer)) * self.block_elements
        rows = positions.long() % self.tokens_per_block
        heads = torch.arange(self.num_kv_heads)
        dims = torch.arange(self.head_dim)
        within = (heads[None, :, None] * self.tokens_per_block + rows[:, None, None]) * self.head_dim + dims
        return secondary, base[:, None, None] + within


def injected_kv(
    ctx_kv: torch.Tensor, k_norm_weight: torch.Tensor, eps: float, positions: torch.Tensor, rope: RopeConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 K and V `[tokens, layers, kv_heads, head_dim]`: K = RoPE(rmsnorm(k_raw) * w), V = v_raw.

    Everything is computed in float32 and rounded once when stored, which is what the kernel does.
    """
    if ctx_kv.dim() != 5 or ctx_kv.shape[2] != 2:
        raise DFlashTrtError(f"ctx_kv must be [tokens, layers, 2, kv_heads, head_dim], got {tuple(ctx_kv.shape)}.")
    x = ctx_kv.float()
    k, v = x[:, :, 0], x[:, :, 1]
    inv_rms = torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
    k = k * inv_rms * k_norm_weight.float()[None, :, None, :]
    cos, sin = rope_cos_sin(positions, rope)
    k = apply_rope(k, cos[:, None, None, :], sin[:, None, None, :])
    return k, v


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype, kv_scale_orig_quant: float | None) -> torch.Tensor:
    """Round float32 values for the cache; FP8 multiplies by the orig->quant scale and saturates at +-448."""
    if cache_dtype == torch.float8_e4m3fn:
        if kv_scale_orig_quant is None:
            raise DFlashTrtError("an FP8 KV cache needs kv_scale_orig_quant (1 / kv_cache_scaling_factor).")
        scaled = x * torch.tensor(kv_scale_orig_quant, dtype=torch.float32)
        return scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    if cache_dtype not in CACHE_DTYPES:
        raise DFlashTrtError(f"unsupported KV cache dtype {cache_dtype}.")
    return x.to(cache_dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_SAME_WIDTH_INT[t.element_size()])


def kv_injection(
    ctx_kv: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    seq_slots: torch.Tensor,
    valid: torch.Tensor,
    rope: RopeConfig,
    layout: PagedKVCacheLayout,
    block_offsets: torch.Tensor,
    primary_pool: torch.Tensor,
    secondary_pool: torch.Tensor | None = None,
    kv_scale_orig_quant: float | None = None,
    cache_positions: torch.Tensor | None = None,
) -> int:
    """Write the injected K/V of every valid token into all draft layers' pages; returns the tokens written.

    K is rotated at `positions` and stored at `cache_positions` (by default the same): the slot differs from the
    position only where a draft tree's node waits for the runtime's rewind to move it (docs/engine.md §6.1).
    `block_offsets` is one pool's `[seqs, 2, max_blocks_per_seq]` slice; pools are contiguous tensors of the cache
    dtype (any shape, e.g. `[blocks, layers_in_pool, 2, kv_heads, tokens_per_block, head_dim]`).
    """
    tokens, layers, _, heads, head_dim = ctx_kv.shape
    if (heads, head_dim) != (layout.num_kv_heads, layout.head_dim):
        raise DFlashTrtError(f"ctx_kv heads {heads}x{head_dim} differ from the cache layout.")
    if k_norm_weight.shape != (layers, head_dim):
        raise DFlashTrtError(f"k_norm_weight must be [{layers}, {head_dim}], got {tuple(k_norm_weight.shape)}.")
    keep = valid.reshape(-1).bool()
    slots_at = positions if cache_positions is None else cache_positions
    if any(t.numel() != tokens for t in (keep, positions, slots_at, seq_slots)):
        raise DFlashTrtError("positions, cache_positions, seq_slots and valid need one entry per ctx_kv token.")
    if not primary_pool.is_contiguous():
        raise DFlashTrtError("the KV pool must be contiguous.")
    positions, seq_slots, slots_at = (
        positions.reshape(-1)[keep],
        seq_slots.reshape(-1)[keep],
        slots_at.reshape(-1)[keep],
    )
    k, v = injected_kv(ctx_kv[keep], k_norm_weight, eps, positions, rope)
    pools = [_bits(primary_pool).view(-1)]
    if secondary_pool is not None:
        if secondary_pool.dtype != primary_pool.dtype or not secondary_pool.is_contiguous():
            raise DFlashTrtError("the secondary KV pool must be contiguous and match the primary dtype.")
        pools.append(_bits(secondary_pool).view(-1))
    for layer in range(layers):
        for kv, values in ((0, k), (1, v)):
            stored = _bits(to_cache_dtype(values[:, layer], primary_pool.dtype, kv_scale_orig_quant))
            secondary, offsets = layout.element_offsets(block_offsets, seq_slots, slots_at, layer, kv)
            if secondary_pool is None and bool(secondary.any()):
                raise DFlashTrtError("a block index points at the secondary pool, which was not given.")
            for pool, rows in zip(pools, (~secondary, secondary), strict=False):
                pool[offsets[rows].reshape(-1)] = stored[rows].reshape(-1)
    return int(keep.sum())


@dataclass
class ContiguousKVCache:
    """One page per sequence: a plain `[batch, layers, 2, kv_heads, max_len, head_dim]` cache written by the same
    paged rule (the golden model's drafter context cache)."""

    layout: PagedKVCacheLayout
    block_offsets: torch.Tensor
    pool: torch.Tensor

    def keys(self, layer: int) -> torch.Tensor:
        """`[batch, kv_heads, max_len, head_dim]` view of one draft layer's K."""
        return self.pool[:, layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.pool[:, layer, 1]


def contiguous_kv_cache(
    batch: int, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int, dtype: torch.dtype
) -> ContiguousKVCache:
    """A zeroed single-page-per-sequence cache; `max_len` is `max_seq_len` rounded up to a power of two."""
    if dtype not in CACHE_DTYPES:
        raise DFlashTrtError(f"unsupported KV cache dtype {dtype}.")
    tokens_per_block = 1 << max(0, (max_seq_len - 1).bit_length())
    layout = PagedKVCacheLayout(num_kv_heads, head_dim, tokens_per_block, max_blocks_per_seq=1)
    seqs = torch.arange(batch, dtype=torch.int32)
    block_offsets = torch.stack([seqs * num_layers * 2, seqs * num_layers * 2 + 1], dim=1)[:, :, None]
    pool = torch.zeros(batch, num_layers, 2, num_kv_heads, tokens_per_block, head_dim, dtype=dtype)
    return ContiguousKVCache(layout, block_offsets.contiguous(), pool)
