"""What fits on a GPU: weights per rank, the KV pool, and the largest batch the pool and the engine limits allow.

TensorRT-LLM sizes the paged KV pool after the engine is loaded: a fraction (`kv_cache_free_gpu_mem_fraction`)
of the memory still free once weights, the engine's activation memory and the runtime's own buffers are
allocated. A speculative engine keeps the drafter's context K/V in the same pool, as extra layers after the
target's, so every token costs the target's and the drafter's layers.

Per sequence, the batch manager reserves whole blocks for prompt + output (the no-evict scheduler's
`getRemainingBlocksToCompletion` counts `promptLen + maxNewTokens`), and an EAGLE-mode engine (DFlash and
EAGLE-3 both run as one) adds `maxPathLen + maxDecodingTokens` = 2 x (K + 1) tokens of headroom before every
step (`AllocateKvCache`), which the rewind after acceptance gives back. The planner reserves both, so a batch it
calls feasible never runs out of blocks in its last step. Read in the TensorRT-LLM 1.2.x sources, not run.

Weights follow the converter's layout: linears split over TP ranks, the input embedding and the drafter's fc
replicated on every rank, the lm_head (always its own tensor, even for tied targets) split by vocabulary rows.
The activation and runtime reserves are stated assumptions (`provenance.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dflash_trt.analysis.model import (
    ACTIVATION_BYTES,
    KV_BYTES,
    LM_HEAD_BYTES,
    WEIGHT_BYTES,
    Deployment,
    DFlashShape,
    Eagle3Shape,
    Method,
    TargetShape,
    mean_context,
)
from dflash_trt.analysis.pareto import Point
from dflash_trt.errors import DFlashTrtError
from dflash_trt.trtllm.build_limits import TOKENS_PER_BLOCK

# Assumed: CUDA context, cuBLAS/NCCL workspaces and runtime buffers per GPU outside the engine's activations.
RUNTIME_RESERVE_BYTES = 2e9
LOGITS_BYTES = 4.0  # assumed: the engine returns fp32 logits for every verified token of every sequence


@dataclass(frozen=True)
class EngineLimits:
    """The engine and serving knobs that bound a batch besides memory (defaults: trtllm-build's BuildConfig and
    the executor's KV fraction, read in the 1.2.x sources)."""

    max_batch_size: int = 2048
    max_num_tokens: int = 8192
    kv_cache_free_gpu_mem_fraction: float = 0.9
    tokens_per_block: int = TOKENS_PER_BLOCK

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_num_tokens < 1:
            raise DFlashTrtError(
                f"max_batch_size and max_num_tokens must be positive, got {self.max_batch_size} and "
                f"{self.max_num_tokens}"
            )
        if not 0.0 < self.kv_cache_free_gpu_mem_fraction < 1.0:
            raise DFlashTrtError(
                f"kv_cache_free_gpu_mem_fraction must lie in (0, 1), got {self.kv_cache_free_gpu_mem_fraction}"
            )


def draft_len(method: Method) -> int:
    """Draft tokens per step: K of an EAGLE-3 chain, block - 1 of a DFlash block, 0 for AR."""
    if isinstance(method.drafter, Eagle3Shape):
        return method.drafter.steps
    if isinstance(method.drafter, DFlashShape):
        return (method.acceptance.max_length if method.acceptance else method.drafter.block_size) - 1
    return 0


def headroom_tokens(draft_tokens: int, positions: int | None = None) -> int:
    """Tokens an EAGLE-mode step holds beyond the sequence: maxPathLen + maxDecodingTokens = (K + 1) + (N + 1), K
    the draft positions (EAGLE layers) and N the drafts verified (`positions` None: the chain, N = K, so 2 (K + 1));
    a draft tree's N is its nodes."""
    if not draft_tokens:
        return 0
    return (draft_tokens if positions is None else positions) + 1 + draft_tokens + 1


def _kv_heads_per_gpu(kv_heads: int, tp: int) -> int:
    """KV heads one rank stores: split when TP divides them, replicated (one per rank) when TP exceeds them."""
    return max(kv_heads // tp, 1)


def weights_per_gpu(target: TargetShape, drafter: DFlashShape | Eagle3Shape | None, precision: str, tp: int) -> float:
    """Bytes of weights one rank holds: decoder linears (all experts) in `precision` split over TP; the embedding
    and the drafter's fc replicated in bf16; the lm_head (written even when the target ties it) split by rows."""
    w = WEIGHT_BYTES[precision]
    t = target.stack
    linears = t.num_layers * t.layer_params(active=False)
    replicated = target.vocab * t.hidden * LM_HEAD_BYTES
    if drafter is not None:
        d = drafter.stack
        linears += d.num_layers * d.layer_params(active=False)
        replicated += drafter.num_taps * d.hidden * d.hidden * LM_HEAD_BYTES
    lm_head = math.ceil(target.vocab / tp) * t.hidden * LM_HEAD_BYTES
    return linears * w / tp + replicated + lm_head


def kv_bytes_per_token(target: TargetShape, drafter: DFlashShape | Eagle3Shape | None, kv_dtype: str, tp: int) -> float:
    """K and V of every target and drafter layer for one token, on one rank."""
    stacks = [target.stack] + ([drafter.stack] if drafter is not None else [])
    return float(
        sum(s.num_layers * 2 * _kv_heads_per_gpu(s.num_kv_heads, tp) * s.head_dim * KV_BYTES[kv_dtype] for s in stacks)
    )


def activation_bytes(target: TargetShape, tp: int, limits: EngineLimits, draft_tokens: int) -> float:
    """Assumed engine activation memory: one layer's live bf16 tensors per token of max_num_tokens (TensorRT
    reuses activation memory across layers), plus fp32 logits for every verified token of a full batch."""
    s = target.stack
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim / tp
    per_token = (2 * s.hidden + qkv + 2 * s.intermediate / tp) * ACTIVATION_BYTES
    logits = limits.max_batch_size * (draft_tokens + 1) * target.vocab * LOGITS_BYTES
    return limits.max_num_tokens * per_token + logits


@dataclass(frozen=True)
class Budget:
    """One rank's memory: what is reserved, the KV pool left, and its size in blocks."""

    memory_bytes: float
    weights_bytes: float
    activation_bytes: float
    runtime_bytes: float
    kv_pool_bytes: float
    kv_bytes_per_token: float
    tokens_per_block: int
    blocks: int

    @property
    def weights_fit(self) -> bool:
        return self.kv_pool_bytes > 0


def budget(
    target: TargetShape,
    drafter: DFlashShape | Eagle3Shape | None,
    dep: Deployment,
    limits: EngineLimits,
    draft_tokens: int,
) -> Budget:
    weights = weights_per_gpu(target, drafter, dep.precision, dep.tp)
    activations = activation_bytes(target, dep.tp, limits, draft_tokens)
    free = dep.gpu.hbm_bytes - weights - activations - RUNTIME_RESERVE_BYTES
    pool = max(free, 0.0) * limits.kv_cache_free_gpu_mem_fraction
    per_token = kv_bytes_per_token(target, drafter, dep.kv_dtype, dep.tp)
    blocks = int(pool // (per_token * limits.tokens_per_block))
    return Budget(
        dep.gpu.hbm_bytes, weights, activations, RUNTIME_RESERVE_BYTES, pool, per_token, limits.tokens_per_block, blocks
    )


def blocks_per_sequence(
    isl: int, osl: int, draft_tokens: int, tokens_per_block: int, positions: int | None = None
) -> int:
    return math.ceil((isl + osl + headroom_tokens(draft_tokens, positions)) / tokens_per_block)


@dataclass(frozen=True)
class BatchLimit:
    """The largest batch that runs, and which limit sets it (empty when the requested batch fits)."""

    batch: int
    reason: str


def batch_limit(
    b: Budget, limits: EngineLimits, isl: int, osl: int, draft_tokens: int, requested: int, dep: Deployment
) -> BatchLimit:
    """min(requested, KV-limited sequences, max_batch_size, max_num_tokens / tokens per step), with the reason."""
    gb = 1e9
    if not b.weights_fit:
        return BatchLimit(
            0,
            f"weights {b.weights_bytes / gb:.1f} GB + activations {b.activation_bytes / gb:.1f} GB + runtime "
            f"{b.runtime_bytes / gb:.0f} GB exceed {dep.gpu.name}'s {b.memory_bytes / gb:.1f} GB per GPU at tp "
            f"{dep.tp}",
        )
    per_seq = blocks_per_sequence(isl, osl, draft_tokens, b.tokens_per_block)
    step_tokens = draft_tokens + 1
    bounds = [
        (b.blocks // per_seq, f"the KV pool holds {b.blocks // per_seq} sequences of {isl}+{osl} tokens"),
        (limits.max_batch_size, f"max_batch_size {limits.max_batch_size}"),
        (
            limits.max_num_tokens // step_tokens,
            f"max_num_tokens {limits.max_num_tokens} holds {limits.max_num_tokens // step_tokens} sequences of "
            f"{step_tokens} tokens per step",
        ),
    ]
    cap, why = min(bounds, key=lambda x: x[0])
    return BatchLimit(requested, "") if requested <= cap else BatchLimit(cap, why)


@dataclass(frozen=True)
class FeasiblePoint:
    """A requested concurrency, the batch that actually runs, and its prediction (None when nothing fits)."""

    requested: int
    batch: int
    fits: bool
    reason: str
    point: Point | None

    def as_json(self) -> dict:
        p = self.point
        return {
            "concurrency": self.requested,
            "batch": self.batch,
            "fits": self.fits,
            "reason": self.reason or None,
            "tok_s_user": None if p is None else p.tok_s_user,
            "tok_s_gpu": None if p is None else p.tok_s_gpu,
        }


def feasible_curve(
    method: Method,
    target: TargetShape,
    dep: Deployment,
    concurrencies: Sequence[int],
    lengths: tuple[int, int],
    limits: EngineLimits,
) -> list[FeasiblePoint]:
    """Each requested concurrency capped at what fits, predicted at the batch that runs (steady-state decode)."""
    isl, osl = lengths
    k = draft_len(method)
    b = budget(target, method.drafter, dep, limits, k)
    ctx = mean_context(isl, osl)
    out = []
    for c in concurrencies:
        lim = batch_limit(b, limits, isl, osl, k, c, dep)
        point = None
        if lim.batch:
            it = method.iteration(target, lim.batch, ctx, dep)
            point = Point(method.name, c, it.tok_s_user(), lim.batch * it.tokens_per_seq / it.seconds / dep.tp)
        out.append(FeasiblePoint(c, lim.batch, lim.batch == c, lim.reason, point))
    return out
