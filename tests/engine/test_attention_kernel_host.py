"""The DFlashAttention kernels' algorithm, compiled for the CPU, against a dense float32 reference.

`plugins/tests/attentionHostDriver.cpp` runs the prepare / attend / combine code of `attentionCta.h` (the code the
GPU runs, with every warp instruction carried out lane by lane as the PTX ISA defines it) on host buffers. Every
combination of block mask (causal, full) x window (none, 24 counted from each query, 24 counted from the block's
anchor) x GQA group (1..16) x head dim (64, 128, 256) x KV dtype (fp16, bf16, FP8 from bf16, FP8 from fp16) x pool
layout (tokens per block 16, 32, 64, 128, each with the primary pool only or with a request in the secondary pool)
is checked: 2 x 3 x 16 x 3 x 4 x 8 = 9216 problems, in 1152 test cases of the eight pool layouts each. Each checks
the output against the reference and the pools bit for bit (the new tokens' K / V written where they belong,
nothing else touched). Head dim 32 (384 problems) and several KV heads with three requests (96 problems) are
checked besides.
"""

from __future__ import annotations

import ctypes
import itertools
import zlib

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
    pack_bits,
)
from _host_drivers import CACHE_TYPES, F32, I32, I64, INPUT_TYPES, P, compile_host_driver, pointer

MASKS = (True, False)  # causal, full
GROUPS = tuple(range(1, 17))
HEAD_DIMS = (64, 128, 256)
TOKENS_PER_BLOCK = (16, 32, 64, 128)
SECONDARY = (False, True)


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    handle = compile_host_driver(tmp_path_factory.mktemp("host"), "attentionHostDriver")
    handle.dflashAttentionHost.restype = I32
    handle.dflashAttentionHost.argtypes = [P] * 6 + [I32] * 6 + [P] * 5 + [I32] * 8 + [P, I32, P, I32, F32] + [I32] * 6
    handle.dflashAttentionWorkspaceBound.restype = I64
    handle.dflashAttentionWorkspaceBound.argtypes = [I64, I32, I32, I32]
    handle.dflashKeyVisible.restype = I32
    handle.dflashKeyVisible.argtypes = [I32] * 7
    handle.dflashFragmentCoverage.restype = None
    handle.dflashFragmentCoverage.argtypes = [I32, P]
    handle.dflashSwizzledOffset.restype = I32
    handle.dflashSwizzledOffset.argtypes = [I32] * 3
    return handle


def run_host(lib: ctypes.CDLL, problem, splits: int = 0, keys_per_split: int = 0, sms: int = 132) -> tuple:
    """(output, primary pool, secondary pool, splits used) after the host driver ran the plugin's three steps."""
    c = problem.case
    tree_offsets, tree_mask = problem.position_offsets, problem.packed_mask
    primary = problem.primary.clone()
    secondary = problem.secondary.clone() if problem.secondary is not None else None
    out = torch.zeros(problem.tokens, c.heads * c.head_dim, dtype=c.input_dtype)
    element = torch.empty((), dtype=c.input_dtype).element_size()
    bound = int(lib.dflashAttentionWorkspaceBound(problem.tokens, c.heads, c.head_dim, element))
    workspace = torch.empty(bound, dtype=torch.uint8)  # untouched pages are never committed
    scales = (
        (torch.tensor([1 / KV_CACHE_SCALING_FACTOR]), torch.tensor([KV_CACHE_SCALING_FACTOR]))
        if c.scale is not None
        else (None, None)
    )
    gen_offsets = problem.offsets[problem.offsets.shape[0] - c.requests :].contiguous()
    used = lib.dflashAttentionHost(
        pointer(problem.qkv),
        pointer(out),
        pointer(problem.seq_lens),
        pointer(problem.gen_lens),
        pointer(problem.cos_sin),
        pointer(gen_offsets),
        c.requests,
        problem.layout.max_blocks_per_seq,
        c.tokens_per_block,
        c.kv_heads,
        c.head_dim,
        LAYER_IN_POOL,
        pointer(primary),
        pointer(secondary),
        pointer(scales[0]),
        pointer(scales[1]),
        pointer(workspace),
        c.requests,
        problem.tokens,
        c.heads,
        c.max_query_len,
        problem.cos_sin.shape[0],
        c.window or 0,
        int(c.window_from_anchor),
        c.mask_id,
        pointer(tree_offsets),
        tree_offsets.shape[1] if tree_offsets is not None else 0,
        pointer(tree_mask),
        tree_mask.shape[1] if tree_mask is not None else 0,
        c.q_scaling,
        INPUT_TYPES[c.input_dtype],
        CACHE_TYPES[c.cache_dtype],
        splits,
        keys_per_split,
        int(problem.seq_lens.max()),
        sms,
    )
    return out, primary, secondary, used


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16)


