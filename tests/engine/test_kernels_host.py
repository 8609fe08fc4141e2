"""The CUDA kernel's __host__ __device__ math, compiled for the CPU, against the torch definition of KV injection."""

from __future__ import annotations

import ctypes
import zlib

import pytest
import torch
from _host_drivers import CACHE_TYPES, F32, I32, I64, INPUT_TYPES, P, compile_host_driver, pointer
from _kv_problems import ROPES, assert_pools_match, paged_problem
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.reference.kv_injection import (
    SECONDARY_POOL_FLAG,
    PagedKVCacheLayout,
    kv_injection,
    to_cache_dtype,
)
from dflash_trt.rope import inv_freq_and_scale


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    handle = compile_host_driver(tmp_path_factory.mktemp("host"), "kvInjectionHostDriver")
    handle.dflashKvInjectionHost.restype = I32
    handle.dflashKvInjectionHost.argtypes = [
        P,
        P,
        I32,
        P,
        P,
        P,
        P,
        I32,
        I32,
        I32,
        I32,
        P,
        I32,
        I32,
        I32,
        I32,
        P,
        P,
        I32,
        F32,
        F32,
        P,
        F32,
    ]
    handle.dflashLocateCacheElement.restype = I64
    handle.dflashLocateCacheElement.argtypes = [
        P,
        I32,
        I32,
        I32,
        I32,
        I32,
        I32,
        I32,
        I32,
        I32,
        I32,
        I32,
        I32,
        ctypes.POINTER(I32),
    ]
    handle.dflashToFp8.restype = ctypes.c_uint8
    handle.dflashToFp8.argtypes = [F32, F32]
    handle.dflashLanesPerHead.restype = I32
    handle.dflashLanesPerHead.argtypes = [I32]
    return handle


CASES = [
    # input dtype, cache dtype, rope, kv heads, head dim, draft layers, tokens, tokens per block
    (torch.bfloat16, torch.bfloat16, "default", 8, 128, 1, 7, 32),
    (torch.bfloat16, torch.float8_e4m3fn, "default", 4, 128, 3, 13, 64),
    (torch.float16, torch.float16, "llama3", 2, 64, 2, 9, 16),
    (torch.float16, torch.float8_e4m3fn, "llama3", 1, 256, 2, 5, 128),
    (torch.bfloat16, torch.bfloat16, "yarn", 3, 128, 5, 11, 8),
    (torch.bfloat16, torch.float16, "default", 2, 32, 1, 3, 4),
]


def _paged_problem(gen, heads, head_dim, layers, tokens, tpb, cache_dtype, secondary: bool):
    """Random sequences/positions (some large), distinct destinations, sparse block table over a shared pool."""
    seqs = 3
    max_blocks = (130_000 + tpb - 1) // tpb
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < tokens:
        limit = 130_000 if len(pairs) % 4 == 0 else 600
        pairs[(int(torch.randint(0, seqs, (1,), generator=gen)), int(torch.randint(0, limit, (1,), generator=gen)))] = (
            None
        )
    seq_slots = torch.tensor([s for s, _ in pairs], dtype=torch.int32)
    positions = torch.tensor([p for _, p in pairs], dtype=torch.int32)
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
        first_layer=2,
        spare_blocks=3,
    )
    return layout, offsets, seq_slots, positions, pool


