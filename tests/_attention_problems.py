"""DFlashAttention test problems and their dense float32 reference, shared by the host-compiled kernel test and the
GPU kernel test.

A problem is one plugin call: a few generation requests whose new tokens (packed rows of `qkv`, after the q/k
norms) follow a past already in a paged pool. The reference is written independently of the kernel's header: the
page addressing is `reference.kv_injection.PagedKVCacheLayout`, the visibility is the golden model's
`draft_visibility`, RoPE is the rotate-half rule in float32 from the plugin's cos/sin table, and the attention is a
float32 softmax over every key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_trt.reference.kv_injection import SECONDARY_POOL_FLAG, PagedKVCacheLayout, to_cache_dtype
from dflash_trt.reference.model import draft_visibility
from dflash_trt.rope import RopeConfig, rope_cos_sin

# The KV dtypes of a TensorRT-LLM 1.2.x pool: the activations' type, or FP8 e4m3 with a per-layer scale.
KV_DTYPES = {
    "float16": (torch.float16, torch.float16),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "fp8-from-bfloat16": (torch.bfloat16, torch.float8_e4m3fn),
    "fp8-from-float16": (torch.float16, torch.float8_e4m3fn),
}
KV_CACHE_SCALING_FACTOR = 0.02  # stored = value / 0.02: unit-normal values use most of e4m3's range
LAYERS_IN_POOL, LAYER_IN_POOL = 3, 1  # the attention's layer sits one layer into a three-layer pool
CONTEXT_ROWS = 1  # block-table rows before the first generation request (a context request of the same step)
# (window, counted from the block's anchor): none, 24 counted from each query (z-lab), 24 from the anchor (speculators).
WINDOWS = ((None, False), (24, False), (24, True))


@dataclass(frozen=True)
class AttentionCase:
    causal: bool
    window: int | None
    group: int
    head_dim: int
    kv: str  # a KV_DTYPES key
    tokens_per_block: int
    secondary: bool
    kv_heads: int = 1
    requests: int = 2
    max_query_len: int = 16
    q_scaling: float = 1.0
    window_from_anchor: bool = False  # the window counts back from the block's anchor (speculators drafters)
    tree: bool = False  # each request verifies a random draft tree (the runtime's packed mask and offsets)

    @property
    def mask_id(self) -> int:
        """The plugin's block_mask: 0 causal, 1 full, 2 tree."""
        return 2 if self.tree else int(not self.causal)

    @property
    def input_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.kv][0]

    @property
    def cache_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.kv][1]

    @property
    def heads(self) -> int:
        return self.group * self.kv_heads

    @property
    def scale(self) -> float | None:
        """kv_scale_orig_quant of an FP8 cache."""
        return 1.0 / KV_CACHE_SCALING_FACTOR if self.cache_dtype == torch.float8_e4m3fn else None


@dataclass
class AttentionProblem:
    case: AttentionCase
    qkv: torch.Tensor  # [tokens, (heads + 2 kv_heads) * head_dim], input dtype
    seq_lens: torch.Tensor  # int32 [requests]: past + new tokens
    gen_lens: torch.Tensor  # int32 [requests]
    cos_sin: torch.Tensor  # float32 [positions, head_dim / 2, 2]
    offsets: torch.Tensor  # int32 [CONTEXT_ROWS + requests, 2, max_blocks] (one pool)
    layout: PagedKVCacheLayout
    primary: torch.Tensor  # [blocks, LAYERS_IN_POOL, 2, kv_heads, tokens_per_block, head_dim]
    secondary: torch.Tensor | None
    parents: list[list[int]] | None = None  # per request, each node's parent (-1 for the anchor); trees only
    position_offsets: torch.Tensor | None = (
        None  # int32 [requests, stride]: node depths (spec_decoding_position_offsets)
    )
    packed_mask: torch.Tensor | None = None  # int32 [tokens, words] (spec_decoding_packed_mask)

    @property
    def tokens(self) -> int:
        return int(self.gen_lens.sum())


def _past_lengths(case: AttentionCase, gen: torch.Generator) -> list[int]:
    """Pasts that may cross a page boundary, the first one past the window when there is one."""
    top = case.tokens_per_block + 9
    pasts = [int(torch.randint(0, top, (1,), generator=gen)) for _ in range(case.requests)]
    if case.window is not None:
        pasts[0] = case.window + int(torch.randint(1, case.tokens_per_block + 5, (1,), generator=gen))
    return pasts


