"""KV-injection test problems shared by the host-compiled kernel test and the GPU kernel test.

Both compare a kernel's paged writes with `dflash_trt.reference.kv_injection` on the same kind of problem: tokens
scattered over a sparse block table of one shared pool (optionally some blocks in the secondary pool), with the
RoPE variants of the supported target families.
"""

from __future__ import annotations

import torch

from dflash_trt.reference.kv_injection import SECONDARY_POOL_FLAG, PagedKVCacheLayout
from dflash_trt.rope import RopeConfig

ROPES = {
    "default": lambda d: RopeConfig(head_dim=d, theta=1_000_000.0),
    "llama3": lambda d: RopeConfig(d, 500_000.0, "llama3", factor=8.0, original_max_position_embeddings=8192),
    "yarn": lambda d: RopeConfig(d, 1_000_000.0, "yarn", factor=4.0, original_max_position_embeddings=32768),
}


def paged_problem(
    gen: torch.Generator,
    seq_slots: torch.Tensor,
    positions: torch.Tensor,
    seqs: int,
    max_blocks: int,
    heads: int,
    head_dim: int,
    layers: int,
    tpb: int,
    cache_dtype: torch.dtype,
    secondary: bool,
    first_layer: int,
    spare_blocks: int,
):
    """Block table (int32, as the attention plugin gets it), layout and a random pool for the given destinations."""
    layers_in_pool = layers + first_layer
    used = sorted({(int(s), int(p) // tpb) for s, p in zip(seq_slots, positions, strict=True)})
    physical = torch.randperm(len(used) + spare_blocks, generator=gen)[: len(used)] + 1
    table = torch.zeros(seqs, max_blocks, dtype=torch.int64)
    for (s, page), block in zip(used, physical, strict=True):
        table[s, page] = block
    raw = table * layers_in_pool * 2
    offsets = torch.stack([raw, raw + 1], dim=1)
    if secondary:
        offsets[seqs - 1] |= SECONDARY_POOL_FLAG
    offsets = (offsets & 0xFFFFFFFF).to(torch.int64)
    offsets = torch.where(offsets >= 2**31, offsets - 2**32, offsets).to(torch.int32).contiguous()
    layout = PagedKVCacheLayout(heads, head_dim, tpb, max_blocks, layer_idx_in_pool=first_layer)
    pool = torch.randn(len(used) + spare_blocks + 1, layers_in_pool, 2, heads, tpb, head_dim, generator=gen)
    return layout, offsets, pool.to(cache_dtype)


def assert_pools_match(got: torch.Tensor, want: torch.Tensor, cache_dtype: torch.dtype) -> None:
    """Both round float32 once; float32 results may differ in the last bits, so allow one step of the cache type."""
    bits = torch.uint8 if cache_dtype == torch.float8_e4m3fn else torch.int16
    exact = (got.view(bits) == want.view(bits)).float().mean().item()
    assert exact > 0.99, f"only {exact:.4f} of the cache matches bit for bit"
    rtol = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float8_e4m3fn: 2**-3}[cache_dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-6)
