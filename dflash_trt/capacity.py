"""How many sequences a build profile's engine can hold in its KV pool, from the profile and the model shapes.

TensorRT-LLM sizes the paged KV pool after the engine is loaded: a fraction (`kv_cache_free_gpu_mem_fraction`)
of the memory still free once weights, the engine's activation memory and the runtime's own buffers are
allocated. The DFlash engine keeps the drafter's context K/V in the same pool, as extra layers after the
target's, so every token costs the target's and the drafter's layers. A sequence reserves whole blocks for its
full length plus the draft tokens of its last step (guaranteed_no_evict reserves them up front).

Weights, KV bytes and block arithmetic follow from the shapes; the activation and runtime reserves are stated
assumptions (`provenance.py`), because the real figures are only known once trtllm-build has run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import DFlashTrtError
from dflash_trt.perf.gpus import get_gpu
from dflash_trt.perf.model import ACTIVATION_BYTES, KV_BYTES, LM_HEAD_BYTES, WEIGHT_BYTES, DFlashShape, TargetShape
from dflash_trt.perf.shapes import load_models
from dflash_trt.profiles import BuildProfile
from dflash_trt.trtllm.build_plan import TOKENS_PER_BLOCK

# Assumed: CUDA context, cuBLAS/NCCL workspaces and runtime buffers per GPU outside the engine's activations.
RUNTIME_RESERVE_BYTES = 2e9
LOGITS_BYTES = 4.0  # assumed: the engine returns fp32 logits for every verified token of every sequence


@dataclass(frozen=True)
class Capacity:
    """Per-GPU memory budget of one profile and the sequences its KV pool holds."""

    weights_bytes: float
    activation_bytes: float
    runtime_bytes: float
    kv_pool_bytes: float
    kv_bytes_per_token: float
    tokens_per_block: int
    blocks: int
    shape: tuple[int, int]
    sequences_at_shape: int
    max_seq_len: int
    sequences_at_max_seq_len: int

    def as_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self).items()}


def _kv_heads_per_gpu(kv_heads: int, tp: int) -> int:
    """KV heads one rank stores: split when TP divides them, replicated (one per rank) when TP exceeds them."""
    return max(kv_heads // tp, 1)


def weights_per_gpu(target: TargetShape, drafter: DFlashShape, precision: str, tp: int) -> float:
    """Bytes of weights one rank holds: linears (all experts) in `precision`, embeddings and lm_head in bf16."""
    w = WEIGHT_BYTES[precision]
    t, d = target.stack, drafter.stack
    linears = t.num_layers * t.layer_params(active=False) + d.num_layers * d.layer_params(active=False)
    fc = drafter.num_taps * d.hidden * d.hidden
    embeddings = target.vocab * t.hidden * (1 if target.tied_embeddings else 2)
    return ((linears + fc) * w + embeddings * LM_HEAD_BYTES) / tp


def kv_bytes_per_token(target: TargetShape, drafter: DFlashShape, kv_dtype: str, tp: int) -> float:
    """K and V of every target and drafter layer for one token, on one rank."""
    total = 0.0
    for s in (target.stack, drafter.stack):
        total += s.num_layers * 2 * _kv_heads_per_gpu(s.num_kv_heads, tp) * s.head_dim * KV_BYTES[kv_dtype]
    return total


def activation_bytes(target: TargetShape, profile: BuildProfile) -> float:
    """Assumed engine activation memory: one layer's live bf16 tensors per token of max_num_tokens (TensorRT
    reuses activation memory across layers), plus fp32 logits for every verified token of a full batch."""
    s, tp, eng = target.stack, profile.checkpoint.tp_size, profile.engine
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim / tp
    per_token = (2 * s.hidden + qkv + 2 * s.intermediate / tp) * ACTIVATION_BYTES
    logits = eng.max_batch_size * (eng.max_draft_len + 1) * target.vocab * LOGITS_BYTES
    return eng.max_num_tokens * per_token + logits


def sequences_that_fit(blocks: int, length: int, max_draft_len: int, tokens_per_block: int) -> int:
    return blocks // math.ceil((length + max_draft_len) / tokens_per_block)


def plan_capacity(
    profile: BuildProfile, target: TargetShape, drafter: DFlashShape, shape: tuple[int, int] | None = None
) -> Capacity:
    """The profile's per-GPU budget and the sequences that fit at `shape` (ISL, OSL; default the sweep's)."""
    q, eng, tp = profile.quantization, profile.engine, profile.checkpoint.tp_size
    precision = "bf16" if q.qformat == "none" else q.qformat
    kv_dtype = "bf16" if q.kv_cache_dtype == "none" else q.kv_cache_dtype
    isl, osl = shape or (profile.sweep.input_len, profile.sweep.output_len)
    if isl < 1 or osl < 1:
        raise DFlashTrtError(f"input and output lengths must be positive, got {isl} and {osl}")
    memory = get_gpu(profile.gpu).hbm_bytes
    weights = weights_per_gpu(target, drafter, precision, tp)
    activations = activation_bytes(target, profile)
    free = memory - weights - activations - RUNTIME_RESERVE_BYTES
    if free <= 0:
        raise DFlashTrtError(
            f"{profile.name}: weights ({weights / 1e9:.1f} GB), activations ({activations / 1e9:.1f} GB) and the "
            f"runtime reserve ({RUNTIME_RESERVE_BYTES / 1e9:.0f} GB) exceed {profile.gpu}'s "
            f"{memory / 1e9:.0f} GB per GPU; raise tp_size, quantize or lower max_num_tokens / max_batch_size"
        )
    pool = free * profile.serving.kv_cache_free_gpu_mem_fraction
    per_token = kv_bytes_per_token(target, drafter, kv_dtype, tp)
    blocks = int(pool // (per_token * TOKENS_PER_BLOCK))
    if sequences_that_fit(blocks, eng.max_seq_len, eng.max_draft_len, TOKENS_PER_BLOCK) < 1:
        # 1.2.x clampWindowSizesToFitAtLeastOneSequence would shrink the attention window below max_seq_len: a
        # cyclic cache, while KV injection writes absolute pages (docs/engine.md §4).
        raise DFlashTrtError(
            f"{profile.name}: the KV pool ({pool / 1e9:.2f} GB) cannot hold one sequence of max_seq_len "
            f"{eng.max_seq_len}, so TensorRT-LLM would shrink the attention window below it and the drafter would "
            "read KV pages never written; lower max_seq_len, raise kv_cache_free_gpu_mem_fraction or tp_size, or "
            "quantize"
        )
    return Capacity(
        weights_bytes=weights,
        activation_bytes=activations,
        runtime_bytes=RUNTIME_RESERVE_BYTES,
        kv_pool_bytes=pool,
        kv_bytes_per_token=per_token,
        tokens_per_block=TOKENS_PER_BLOCK,
        blocks=blocks,
        shape=(isl, osl),
        sequences_at_shape=sequences_that_fit(blocks, isl + osl, eng.max_draft_len, TOKENS_PER_BLOCK),
        max_seq_len=eng.max_seq_len,
        sequences_at_max_seq_len=sequences_that_fit(blocks, eng.max_seq_len, eng.max_draft_len, TOKENS_PER_BLOCK),
    )


def capacity_warnings(profile: BuildProfile, capacity: Capacity) -> list[str]:
    """What a user should know before serving: a batch the pool cannot hold at the sweep's shape."""
    warnings = []
    if capacity.sequences_at_shape < profile.engine.max_batch_size:
        isl, osl = capacity.shape
        warnings.append(
            f"{profile.name}: max_batch_size {profile.engine.max_batch_size} cannot be held at {isl}/{osl} tokens: "
            f"the KV pool fits about {capacity.sequences_at_shape} such sequences, so the scheduler will queue "
            "the rest"
        )
    return warnings


