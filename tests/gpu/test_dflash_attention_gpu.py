"""The DFlashAttention kernels on a real GPU, built as a torch extension, against the dense float32 reference.

The same problems and reference as the host test (tests/_attention_problems.py): each block mask x window x KV
dtype, GQA groups and head dims spread over the cases, every pool layout (tokens per block 16..128, a secondary
pool), one split and many (a high SM count makes the launch split the keys), plus one serving-sized batch. The
pools must hold exactly the new tokens' K / V (allowing the last bit of the RoPE'd keys: the GPU contracts the
rotation into FMAs).
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib
from pathlib import Path

import pytest
import torch
from _attention_problems import (
    KV_CACHE_SCALING_FACTOR,
    KV_DTYPES,
    LAYER_IN_POOL,
    OUTPUT_ATOL,
    WINDOWS,
    AttentionCase,
    attention_problem,
    dense_reference,
)

pytestmark = pytest.mark.gpu

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
GROUPS = (1, 2, 4, 5, 8, 16)
HEAD_DIMS = (32, 64, 128, 256)


@pytest.fixture(scope="module")
def ext():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch.utils.cpp_extension import load

    return load(
        name="dflash_attention_ext",
        sources=[str(PLUGINS / "tests" / "attentionTorchBinding.cpp"), str(PLUGINS / "src" / "attentionKernel.cu")],
        extra_include_paths=[str(PLUGINS / "include")],
        extra_cflags=["-O2", "-std=c++17"],
        extra_cuda_cflags=["-O3", "-std=c++17"],
    )


def run_gpu(ext, problem, sms: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    c, cuda = problem.case, torch.device("cuda")
    primary = problem.primary.to(cuda)
    secondary = problem.secondary.to(cuda) if problem.secondary is not None else None
    scales = [None, None]
    if c.scale is not None:
        scales = [
            torch.tensor([1 / KV_CACHE_SCALING_FACTOR], device=cuda),
            torch.tensor([KV_CACHE_SCALING_FACTOR], device=cuda),
        ]
    offsets = problem.offsets[problem.offsets.shape[0] - c.requests :].contiguous().to(cuda)
    out = ext.attend(
        problem.qkv.to(cuda),
        problem.seq_lens.to(cuda),
        problem.gen_lens.to(cuda),
        problem.cos_sin.to(cuda),
        offsets,
        c.tokens_per_block,
        LAYER_IN_POOL,
        c.heads,
        c.kv_heads,
        c.max_query_len,
        c.window or 0,
        c.window_from_anchor,
        c.mask_id,
        c.q_scaling,
        primary,
        secondary,
        *scales,
        int(problem.seq_lens.max()),
        sms,
        *(None if t is None else t.to(cuda) for t in (problem.position_offsets, problem.packed_mask)),
    )
    torch.cuda.synchronize()
    return out.cpu(), primary.cpu(), secondary.cpu() if secondary is not None else None


def assert_pool(got: torch.Tensor, want: torch.Tensor) -> None:
    bits = torch.uint8 if got.element_size() == 1 else torch.int16
    exact = (got.view(bits) == want.view(bits)).float().mean().item()
    assert exact > 0.999, f"only {exact:.4f} of the pool matches bit for bit"
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-3, atol=1e-6)


CASES = [
    (causal, window, from_anchor, group, head_dim, kv)
    for (causal, (window, from_anchor), kv), (group, head_dim) in zip(
        itertools.product((True, False), WINDOWS, list(KV_DTYPES)),
        itertools.cycle(itertools.product(GROUPS, HEAD_DIMS)),
    )
]


@pytest.mark.parametrize("sms", [132, 4096])
@pytest.mark.parametrize(("causal", "window", "from_anchor", "group", "head_dim", "kv"), CASES)
def test_kernels_match_the_dense_reference(ext, causal, window, from_anchor, group, head_dim, kv, sms) -> None:
    for tpb, secondary in itertools.product((16, 32, 64, 128), (False, True)):
        case = AttentionCase(causal, window, group, head_dim, kv, tpb, secondary, kv_heads=2, requests=3)
        case = dataclasses.replace(case, window_from_anchor=from_anchor)
        problem = attention_problem(case, torch.Generator().manual_seed(zlib.crc32(repr(case).encode())))
        want, want_primary, want_secondary = dense_reference(problem)
        out, primary, secondary = run_gpu(ext, problem, sms)
        assert_pool(primary, want_primary)
        if secondary is not None:
            assert_pool(secondary, want_secondary)
        error = float(((out.float() - want).abs() - 0.02 * want.abs()).max())
        assert error <= OUTPUT_ATOL[case.input_dtype], f"{case}, {sms} SMs: output off by {error:.4g}"


def test_a_serving_sized_verify_batch(ext) -> None:
    """Qwen3-8B's attention geometry (32 query / 8 KV heads of 128), 16 requests of K + 1 = 16 over ~1k keys."""
    case = AttentionCase(True, None, 4, 128, "bfloat16", 32, False, kv_heads=8, requests=16)
    pasts = torch.randint(700, 1000, (case.requests,), generator=torch.Generator().manual_seed(2)).tolist()
    problem = attention_problem(case, torch.Generator().manual_seed(1), pasts)
    want, want_primary, _ = dense_reference(problem)
    out, primary, _ = run_gpu(ext, problem, torch.cuda.get_device_properties(0).multi_processor_count)
    assert_pool(primary, want_primary)
    error = float(((out.float() - want).abs() - 0.02 * want.abs()).max())
    assert error <= OUTPUT_ATOL[torch.bfloat16]


@pytest.mark.parametrize("rows", (9, 33, 129, 257))
def test_tree_masks_match_the_dense_reference(ext, rows) -> None:
    """Random draft trees (the runtime's packed mask and position offsets) at the sizes the host test checks, GQA
    4 over 2 KV heads, FP8 and bf16 caches, one split and many."""
    for kv, sms in itertools.product(("bfloat16", "fp8-from-bfloat16"), (132, 4096)):
        case = AttentionCase(True, None, 4, 128, kv, 32, rows % 2 == 1, kv_heads=2, max_query_len=rows, tree=True)
        problem = attention_problem(case, torch.Generator().manual_seed(rows))
        want, want_primary, want_secondary = dense_reference(problem)
        out, primary, secondary = run_gpu(ext, problem, sms)
        assert_pool(primary, want_primary)
        if secondary is not None:
            assert_pool(secondary, want_secondary)
        error = float(((out.float() - want).abs() - 0.02 * want.abs()).max())
        assert error <= OUTPUT_ATOL[case.input_dtype], f"{case}, {sms} SMs: output off by {error:.4g}"
