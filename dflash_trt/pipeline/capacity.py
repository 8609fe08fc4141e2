"""How many sequences a build profile's engine can hold in its KV pool, from the profile and the model shapes.

The memory arithmetic (weights per rank, activation and runtime reserves, KV pool, per-sequence reservation
with the EAGLE-mode step headroom) is `analysis/memory.py`'s; this module applies it to a profile's GPU, TP,
formats and engine limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_trt.analysis.gpus import get_gpu
from dflash_trt.analysis.memory import Budget, EngineLimits, blocks_per_sequence, budget, headroom_tokens
from dflash_trt.analysis.model import PRECISION, Deployment, DFlashShape, TargetShape
from dflash_trt.analysis.shapes import load_models
from dflash_trt.errors import DFlashTrtError
from dflash_trt.pipeline.profiles import BuildProfile


@dataclass(frozen=True)
class Capacity:
    """Per-GPU memory budget of one profile (`analysis.memory`'s) and the sequences its KV pool holds."""

    budget: Budget
    headroom_tokens: int
    shape: tuple[int, int]
    sequences_at_shape: int
    max_seq_len: int
    sequences_at_max_seq_len: int

    def as_json(self) -> dict:
        """One flat object: the budget's fields, then the sequences."""
        fields = {**vars(self.budget), **{k: v for k, v in vars(self).items() if k != "budget"}}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}


def profile_deployment(profile: BuildProfile) -> Deployment:
    q = profile.quantization
    return Deployment(
        get_gpu(profile.gpu), PRECISION[q.qformat], PRECISION[q.kv_cache_dtype], profile.checkpoint.tp_size
    )


def profile_limits(profile: BuildProfile) -> EngineLimits:
    eng = profile.engine
    return EngineLimits(eng.max_batch_size, eng.max_num_tokens, profile.serving.kv_cache_free_gpu_mem_fraction)


def plan_capacity(
    profile: BuildProfile, target: TargetShape, drafter: DFlashShape, shape: tuple[int, int] | None = None
) -> Capacity:
    """The profile's per-GPU budget and the sequences that fit at `shape` (ISL, OSL; default the sweep's)."""
    eng = profile.engine
    isl, osl = shape or (profile.sweep.input_len, profile.sweep.output_len)
    if isl < 1 or osl < 1:
        raise DFlashTrtError(f"input and output lengths must be positive, got {isl} and {osl}")
    dep = profile_deployment(profile)
    # A draft tree verifies its nodes over the chain's draft positions.
    k, depth = eng.draft_tree or eng.max_draft_len, eng.max_draft_len
    b = budget(target, drafter, dep, profile_limits(profile), k)
    if not b.weights_fit:
        raise DFlashTrtError(
            f"{profile.name}: weights ({b.weights_bytes / 1e9:.1f} GB), activations ({b.activation_bytes / 1e9:.1f} "
            f"GB) and the runtime reserve ({b.runtime_bytes / 1e9:.0f} GB) exceed {profile.gpu}'s "
            f"{b.memory_bytes / 1e9:.1f} GB per GPU; raise tp_size, quantize or lower max_num_tokens / max_batch_size"
        )
    tpb = b.tokens_per_block
    if b.blocks // blocks_per_sequence(eng.max_seq_len, 0, k, tpb, depth) < 1:
        # 1.2.x clampWindowSizesToFitAtLeastOneSequence would shrink the attention window below max_seq_len: a
        # cyclic cache, while KV injection writes absolute pages (docs/deployment.md).
        raise DFlashTrtError(
            f"{profile.name}: the KV pool ({b.kv_pool_bytes / 1e9:.2f} GB) cannot hold one sequence of max_seq_len "
            f"{eng.max_seq_len}, so TensorRT-LLM would shrink the attention window below it and the drafter would "
            "read KV pages never written; lower max_seq_len, raise kv_cache_free_gpu_mem_fraction or tp_size, or "
            "quantize"
        )
    return Capacity(
        budget=b,
        headroom_tokens=headroom_tokens(k, depth),
        shape=(isl, osl),
        # The engine refuses a request longer than max_seq_len, however many blocks are free.
        sequences_at_shape=0
        if isl + osl > eng.max_seq_len
        else b.blocks // blocks_per_sequence(isl, osl, k, tpb, depth),
        max_seq_len=eng.max_seq_len,
        sequences_at_max_seq_len=b.blocks // blocks_per_sequence(eng.max_seq_len, 0, k, tpb, depth),
    )


def capacity_warnings(profile: BuildProfile, capacity: Capacity) -> list[str]:
    """What a user should know before serving: a batch the pool cannot hold at the sweep's shape."""
    warnings = []
    if sum(capacity.shape) > capacity.max_seq_len:
        isl, osl = capacity.shape
        return [f"{profile.name}: {isl}/{osl} tokens exceed max_seq_len {capacity.max_seq_len}: no such request runs"]
    if capacity.sequences_at_shape < profile.engine.max_batch_size:
        isl, osl = capacity.shape
        warnings.append(
            f"{profile.name}: max_batch_size {profile.engine.max_batch_size} cannot be held at {isl}/{osl} tokens: "
            f"the KV pool fits about {capacity.sequences_at_shape} such sequences, so the scheduler will queue "
            "the rest"
        )
    return warnings


def checkpoint_warnings(profile: BuildProfile, target_dir: Path, draft_dir: Path) -> list[str]:
    """`capacity_warnings` for the checkpoints a build is about to use (only their config.json is read). A sweep
    shape longer than the engine's max_seq_len is left to `plan --config`: the build cannot tell whether that
    sweep (which defaults to 1024/1024) will ever be run against this engine."""
    if profile.sweep.input_len + profile.sweep.output_len > profile.engine.max_seq_len:
        return []
    target, drafter = load_models(target_dir, draft_dir)
    assert drafter is not None  # load_models reads a drafter whenever its folder is given
    return capacity_warnings(profile, plan_capacity(profile, target, drafter))


def describe(profile: BuildProfile, capacity: Capacity) -> str:
    """Human-readable lines for `plan --config`."""
    c, b, gb = capacity, capacity.budget, 1e9
    isl, osl = c.shape
    return "\n".join(
        [
            f"{profile.name}: {profile.gpu} x{profile.checkpoint.tp_size}, per GPU:",
            f"  weights {b.weights_bytes / gb:.2f} GB, activations {b.activation_bytes / gb:.2f} GB (assumed), "
            f"runtime {b.runtime_bytes / gb:.2f} GB (assumed)",
            f"  KV pool {b.kv_pool_bytes / gb:.2f} GB (of {b.memory_bytes / gb:.2f} GB) at "
            f"{profile.serving.kv_cache_free_gpu_mem_fraction:.2f} of the "
            f"free memory; {b.kv_bytes_per_token:,.0f} B per token (target + drafter layers); "
            f"{b.blocks:,} blocks of {b.tokens_per_block} tokens",
            f"  a sequence reserves its length + {c.headroom_tokens} tokens of step headroom "
            "((draft positions + 1) + (drafts verified + 1))",
            f"  sequences that fit: {c.sequences_at_shape} at {isl}/{osl} tokens, {c.sequences_at_max_seq_len} at "
            f"max_seq_len {c.max_seq_len} (max_batch_size {profile.engine.max_batch_size})",
        ]
    )