def checkpoint_warnings(profile: BuildProfile, target_dir: Path, draft_dir: Path) -> list[str]:
    """`capacity_warnings` for the checkpoints a build is about to use (only their config.json is read)."""
    target, drafter = load_models(target_dir, draft_dir)
    assert drafter is not None  # load_models reads a drafter whenever its folder is given
    return capacity_warnings(profile, plan_capacity(profile, target, drafter))


def describe(profile: BuildProfile, capacity: Capacity) -> str:
    """Human-readable lines for `plan --config`."""
    c, gb = capacity, 1e9
    isl, osl = c.shape
    return "\n".join(
        [
            f"{profile.name}: {profile.gpu} x{profile.checkpoint.tp_size}, per GPU:",
            f"  weights {c.weights_bytes / gb:.2f} GB, activations {c.activation_bytes / gb:.2f} GB (assumed), "
            f"runtime {c.runtime_bytes / gb:.2f} GB (assumed)",
            f"  KV pool {c.kv_pool_bytes / gb:.2f} GB at {profile.serving.kv_cache_free_gpu_mem_fraction:.2f} of the "
            f"free memory; {c.kv_bytes_per_token:,.0f} B per token (target + drafter layers); "
            f"{c.blocks:,} blocks of {c.tokens_per_block} tokens",
            f"  sequences that fit: {c.sequences_at_shape} at {isl}/{osl} tokens, {c.sequences_at_max_seq_len} at "
            f"max_seq_len {c.max_seq_len} (max_batch_size {profile.engine.max_batch_size})",
        ]
    )