@pytest.mark.parametrize("secondary", [False, True])
@pytest.mark.parametrize(
    ("in_dtype", "cache_dtype", "rope_name", "heads", "head_dim", "layers", "tokens", "tpb"), CASES
)
def test_host_injection_matches_reference(
    lib, in_dtype, cache_dtype, rope_name, heads, head_dim, layers, tokens, tpb, secondary
) -> None:
    case = repr((rope_name, heads, head_dim, layers, tokens, secondary)).encode()
    gen = torch.Generator().manual_seed(zlib.crc32(case))  # the same problem every run (str hashes are salted)
    rope = ROPES[rope_name](head_dim)
    layout, offsets, seq_slots, positions, pool = _paged_problem(
        gen, heads, head_dim, layers, tokens, tpb, cache_dtype, secondary
    )
    ctx_kv = (3 * torch.randn(tokens, layers, 2, heads, head_dim, generator=gen)).to(in_dtype)
    weight = (1 + 0.2 * torch.randn(layers, head_dim, generator=gen)).to(in_dtype)
    valid = (torch.rand(tokens, generator=gen) > 0.25).to(torch.int32)
    # Rotated at positions apart from the slots they are written at (a draft tree's moved nodes), for some tokens.
    rope_positions = (positions - torch.randint(0, 4, (tokens,), generator=gen, dtype=torch.int32)).clamp(min=0)
    scale = 1.7 if cache_dtype == torch.float8_e4m3fn else None
    secondary_pool = pool.clone() if secondary else None
    want_primary = pool.clone()
    want_secondary = secondary_pool.clone() if secondary else None
    written = kv_injection(
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

    inv_freq, attention_scaling = inv_freq_and_scale(rope)
    inv_freq = inv_freq.contiguous()
    got = lib.dflashKvInjectionHost(
        pointer(ctx_kv),
        pointer(weight),
        INPUT_TYPES[in_dtype],
        pointer(rope_positions),
        pointer(positions),
        pointer(seq_slots),
        pointer(valid),
        tokens,
        layers,
        heads,
        head_dim,
        pointer(offsets),
        offsets.shape[0],
        layout.max_blocks_per_seq,
        tpb,
        layout.layer_idx_in_pool,
        pointer(pool),
        pointer(secondary_pool),
        CACHE_TYPES[cache_dtype],
        scale or 1.0,
        1e-6,
        pointer(inv_freq),
        attention_scaling,
    )
    assert got == written == int(valid.sum())
    assert_pools_match(pool, want_primary, cache_dtype)
    if secondary:
        assert_pools_match(secondary_pool, want_secondary, cache_dtype)


@settings(max_examples=40, deadline=None)
@given(
    heads=st.integers(1, 8),
    head_dim=st.sampled_from([32, 64, 128, 256]),
    tpb_log2=st.integers(0, 7),
    max_blocks=st.integers(1, 6),
    first_layer=st.integers(0, 40),
    layer=st.integers(0, 7),
    kv=st.integers(0, 1),
    data=st.data(),
)
def test_address_math_matches_layout(lib, heads, head_dim, tpb_log2, max_blocks, first_layer, layer, kv, data) -> None:
    tpb = 1 << tpb_log2
    seqs = 3
    offsets = torch.tensor(
        data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=seqs * 2 * max_blocks, max_size=seqs * 2 * max_blocks)),
        dtype=torch.int64,
    )
    offsets = torch.where(offsets % 5 == 0, offsets | SECONDARY_POOL_FLAG, offsets)
    offsets = torch.where(offsets >= 2**31, offsets - 2**32, offsets).to(torch.int32).view(seqs, 2, max_blocks)
    seq = data.draw(st.integers(0, seqs - 1))
    position = data.draw(st.integers(0, tpb * max_blocks + 3))
    head = data.draw(st.integers(0, heads - 1))
    channel = data.draw(st.integers(0, head_dim - 1))
    layout = PagedKVCacheLayout(heads, head_dim, tpb, max_blocks, layer_idx_in_pool=first_layer)
    secondary = I32(-1)
    got = lib.dflashLocateCacheElement(
        pointer(offsets),
        seqs,
        max_blocks,
        tpb,
        heads,
        head_dim,
        first_layer,
        seq,
        position,
        layer,
        kv,
        head,
        channel,
        ctypes.byref(secondary),
    )
    if position >= tpb * max_blocks:
        assert got == -1
        return
    want_secondary, want = layout.element_offsets(offsets, torch.tensor([seq]), torch.tensor([position]), layer, kv)
    assert got == int(want[0, head, channel])
    assert secondary.value == int(want_secondary[0])


def test_fp8_conversion_matches_torch_on_every_code_and_tie(lib) -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[~codes.isnan()].unique().sort().values
    ties = (finite[1:] + finite[:-1]) / 2
    values = torch.cat([finite, ties, ties.nextafter(torch.tensor(1e9)), torch.tensor([500.0, -1e6, 3e38])])
    for scale in (1.0, 0.37, 2.5):
        got = torch.tensor([lib.dflashToFp8(float(v), scale) for v in values], dtype=torch.uint8)
        want = to_cache_dtype(values, torch.float8_e4m3fn, scale).view(torch.uint8)
        assert torch.equal(got, want), values[got != want][:8]


def test_unsupported_head_dims_are_refused(lib) -> None:
    assert [lib.dflashLanesPerHead(d) for d in (32, 64, 128, 256)] == [2, 4, 8, 16]
    assert [lib.dflashLanesPerHead(d) for d in (0, 8, 48, 80, 96, 512)] == [0, 0, 0, 0, 0, 0]
    dummy = torch.zeros(1, dtype=torch.int32)
    args = (None, None, 1, None, None, None, None, 1, 1, 1, 80, pointer(dummy), 1, 1, 16, 0, None, None, 1, 1.0, 1e-6)
    args = (*args, None, 1.0)
    assert lib.dflashKvInjectionHost(*args) == -1
