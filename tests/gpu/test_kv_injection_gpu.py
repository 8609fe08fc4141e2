"""The CUDA KV-injection kernel on a real GPU, built as a torch extension, against the torch definition."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_trt.reference.kv_injection import SECONDARY_POOL_FLAG, PagedKVCacheLayout, kv_injection
from dflash_trt.reference.rope import RopeConfig, inv_freq_and_scale

pytestmark = pytest.mark.gpu

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"

ROPES = {
    "default": lambda d: RopeConfig(head_dim=d, theta=1_000_000.0),
    "llama3": lambda d: RopeConfig(d, 500_000.0, "llama3", factor=8.0, original_max_position_embeddings=8192),
    "yarn": lambda d: RopeConfig(d, 1_000_000.0, "yarn", factor=4.0, original_max_position_embeddings=32768),
}

CASES = [
    # input dtype, cache dtype, rope, kv heads, head dim, draft layers, tokens, tokens per block
    (torch.bfloat16, torch.bfloat16, "default", 8, 128, 5, 515, 32),
    (torch.bfloat16, torch.float8_e4m3fn, "default", 8, 128, 3, 257, 64),
    (torch.float16, torch.float16, "llama3", 2, 64, 2, 77, 16),
    (torch.float16, torch.float8_e4m3fn, "llama3", 1, 256, 2, 5, 128),
    (torch.bfloat16, torch.bfloat16, "yarn", 3, 128, 1, 13, 8),
    (torch.bfloat16, torch.float16, "default", 2, 32, 8, 3, 4),
]


@pytest.fixture(scope="module")
def ext():
    from torch.utils.cpp_extension import load

    return load(
        name="dflash_kv_injection_ext",
        sources=[str(PLUGINS / "tests" / "kvInjectionTorchBinding.cpp"), str(PLUGINS / "src" / "kvInjectionKernel.cu")],
        extra_include_paths=[str(PLUGINS / "include")],
        extra_cflags=["-O2", "-std=c++17"],
        extra_cuda_cflags=["-O3", "-std=c++17"],
    )


def _problem(gen, heads, head_dim, layers, tokens, tpb, cache_dtype, secondary: bool):
    """Distinct (sequence, position) destinations (far out for small cases); a sparse block table, one pool."""
    seqs, layers_in_pool, first_layer = 4, layers + 1, 1
    span = 70_000 if tokens <= 100 else 1024
    max_blocks = (span + tpb - 1) // tpb
    flat = torch.randperm(seqs * max_blocks * tpb, generator=gen)[:tokens]
    seq_slots = (flat // (max_blocks * tpb)).to(torch.int32)
    positions = (flat % (max_blocks * tpb)).to(torch.int32)
    used = sorted({(int(s), int(p) // tpb) for s, p in zip(seq_slots, positions, strict=True)})
    physical = torch.randperm(len(used) + 5, generator=gen)[: len(used)] + 1
    table = torch.zeros(seqs, max_blocks, dtype=torch.int64)
    for (s, page), block in zip(used, physical, strict=True):
        table[s, page] = block
    raw = table * layers_in_pool * 2
    offsets = torch.stack([raw, raw + 1], dim=1)
    if secondary:
        offsets[seqs - 1] |= SECONDARY_POOL_FLAG
    offsets = torch.where(offsets >= 2**31, offsets - 2**32, offsets).to(torch.int32).contiguous()
    layout = PagedKVCacheLayout(heads, head_dim, tpb, max_blocks, layer_idx_in_pool=first_layer)
    pool = torch.randn(len(used) + 6, layers_in_pool, 2, heads, tpb, head_dim, generator=gen).to(cache_dtype)
    return layout, offsets, seq_slots, positions, pool


def _assert_pools_match(got: torch.Tensor, want: torch.Tensor, cache_dtype: torch.dtype) -> None:
    bits = torch.uint8 if cache_dtype == torch.float8_e4m3fn else torch.int16
    exact = (got.view(bits) == want.view(bits)).float().mean().item()
    assert exact > 0.99, f"only {exact:.4f} of the cache matches bit for bit"
    rtol = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float8_e4m3fn: 2**-3}[cache_dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("secondary", [False, True])
@pytest.mark.parametrize(
    ("in_dtype", "cache_dtype", "rope_name", "heads", "head_dim", "layers", "tokens", "tpb"), CASES
)
def test_kernel_matches_reference(
    ext, in_dtype, cache_dtype, rope_name, heads, head_dim, layers, tokens, tpb, secondary
) -> None:
    gen = torch.Generator().manual_seed(tokens * 31 + layers * 7 + head_dim + int(secondary))
    rope = ROPES[rope_name](head_dim)
    layout, offsets, seq_slots, positions, pool = _problem(
        gen, heads, head_dim, layers, tokens, tpb, cache_dtype, secondary
    )
    ctx_kv = (3 * torch.randn(tokens, layers, 2, heads, head_dim, generator=gen)).to(in_dtype)
    weight = (1 + 0.2 * torch.randn(layers, head_dim, generator=gen)).to(in_dtype)
    valid = (torch.rand(tokens, generator=gen) > 0.25).to(torch.int32)
    scale = 1.7 if cache_dtype == torch.float8_e4m3fn else None
    want_primary = pool.clone()
    want_secondary = pool.clone() if secondary else None
    kv_injection(
        ctx_kv,
        weight,
        1e-6,
        positions,
        seq_slots,
        valid,
        rope,
        layout,
        offsets,
        want_primary,
        want_secondary,
        kv_scale_orig_quant=scale,
    )

    cuda = torch.device("cuda")
    got_primary = pool.clone().to(cuda)
    got_secondary = pool.clone().to(cuda) if secondary else None
    inv_freq, attention_scaling = inv_freq_and_scale(rope)
    ext.inject(
        ctx_kv.to(cuda),
        weight.to(cuda),
        positions.to(cuda),
        seq_slots.to(cuda),
        valid.to(cuda),
        offsets.to(cuda),
        tpb,
        layout.layer_idx_in_pool,
        got_primary,
        got_secondary,
        torch.tensor([scale], device=cuda) if scale is not None else None,
        1e-6,
        inv_freq.contiguous(),
        attention_scaling,
    )
    torch.cuda.synchronize()
    _assert_pools_match(got_primary.cpu(), want_primary, cache_dtype)
    if secondary:
        _assert_pools_match(got_secondary.cpu(), want_secondary, cache_dtype)
