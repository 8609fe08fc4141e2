"""Refused attention layouts: what the attention kernel serving each pass on the build's GPU (`AttentionRoute`)
cannot run for a checkpoint."""

from __future__ import annotations

from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import FP8
from dflash_trt.spec import SLIDING_ATTENTION
from dflash_trt.trtllm.attention_route import OURS
from dflash_trt.trtllm.build_limits import DFLASH_ATTENTION_HEAD_DIMS
from dflash_trt.trtllm.build_settings import EngineBuildSettings
from dflash_trt.trtllm.checkpoint_facts import CheckpointFacts, kv_cache_format
from dflash_trt.trtllm.network_checks import rank_heads

# Hopper's XQA kernel (mha_sm90.cu) has a small-batch spec-decoding layout for q_seq_len x heads per KV head <= 32 (the
# SPEC_Q_SEQ_LEN specialisation, swapping GEMM operands) whose mask is a hard-coded lower triangle: it never reads the
# packed mask [read: cpp/kernels/xqa/mha_sm90.cu @ 014dadcd, `warpGrpApplyMask` under SWAP_AB && SPEC_DEC].
XQA_SWAP_AB_LIMIT = 32


def check_xqa_block_layout(facts: CheckpointFacts, settings: EngineBuildSettings) -> None:
    """Refuse a drafter whose bidirectional block could meet that layout with an FP8 KV cache (the Hopper kernel for
    FP8 caches): its all-ones mask would silently become causal, which no output of the engine would show. Only
    bidirectional layers the route leaves on the stock kernel count: where DFlashAttention runs the block (B200 /
    B300, sliding layers everywhere) its block_mask field is the mask. A draft tree's verification on the stock
    kernel meets the same layout when its N + 1 rows times the target's query heads per KV head fit in it.

    The JIT compiler wrapper read (nvrtcWrapper.cpp @ 029e0a7c and @ 7c9600c5) never defines SPEC_Q_SEQ_LEN, so 1.2.x
    should compile the layout that reads the mask; the newest stored kernelUtils.cpp says a later wrapper does
    define it, and which one the 1.2.x release carries could not be pinned, so the plan refuses rather than hopes.
    No shipped profile is affected: their drafters have 4-8 query heads per KV head and 16-token blocks.
    """
    route = settings.route
    if kv_cache_format(facts) != FP8:
        return
    if settings.draft_tree is not None and route.target_generation != OURS:
        check_xqa_tree_layout(facts, settings.draft_tree)
    on_stock = [
        not causal and route.draft_layer(kind == SLIDING_ATTENTION) != OURS
        for kind, causal in zip(facts.layer_types, facts.causal, strict=True)
    ]
    if not any(on_stock):
        return
    heads, kv_heads = rank_heads(facts.draft_heads, facts.draft_kv_heads, facts.tp_size)
    rows = heads // kv_heads * facts.block_size
    if rows <= XQA_SWAP_AB_LIMIT:
        raise DFlashTrtError(
            f"with an FP8 KV cache the drafter's block ({facts.block_size} tokens x {heads // kv_heads} query heads "
            f"per KV head = {rows} rows <= {XQA_SWAP_AB_LIMIT}) may run in Hopper XQA's small-batch spec-decoding "
            "layout, whose mask is hard-coded causal: the drafter's bidirectional block would silently turn causal. "
            "Build with --kv_cache_dtype none, or a drafter with more query heads per KV head or larger blocks"
        )


def check_xqa_tree_layout(facts: CheckpointFacts, nodes: int) -> None:
    """The target's verification of a tree of `nodes` nodes on Hopper XQA with an FP8 cache (see above)."""
    heads, kv_heads = rank_heads(facts.target_heads, facts.target_kv_heads, facts.tp_size)
    rows = heads // kv_heads * (nodes + 1)
    if rows <= XQA_SWAP_AB_LIMIT:
        raise DFlashTrtError(
            f"--draft_tree {nodes}: with an FP8 KV cache the target's verification ({nodes + 1} tokens x "
            f"{heads // kv_heads} query heads per KV head = {rows} rows <= {XQA_SWAP_AB_LIMIT}) may run in Hopper "
            "XQA's small-batch spec-decoding layout, whose mask is hard-coded causal: the tree would be verified as "
            "a chain. Build with --kv_cache_dtype none or a larger tree"
        )


def check_attention_route(facts: CheckpointFacts, settings: EngineBuildSettings) -> None:
    """What the layers DFlashAttention serves on this GPU must be: a head dim its kernels are built for."""
    route = settings.route
    served = []
    if route.target_generation == OURS:
        served.append(("target", facts.target_head_size))
    kinds = set(facts.layer_types)
    if any(route.draft_layer(kind == SLIDING_ATTENTION) == OURS for kind in kinds):
        served.append(("drafter", facts.draft_head_size))
    for who, head_dim in served:
        if head_dim not in DFLASH_ATTENTION_HEAD_DIMS:
            raise DFlashTrtError(
                f"on {settings.gpu} the {who}'s generation attention runs on DFlashAttention, whose kernels take "
                f"head dims {', '.join(map(str, DFLASH_ATTENTION_HEAD_DIMS))}, not {head_dim}"
            )
