"""The CUDA KV-injection kernel on a real GPU, built as a torch extension, against the torch definition."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _kv_problems import ROPES, assert_pools_match, paged_problem

from dflash_trt.reference.kv_injection import kv_injection
from dflash_trt.rope import inv_freq_and_scale

pytestmark = pytest.mark.gpu

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"

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
    seqs = 4
    span = 70_000 if tokens <= 100 else 1024
    max_blocks = (span + tpb - 1) // tpb
    flat = torch.randperm(seqs * max_blocks * tpb, generator=gen)[:tokens]
    seq_slots = (flat // (max_blocks * tpb)).to(torch.int32)
    positions = (flat % (max_blocks * tpb)).to(torch.int32)
    layout, offsets, pool = paged_problem(
        gen,
        seq_slots,
        positions,
        seqs,
        max_blocks,
        heads,
        head_dim,
        layers,
        tpb,
        cache_dtype,
        secondary,
        first_layer=1,
        spare_blocks=5,
    )
    return layout, offsets, seq_slots, positions, pool


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
    # Rotated at positions apart from the slots they are written at (a draft tree's moved nodes), for some tokens.
    rope_positions = (positions - torch.randint(0, 4, (tokens,), generator=gen, dtype=torch.int32)).clamp(min=0)
    scale = 1.7 if cache_dtype == torch.float8_e4m3fn else None
    want_primary = pool.clone()
    want_secondary = pool.clone() if secondary else None
    kv_injection(
        ctx_kv,
        weight,
        1e-6,
        rope_positions,
        seq_slots,
        valid,
        rope,
        layout,
        offsets,
        want_primary,
        want_secondary,
        kv_scale_orig_quant=scale,
        cache_positions=positions,
    )

    cuda = torch.device("cuda")
    got_primary = pool.clone().to(cuda)
    got_secondary = pool.clone().to(cuda) if secondary else None
    inv_freq, attention_scaling = inv_freq_and_scale(rope)
    ext.inject(
        ctx_kv.to(cuda),
        weight.to(cuda),
        rope_positions.to(cuda),
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
    assert_pools_match(got_primary.cpu(), want_primary, cache_dtype)
    if secondary:
        assert_pools_match(got_secondary.cpu(), want_secondary, cache_dtype)