def _block_table(case: AttentionCase, seq_lens: list[int], gen: torch.Generator) -> tuple[torch.Tensor, int, int]:
    """(offsets, max_blocks, blocks in the pool): every sequence's pages on shuffled physical blocks; with
    `secondary`, the last request's pages carry bit 31 (blocks of the secondary pool)."""
    tpb = case.tokens_per_block
    max_blocks = max(-(-length // tpb) for length in seq_lens) + 1
    rows = CONTEXT_ROWS + case.requests
    blocks = rows * max_blocks + 3
    physical = torch.randperm(blocks, generator=gen)[: rows * max_blocks].view(rows, max_blocks)
    raw = physical.long() * LAYERS_IN_POOL * 2
    offsets = torch.stack([raw, raw + 1], dim=1)
    if case.secondary:
        offsets[-1] |= SECONDARY_POOL_FLAG
    offsets = torch.where(offsets >= 2**31, offsets - 2**32, offsets).to(torch.int32).contiguous()
    return offsets, max_blocks, blocks


def _random_pool(case: AttentionCase, blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Random past K / V in the attention's layer; the pool's other layers hold zeros (and must keep them)."""
    shape = (blocks, LAYERS_IN_POOL, 2, case.kv_heads, case.tokens_per_block, case.head_dim)
    pool = torch.zeros(shape, dtype=case.cache_dtype)
    values = torch.randn((blocks, *shape[2:]), generator=gen)
    pool[:, LAYER_IN_POOL] = to_cache_dtype(values, case.cache_dtype, case.scale)
    return pool


def cos_sin_table(positions: int, head_dim: int) -> torch.Tensor:
    """float32 [positions, head_dim / 2, 2] (cos, sin), the layout of the attention plugin's rotary_cos_sin."""
    cos, sin = rope_cos_sin(torch.arange(positions), RopeConfig(head_dim, 10_000.0))
    half = head_dim // 2
    return torch.stack([cos[:, :half], sin[:, :half]], dim=-1).float().contiguous()


def random_tree(nodes: int, gen: torch.Generator) -> list[int]:
    """Parents of a random draft tree in EAGLE's node order (a parent before its children): each node hangs off
    the previous one (deepening a chain) or off any earlier node (branching), half and half."""
    parents = [-1]
    for i in range(1, nodes):
        chain = bool(torch.rand(1, generator=gen) < 0.5)
        parents.append(i - 1 if chain else int(torch.randint(0, i, (1,), generator=gen)))
    return parents


def tree_visibility(parents: list[int]) -> tuple[list[int], torch.Tensor]:
    """(depth of each node, [nodes, nodes] node i sees node j): itself and its ancestors."""
    n = len(parents)
    sees = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for i, parent in enumerate(parents):
        sees[i, i] = True
        if parent >= 0:
            sees[i] |= sees[parent]
            depth[i] = depth[parent] + 1
    return depth, sees


def pack_bits(rows: torch.Tensor, words: int) -> torch.Tensor:
    """int32 [rows, words] with bit j % 32 of word j // 32 (least significant first) set iff rows[:, j]."""
    padded = torch.zeros(rows.shape[0], 32 * words, dtype=torch.int64)
    padded[:, : rows.shape[1]] = rows.long()
    value = (padded.view(-1, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)


def _tree_inputs(case: AttentionCase, gen_lens: list[int], gen: torch.Generator) -> dict:
    """Random trees and the runtime's inputs for them: offsets rows wider than the trees (stride != nodes), mask
    rows of the requests one after another, ceil(max_query_len / 32) words each."""
    parents = [random_tree(n, gen) for n in gen_lens]
    offsets = torch.zeros(case.requests, case.max_query_len + 3, dtype=torch.int32)
    rows = []
    for r, tree in enumerate(parents):
        depth, sees = tree_visibility(tree)
        offsets[r, : len(tree)] = torch.tensor(depth, dtype=torch.int32)
        rows.append(torch.nn.functional.pad(sees, (0, case.max_query_len - len(tree))))
    words = -(-case.max_query_len // 32)
    return {"parents": parents, "position_offsets": offsets, "packed_mask": pack_bits(torch.cat(rows), words)}


def attention_problem(case: AttentionCase, gen: torch.Generator, pasts: list[int] | None = None) -> AttentionProblem:
    """One plugin call's inputs; `pasts` (one per request) replaces the short random pasts."""
    gen_lens = [case.max_query_len] + [
        int(torch.randint(1, case.max_query_len + 1, (1,), generator=gen)) for _ in range(case.requests - 1)
    ]
    pasts = _past_lengths(case, gen) if pasts is None else pasts
    seq_lens = [p + n for p, n in zip(pasts, gen_lens, strict=True)]
    offsets, max_blocks, blocks = _block_table(case, seq_lens, gen)
    width = (case.heads + 2 * case.kv_heads) * case.head_dim
    qkv = torch.randn(sum(gen_lens), width, generator=gen).to(case.input_dtype)
    return AttentionProblem(
        case=case,
        qkv=qkv,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        gen_lens=torch.tensor(gen_lens, dtype=torch.int32),
        cos_sin=cos_sin_table(max(seq_lens) + 7, case.head_dim),
        offsets=offsets,
        layout=PagedKVCacheLayout(case.kv_heads, case.head_dim, case.tokens_per_block, max_blocks, LAYER_IN_POOL),
        primary=_random_pool(case, blocks, gen),
        secondary=_random_pool(case, blocks, gen) if case.secondary else None,
        **(_tree_inputs(case, gen_lens, gen) if case.tree else {}),
    )


def _pool_of(flags: torch.Tensor, primary: torch.Tensor, secondary: torch.Tensor | None) -> torch.Tensor:
    if bool(flags.any()):
        assert bool(flags.all()) and secondary is not None
        return secondary
    return primary


def _rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of [n, heads, head_dim] with the table rows [n, head_dim / 2, 2], in float32."""
    half = x.shape[-1] // 2
    c, s = table[:, None, :, 0], table[:, None, :, 1]
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1)


def dense_reference(problem: AttentionProblem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(float32 output [tokens, heads * head_dim], pools after the writes): what the plugin must compute."""
    c = problem.case
    d, heads, kvh = c.head_dim, c.heads, c.kv_heads
    primary = problem.primary.clone()
    secondary = problem.secondary.clone() if problem.secondary is not None else None
    dequant = KV_CACHE_SCALING_FACTOR if c.scale is not None else 1.0
    out = torch.zeros(problem.tokens, heads * d)
    row = 0
    for r in range(c.requests):
        n, end = int(problem.gen_lens[r]), int(problem.seq_lens[r])
        past = end - n
        positions = torch.arange(past, end)
        rotary = positions
        if problem.parents is not None:
            depth, sees = tree_visibility(problem.parents[r])
            rotary = past + torch.tensor(depth)
        seq = torch.full((n,), CONTEXT_ROWS + r)
        x = problem.qkv[row : row + n].float()
        q = x[:, : heads * d].view(n, heads, d)
        k = x[:, heads * d : (heads + kvh) * d].view(n, kvh, d)
        v = x[:, (heads + kvh) * d :].view(n, kvh, d)
        q = _rotate(q, problem.cos_sin[rotary]).to(c.input_dtype).float()
        k = _rotate(k, problem.cos_sin[rotary]).to(c.input_dtype).float()
        for kind, values in ((0, k), (1, v)):
            flags, elements = problem.layout.element_offsets(problem.offsets, seq, positions, 0, kind)
            _pool_of(flags, primary, secondary).view(-1)[elements] = to_cache_dtype(values, c.cache_dtype, c.scale)
        keys_at = torch.arange(end)
        stored = []
        for kind in (0, 1):
            flags, elements = problem.layout.element_offsets(
                problem.offsets, torch.full((end,), seq[0]), keys_at, 0, kind
            )
            stored.append(_pool_of(flags, primary, secondary).view(-1)[elements].float() * dequant)
        keys = stored[0].repeat_interleave(c.group, dim=1)
        values = stored[1].repeat_interleave(c.group, dim=1)
        scores = q.transpose(0, 1) @ keys.permute(1, 2, 0) / (math.sqrt(d) * c.q_scaling)
        anchor = torch.tensor([[past]]) if c.window_from_anchor else None
        visible = draft_visibility(
            positions[None], keys_at[None], torch.ones(1, end, dtype=torch.bool), c.causal, c.window, anchor
        )
        if problem.parents is not None:  # every past key, and the node's ancestors and itself in the block
            visible = torch.cat([torch.ones(1, n, past, dtype=torch.bool), sees[None]], dim=-1)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[row : row + n] = (scores.softmax(-1) @ values.transpose(0, 1)).transpose(0, 1).reshape(n, heads * d)
        row += n
    return out, primary, secondary


# Output tolerance against the float32 reference: P is rounded to the input type for the tensor-core P V product
# (relative error 2^-8 for bfloat16, 2^-11 for float16 per weight) and the output once more.
OUTPUT_ATOL = {torch.bfloat16: 2.5e-2, torch.float16: 4e-3}