def output_error(out: torch.Tensor, want: torch.Tensor) -> float:
    """The worst error beyond rtol 0.02 (compared with OUTPUT_ATOL of the input type)."""
    return float(((out.float() - want).abs() - 0.02 * want.abs()).max())


def check(lib, case: AttentionCase, splits: int = 0, keys_per_split: int = 0) -> int:
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))  # the same problem every run
    problem = attention_problem(case, gen)
    want, want_primary, want_secondary = dense_reference(problem)
    out, primary, secondary, used = run_host(lib, problem, splits, keys_per_split)
    assert used >= 1, f"the driver refused {case}"
    assert torch.equal(_bits(primary), _bits(want_primary)), f"primary pool differs: {case}"
    if secondary is not None:
        assert torch.equal(_bits(secondary), _bits(want_secondary)), f"secondary pool differs: {case}"
    worst = output_error(out, want)
    assert worst <= OUTPUT_ATOL[case.input_dtype], f"{case}: output off by {worst:.4g} beyond rtol 0.02"
    return used


@pytest.mark.parametrize("kv", list(KV_DTYPES))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize(("window", "from_anchor"), WINDOWS)
@pytest.mark.parametrize("causal", MASKS)
def test_every_combination_matches_the_dense_reference(lib, causal, window, from_anchor, group, head_dim, kv) -> None:
    """The eight pool layouts of one combination; the forced splits vary with the layout, so split-K and its
    combine step run on every combination too (1 split, 2 of two tiles, 3, chosen as the GPU launch does)."""
    for index, (tpb, secondary) in enumerate(itertools.product(TOKENS_PER_BLOCK, SECONDARY)):
        case = AttentionCase(causal, window, group, head_dim, kv, tpb, secondary, window_from_anchor=from_anchor)
        splits = (1, 2, 3, 0)[index % 4]
        keys_per_split = 2 * (32 if head_dim == 256 else 64) if splits == 2 else 0
        check(lib, case, splits, keys_per_split)


@pytest.mark.parametrize("kv", list(KV_DTYPES))
@pytest.mark.parametrize(("window", "from_anchor"), WINDOWS)
@pytest.mark.parametrize("causal", MASKS)
def test_head_dim_32_for_small_models(lib, causal, window, from_anchor, kv) -> None:
    """Head dim 32 (the embedded self-test pair's), beyond the required 64 / 128 / 256: fewer 16-byte chunks per
    row than the swizzle's eight, so it narrows to four."""
    for index, (group, tpb, secondary) in enumerate(itertools.product((1, 2, 3, 8), (16, 64), SECONDARY)):
        case = AttentionCase(causal, window, group, 32, kv, tpb, secondary, window_from_anchor=from_anchor)
        check(lib, case, (1, 2, 3, 0)[index % 4])


@pytest.mark.parametrize(
    ("kv_heads", "group", "head_dim", "kv"),
    [(2, 4, 128, "bfloat16"), (3, 2, 64, "fp8-from-float16"), (8, 1, 256, "float16"), (4, 5, 32, "fp8-from-bfloat16")],
)
@pytest.mark.parametrize(("window", "from_anchor"), WINDOWS)
@pytest.mark.parametrize("causal", MASKS)
def test_several_kv_heads_and_requests(lib, causal, window, from_anchor, kv_heads, group, head_dim, kv) -> None:
    """Each KV head reads and writes its own slice of qkv and of every page, with its own query heads, for each
    of several requests (the combinations above run one KV head, two requests)."""
    for index, (tpb, secondary) in enumerate(itertools.product((16, 32), SECONDARY)):
        case = AttentionCase(
            causal, window, group, head_dim, kv, tpb, secondary, kv_heads, requests=3, window_from_anchor=from_anchor
        )
        check(lib, case, (1, 3, 0, 2)[index])


