"""The torch definition of KV injection against transformers / dflash and against the paged layout's own indexing."""

from __future__ import annotations

import pytest
import torch
from dflash.model import Qwen3DFlashAttention
from transformers import DynamicCache, LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.kv_injection import (
    SECONDARY_POOL_FLAG,
    PagedKVCacheLayout,
    contiguous_kv_cache,
    injected_kv,
    kv_injection,
    to_cache_dtype,
)
from dflash_trt.rope import RopeConfig

ROPES = {
    "default": (
        RopeConfig(head_dim=64, theta=1_000_000.0),
        {"rope_type": "default", "rope_theta": 1_000_000.0},
    ),
    "llama3": (
        RopeConfig(
            head_dim=64,
            theta=500_000.0,
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        {
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "yarn": (
        RopeConfig(
            head_dim=64, theta=1_000_000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=32768
        ),
        {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
}


def _hf_rotary(rope_parameters: dict, head_dim: int) -> torch.nn.Module:
    cfg = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters=rope_parameters,
    )
    return LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("rope_name", sorted(ROPES))
def test_injected_kv_matches_transformers_knorm_and_rope(rope_name: str) -> None:
    rope, rope_parameters = ROPES[rope_name]
    gen = torch.Generator().manual_seed(1)
    tokens, layers, heads, head_dim = 7, 3, 2, rope.head_dim
    ctx_kv = torch.randn(tokens, layers, 2, heads, head_dim, generator=gen)
    weight = 1 + 0.1 * torch.randn(layers, head_dim, generator=gen)
    positions = torch.tensor([0, 1, 5, 17, 4095, 9000, 120_000])
    k, v = injected_kv(ctx_kv, weight, 1e-6, positions, rope)

    rotary = _hf_rotary(rope_parameters, head_dim)
    cos, sin = rotary(ctx_kv, positions[None])
    for layer in range(layers):
        norm = Qwen3RMSNorm(head_dim, eps=1e-6)
        norm.weight.data.copy_(weight[layer])
        k_hf = norm(ctx_kv[:, layer, 0]).transpose(0, 1)[None]  # [1, heads, tokens, head_dim]
        _, k_hf = apply_rotary_pos_emb(k_hf, k_hf, cos, sin)
        torch.testing.assert_close(k[:, layer], k_hf[0].transpose(0, 1), rtol=2e-5, atol=2e-5)
    assert torch.equal(v, ctx_kv[:, :, 1])


def test_injected_kv_matches_dflash_context_keys() -> None:
    """dflash's own drafter attention puts RoPE(k_norm(k_proj(ctx))) / v_proj(ctx) in its cache."""
    torch.manual_seed(2)
    cfg = Qwen3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        num_hidden_layers=1,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    attn = Qwen3DFlashAttention(cfg, layer_idx=0).eval()
    ctx_len, block = 6, 4
    target_hidden = torch.randn(1, ctx_len, 64)
    block_hidden = torch.randn(1, block, 64)
    position_ids = torch.arange(ctx_len + block)[None]
    position_embeddings = Qwen3RotaryEmbedding(cfg)(target_hidden, position_ids)
    cache = DynamicCache()
    with torch.no_grad():
        attn(block_hidden, target_hidden, position_embeddings, None, past_key_values=cache)
        ctx_kv = torch.stack(
            [attn.k_proj(target_hidden[0]).view(ctx_len, 2, 32), attn.v_proj(target_hidden[0]).view(ctx_len, 2, 32)],
            dim=1,
        )[:, None]
        k, v = injected_kv(ctx_kv, attn.k_norm.weight[None], 1e-6, torch.arange(ctx_len), RopeConfig(32, 10000.0))
    cached_k, cached_v = cache.layers[0].keys[0], cache.layers[0].values[0]  # [kv_heads, ctx+block, head_dim]
    torch.testing.assert_close(k[:, 0].transpose(0, 1), cached_k[:, :ctx_len], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v[:, 0].transpose(0, 1), cached_v[:, :ctx_len], rtol=1e-6, atol=1e-6)


def _paged_setup(seed: int, *, heads: int = 2, head_dim: int = 16, tpb: int = 4, draft_layers: int = 2):
    """A pool shared with 3 target layers; each sequence owns a shuffled list of physical blocks."""
    gen = torch.Generator().manual_seed(seed)
    layers_in_pool, num_blocks, seqs, max_blocks, tokens = 3 + draft_layers, 12, 3, 3, 9
    layout = PagedKVCacheLayout(heads, head_dim, tpb, max_blocks, layer_idx_in_pool=3)
    physical = torch.randperm(num_blocks, generator=gen)[: seqs * max_blocks].view(seqs, max_blocks)
    raw = physical * layers_in_pool * 2
    block_offsets = torch.stack([raw, raw + 1], dim=1).to(torch.int32)  # [seqs, 2, max_blocks]
    slots = torch.randperm(seqs * max_blocks * tpb, generator=gen)[:tokens]  # distinct (sequence, position) pairs
    seq_slots = (slots // (max_blocks * tpb)).to(torch.int32)
    positions = (slots % (max_blocks * tpb)).to(torch.int32)
    ctx_kv = torch.randn(tokens, draft_layers, 2, heads, head_dim, generator=gen)
    weight = 1 + 0.1 * torch.randn(draft_layers, head_dim, generator=gen)
    pool_shape = (num_blocks, layers_in_pool, 2, heads, tpb, head_dim)
    return layout, physical, block_offsets, seq_slots, positions, ctx_kv, weight, pool_shape


def _expected_pool(pool, layout, physical, seq_slots, positions, valid, k, v, cache_dtype, scale, select=None):
    """Expected pool contents by structured indexing [block, layer, k|v, head, row] instead of flat offsets."""
    expected = pool.clone().float()
    tpb = layout.tokens_per_block
    for t in range(len(positions)):
        if not valid[t] or (select is not None and not select[t]):
            continue
        block = physical[seq_slots[t], positions[t] // tpb]
        row = positions[t] % tpb
        for layer in range(k.shape[1]):
            for kv, values in ((0, k), (1, v)):
                cell = to_cache_dtype(values[t, layer], cache_dtype, scale).float()
                expected[block, layout.layer_idx_in_pool + layer, kv, :, row] = cell
    return expected


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_paged_write_lands_in_the_sequence_blocks(cache_dtype: torch.dtype) -> None:
    layout, physical, offsets, seq_slots, positions, ctx_kv, weight, shape = _paged_setup(3)
    rope = RopeConfig(layout.head_dim, 10000.0)
    valid = torch.ones(len(positions), dtype=torch.int32)
    valid[4] = 0
    pool = torch.full(shape, -3.0).to(cache_dtype)
    before = pool.clone()
    scale = 0.7 if cache_dtype == torch.float8_e4m3fn else None
    written = kv_injection(
        ctx_kv, weight, 1e-6, positions, seq_slots, valid, rope, layout, offsets, pool, kv_scale_orig_quant=scale
    )
    assert written == len(positions) - 1
    k, v = injected_kv(ctx_kv, weight, 1e-6, positions, rope)
    expected = _expected_pool(before, layout, physical, seq_slots, positions, valid, k, v, cache_dtype, scale)
    assert torch.equal(pool.float(), expected)


def test_cache_positions_place_keys_rotated_at_their_positions() -> None:
    """A draft tree's node is rotated at its position (anchor + depth) but stored at the slot the runtime's rewind
    moves it from (anchor + node index)."""
    gen = torch.Generator().manual_seed(9)
    cache = contiguous_kv_cache(batch=2, num_layers=2, num_kv_heads=2, head_dim=8, max_seq_len=20, dtype=torch.float16)
    seq_slots = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    positions = torch.tensor([3, 4, 7, 8], dtype=torch.int32)
    slots = torch.tensor([3, 9, 7, 12], dtype=torch.int32)
    ctx_kv = torch.randn(4, 2, 2, 2, 8, generator=gen)
    weight = torch.rand(2, 8, generator=gen) + 0.5
    rope = RopeConfig(8, 10000.0)
    layout, offsets = cache.layout, cache.block_offsets
    kv_injection(ctx_kv, weight, 1e-6, positions, seq_slots, torch.ones(4), rope, layout, offsets, cache.pool, None,
                 None, slots)  # fmt: skip
    k, v = injected_kv(ctx_kv, weight, 1e-6, positions, rope)
    for t in range(4):
        for layer in range(2):
            assert torch.equal(cache.keys(layer)[seq_slots[t], :, slots[t]], k[t, layer].half())
            assert torch.equal(cache.values(layer)[seq_slots[t], :, slots[t]], v[t, layer].half())
    assert not cache.keys(0)[0, :, 4].any()  # nothing at the moved node's position until the rewind moves it
    rotated_elsewhere, _ = injected_kv(ctx_kv, weight, 1e-6, slots, rope)
    assert not torch.equal(rotated_elsewhere[1], k[1])


def test_secondary_pool_flag_routes_the_write() -> None:
    layout, physical, offsets, seq_slots, positions, ctx_kv, weight, shape = _paged_setup(4)
    rope = RopeConfig(layout.head_dim, 10000.0)
    offloaded = seq_slots == seq_slots[0]
    offsets[int(seq_slots[0])] |= torch.tensor(SECONDARY_POOL_FLAG - (1 << 32), dtype=torch.int32)
    valid = torch.ones(len(positions), dtype=torch.int32)
    primary, secondary = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(DFlashTrtError, match="secondary"):
        kv_injection(ctx_kv, weight, 1e-6, positions, seq_slots, valid, rope, layout, offsets, primary.clone())
    kv_injection(ctx_kv, weight, 1e-6, positions, seq_slots, valid, rope, layout, offsets, primary, secondary)
    k, v = injected_kv(ctx_kv, weight, 1e-6, positions, rope)
    zeros = torch.zeros(shape, dtype=torch.bfloat16)
    args = (layout, physical, seq_slots, positions, valid, k, v, torch.bfloat16, None)
    assert offloaded.any() and not offloaded.all()
    assert torch.equal(primary.float(), _expected_pool(zeros, *args, select=~offloaded))
    assert torch.equal(secondary.float(), _expected_pool(zeros, *args, select=offloaded))


def test_fp8_saturates_and_rounds_like_torch() -> None:
    x = torch.tensor([0.0, 1.0, -1.0, 0.3, 500.0, -1e6, 447.9, 449.0, 1e-9])
    q = to_cache_dtype(x, torch.float8_e4m3fn, 2.0)
    assert q.float().tolist()[:4] == [0.0, 2.0, -2.0, torch.tensor(0.6).to(torch.float8_e4m3fn).float().item()]
    assert q.float()[4].item() == 448.0 and q.float()[5].item() == -448.0
    assert not torch.isnan(q.float()).any()
    with pytest.raises(DFlashTrtError, match="kv_scale_orig_quant"):
        to_cache_dtype(x, torch.float8_e4m3fn, None)


def test_contiguous_cache_is_addressed_by_the_paged_rule() -> None:
    gen = torch.Generator().manual_seed(5)
    cache = contiguous_kv_cache(batch=3, num_layers=2, num_kv_heads=2, head_dim=8, max_seq_len=11, dtype=torch.float16)
    assert cache.layout.tokens_per_block == 16 and cache.pool.shape == (3, 2, 2, 2, 16, 8)
    seq_slots = torch.tensor([0, 2, 2, 1, 0], dtype=torch.int32)
    positions = torch.tensor([0, 3, 10, 7, 5], dtype=torch.int32)
    ctx_kv = torch.randn(5, 2, 2, 2, 8, generator=gen)
    weight = torch.ones(2, 8)
    rope = RopeConfig(8, 10000.0)
    kv_injection(
        ctx_kv, weight, 1e-6, positions, seq_slots, torch.ones(5), rope, cache.layout, cache.block_offsets, cache.pool
    )
    k, v = injected_kv(ctx_kv, weight, 1e-6, positions, rope)
    for t in range(5):
        for layer in range(2):
            assert torch.equal(cache.keys(layer)[seq_slots[t], :, positions[t]], k[t, layer].half())
            assert torch.equal(cache.values(layer)[seq_slots[t], :, positions[t]], v[t, layer].half())
    assert int((cache.pool != 0).any(-1).sum()) == 5 * 2 * 2 * 2


def test_bad_inputs_raise_clear_errors() -> None:
    cache = contiguous_kv_cache(1, 1, 1, 8, 4, torch.bfloat16)
    rope = RopeConfig(8, 10000.0)
    ctx_kv = torch.randn(1, 1, 2, 1, 8)
    args = (ctx_kv, torch.ones(1, 8), 1e-6)
    with pytest.raises(DFlashTrtError, match="outside the pages"):
        kv_injection(
            *args,
            torch.tensor([4]),
            torch.tensor([0]),
            torch.tensor([1]),
            rope,
            cache.layout,
            cache.block_offsets,
            cache.pool,
        )
    with pytest.raises(DFlashTrtError, match="k_norm_weight"):
        kv_injection(
            ctx_kv,
            torch.ones(2, 8),
            1e-6,
            torch.tensor([0]),
            torch.tensor([0]),
            torch.tensor([1]),
            rope,
            cache.layout,
            cache.block_offsets,
            cache.pool,
        )
    with pytest.raises(DFlashTrtError, match="power of two"):
        PagedKVCacheLayout(1, 8, tokens_per_block=12, max_blocks_per_seq=1)