@pytest.mark.parametrize(("which", "rows", "cols"), [(0, 16, 16), (1, 16, 8), (2, 16, 8)])
def test_fragment_layouts_cover_each_element_once(lib, which, rows, cols) -> None:
    """A, B and C fragment maps (PTX ISA m16n8k16) are bijections onto their tiles: no element twice or missing."""
    counts = torch.zeros(rows * cols, dtype=torch.int32)
    lib.dflashFragmentCoverage(which, pointer(counts))
    assert torch.equal(counts, torch.ones_like(counts))


def test_ldmatrix_addressing_reads_each_tile_row_chunk_once(lib) -> None:
    """Each operand's 32 lane addresses name every (row, 8-channel chunk) of its 16 x 16 tile exactly once."""
    counts = torch.zeros(3 * 256, dtype=torch.int32)
    lib.dflashFragmentCoverage(3, pointer(counts))
    assert torch.equal(counts, torch.ones_like(counts))


@pytest.mark.parametrize("head_dim", (32, *HEAD_DIMS))
def test_swizzle_is_a_bijection_spreading_rows_over_banks(lib, head_dim) -> None:
    offsets = torch.tensor(
        [[lib.dflashSwizzledOffset(r, c, head_dim) for c in range(head_dim)] for r in range(64)], dtype=torch.int64
    )
    assert torch.equal(offsets.flatten().sort().values, torch.arange(64 * head_dim))
    for chunk in range(head_dim // 8):
        # The eight rows an ldmatrix matrix reads hit eight different 16-byte bank groups (32 banks of 4 bytes),
        # or as many as a row has chunks.
        groups = {(int(offsets[r, chunk * 8]) * 2 // 16) % 8 for r in range(8)}
        assert len(groups) == min(8, head_dim // 8)


def test_key_visibility_matches_the_golden_models(lib) -> None:
    from dflash_trt.reference.model import draft_visibility

    gen = torch.Generator().manual_seed(6)
    windows = [(None, False), *itertools.product((1, 5, 24), (False, True))]
    for causal, (window, from_anchor) in itertools.product((True, False), windows):
        past = int(torch.randint(0, 45, (1,), generator=gen))
        q = past + torch.randint(0, 16, (1, 30), generator=gen)  # queries of a block starting at `past`
        k = torch.arange(64)[None]
        end = 61
        anchor = torch.tensor([[past]]) if from_anchor else None
        want = draft_visibility(q, k, k < end, causal, window, anchor)[0]
        mask = 0 if causal else 1
        got = torch.tensor(
            [
                [lib.dflashKeyVisible(int(a), int(b), end, mask, window or 0, int(from_anchor), past) for b in k[0]]
                for a in q[0]
            ]
        )
        assert torch.equal(got.bool(), want)


# Draft trees (the target's verification on B200 / B300): node counts up to EAGLE's 256 drafts (257 rows with the
# anchor) across mask words, each with four (group, head dim, KV dtype, pages, pool, KV heads) combinations.
TREE_ROWS = (2, 9, 16, 33, 64, 129, 257)
TREE_LAYOUTS = (
    (1, 64, "bfloat16", 16, False, 1),
    (4, 128, "fp8-from-bfloat16", 32, True, 2),
    (8, 32, "float16", 64, False, 1),
    (2, 256, "fp8-from-float16", 128, True, 1),
)


def tree_case(rows: int, layout: tuple, requests: int = 2) -> AttentionCase:
    group, head_dim, kv, tpb, secondary, kv_heads = layout
    return AttentionCase(
        True, None, group, head_dim, kv, tpb, secondary, kv_heads, requests=requests, max_query_len=rows, tree=True
    )


def chain_rows(gen_lens: torch.Tensor, width: int) -> torch.Tensor:
    """The chain's mask rows of each request, one after another, `width` keys wide."""
    blocks = [torch.ones(int(n), int(n), dtype=torch.bool).tril() for n in gen_lens]
    return torch.cat([torch.nn.functional.pad(b, (0, width - b.shape[1])) for b in blocks])


@pytest.mark.parametrize("rows", TREE_ROWS)
def test_tree_masks_match_the_dense_reference(lib, rows) -> None:
    """Random trees (RoPE at the anchor plus each node's depth, K / V at the anchor plus its index, each node seeing
    the past and its ancestors) against the dense reference, splits forced 1 / 2 / 3 / chosen; the large trees at
    the smaller head dims keep the lane-by-lane simulation short."""
    layouts = TREE_LAYOUTS if rows <= 64 else TREE_LAYOUTS[::2]
    for index, layout in enumerate(layouts):
        splits = (1, 2, 3, 0)[index % 4]
        keys_per_split = 2 * (32 if layout[1] == 256 else 64) if splits == 2 else 0
        check(lib, tree_case(rows, layout, requests=3 if rows <= 16 else 2), splits, keys_per_split)


def test_a_chain_tree_equals_the_causal_mask(lib) -> None:
    """A tree that is one chain (offsets 0..n-1, lower-triangular rows) gives the causal mask's output bit for bit."""
    case = tree_case(16, TREE_LAYOUTS[1])
    problem = attention_problem(case, torch.Generator().manual_seed(3))
    problem.position_offsets[:] = torch.arange(problem.position_offsets.shape[1], dtype=torch.int32)
    problem.packed_mask = pack_bits(chain_rows(problem.gen_lens, case.max_query_len), 1)
    tree_out = run_host(lib, problem, 1)[0]
    causal = attention_problem(AttentionCase(**{**case.__dict__, "tree": False}), torch.Generator().manual_seed(3))
    assert torch.equal(causal.qkv, problem.qkv)
    assert torch.equal(_bits(run_host(lib, causal, 1)[0]), _bits(tree_out))


@pytest.mark.parametrize("rows", (9, 40))
@pytest.mark.parametrize("sabotage", ("bit order flipped", "offsets ignored", "chain mask"))
def test_tree_sabotage_is_caught(lib, rows, sabotage) -> None:
    """What a kernel reading the runtime's inputs wrong would compute is far outside the tolerance: bits taken from
    the most significant end of each word, the offsets ignored (RoPE at the cache slot), the chain's mask."""
    case = tree_case(rows, TREE_LAYOUTS[0])
    problem = attention_problem(case, torch.Generator().manual_seed(rows))
    want = dense_reference(problem)[0]
    out = run_host(lib, problem, 1)[0]
    assert output_error(out, want) <= OUTPUT_ATOL[case.input_dtype]
    if sabotage == "bit order flipped":
        bits = (problem.packed_mask.long() & 0xFFFFFFFF)[..., None] >> torch.arange(32) & 1
        problem.packed_mask = pack_bits(bits.flip(-1).flatten(1).bool(), problem.packed_mask.shape[1])
    elif sabotage == "offsets ignored":
        problem.position_offsets[:] = torch.arange(problem.position_offsets.shape[1], dtype=torch.int32)
    else:
        problem.packed_mask = pack_bits(chain_rows(problem.gen_lens, rows), problem.packed_mask.shape[1])
    wrong = run_host(lib, problem, 1)[0]
    assert output_error(wrong, want) > 10 * OUTPUT_ATOL[case.input_dtype], sabotage


def test_a_tree_launch_without_its_inputs_is_refused(lib) -> None:
    """The driver refuses a tree mask without offsets, with too few mask words, or with a window (-1)."""
    case = tree_case(40, TREE_LAYOUTS[0])
    problem = attention_problem(case, torch.Generator().manual_seed(1))
    assert run_host(lib, problem, 1)[3] == 1
    problem.position_offsets = None
    assert run_host(lib, problem, 1)[3] == -1
    problem = attention_problem(case, torch.Generator().manual_seed(1))
    problem.packed_mask = problem.packed_mask[:, :1].contiguous()
    assert run_host(lib, problem, 1)[3] == -1
    windowed = AttentionCase(True, 24, 1, 64, "bfloat16", 16, False, max_query_len=40, tree=True)
    assert run_host(lib, attention_problem(windowed, torch.Generator().manual_seed(1)), 1)[3] == -1
