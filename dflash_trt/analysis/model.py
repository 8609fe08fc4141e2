"""Roofline performance model of one decoding iteration for AR, EAGLE-3-like and DFlash speculative decoding.

Each forward pass costs max(bytes / achievable bandwidth, FLOPs / achievable tensor rate) per GPU, plus its
tensor-parallel collectives (all-reduces and the lm_head's logits all-gather, priced by `comm.py`); each
iteration adds the fitted overheads of the harness that runs it (`Calibration`). Bytes are weights read once per
pass (for MoE only the experts the pass's tokens touch), KV-cache reads and the lm_head; FLOPs are 2 x params x
tokens plus attention. An iteration is: AR = one target pass of 1 token per sequence; DFlash = target verify of
B tokens + one drafter pass over the B-token block (+ KV injection of the accepted tokens' taps, + the target
lm_head on B-1 rows); EAGLE-3 = target verify of K+1 tokens + K sequential one-layer drafter passes. Tokens per
iteration come from an acceptance-length distribution (measured by the golden model, reported by trtllm-bench,
or given). `Method.step` is the per-step cost, a function of batch, tokens verified, context and deployment.

Peaks come from `gpus.py`; achievable fractions and overheads are `Calibration` constants. Which constant is a
datasheet figure, an assumption or a fit (and on which published rows) is listed by `provenance.py`; the fits
themselves, on rows chosen before fitting, are in `harness_fits.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dflash_trt.analysis.comm import ALGORITHMS, INTERCONNECTS, Interconnect, allgather_seconds, allreduce_seconds
from dflash_trt.analysis.gpus import GpuSpec
from dflash_trt.analysis.pareto import Point
from dflash_trt.draft_schedule import FIXED, DraftLenSchedule
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import BYTES_PER_WEIGHT, FP8, NONE, NVFP4

# The GEMM input precision of each --qformat / --kv_cache_dtype ("none" keeps 16-bit weights and caches).
PRECISION = {NONE: "bf16", FP8: "fp8", NVFP4: "nvfp4"}
# MXFP4 (gpt-oss's released expert format, met only in published rows): 4 bits + one e8m0 scale per 32.
WEIGHT_BYTES = {**{PRECISION[qformat]: size for qformat, size in BYTES_PER_WEIGHT.items()}, "mxfp4": 0.53125}
KV_BYTES = {"bf16": 2.0, "fp8": 1.0}
ACTIVATION_BYTES = 2.0  # all-reduce payloads and tap features stay bf16
LM_HEAD_BYTES = 2.0  # the lm_head is left unquantized (modelopt excludes it by default)


@dataclass(frozen=True)
class StackShape:
    """The cost-relevant dimensions of a stack of transformer decoder layers."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int = 0  # 0 = dense MLP
    experts_per_token: int = 0
    sliding_window: int | None = None
    num_sliding_layers: int = 0
    attn_input: int | None = None  # q/k/v input width when it is not `hidden` (EAGLE-3's 2H first layer)

    def attn_params(self) -> int:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (self.attn_input or self.hidden) * (q + 2 * kv) + q * self.hidden

    def kv_proj_params(self) -> int:
        return self.hidden * 2 * self.num_kv_heads * self.head_dim

    def expert_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def layer_params(self, active: bool) -> int:
        """Weights of one layer: all experts (`active=False`) or only those one token runs through."""
        experts = (self.experts_per_token if active else self.num_experts) if self.num_experts else 1
        return self.attn_params() + experts * self.expert_params() + self.hidden * self.num_experts

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts one layer reads for `tokens` tokens, routing taken as uniform."""
        if not self.num_experts:
            return 1.0
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens)


@dataclass(frozen=True)
class TargetShape:
    """A target LM; MoE targets express their active parameters per token through the stack's expert fields."""

    stack: StackShape
    vocab: int
    tied_embeddings: bool = False

    def params(self, active: bool = False) -> int:
        """Decoder-layer weights plus embeddings and lm_head (one matrix when tied)."""
        embeddings = self.vocab * self.stack.hidden * (1 if self.tied_embeddings else 2)
        return self.stack.num_layers * self.stack.layer_params(active) + embeddings


@dataclass(frozen=True)
class DFlashShape:
    stack: StackShape
    num_taps: int
    block_size: int


@dataclass(frozen=True)
class Eagle3Shape:
    """One decoder layer fed concat(embedding, fused taps); proposes `steps` tokens autoregressively."""

    stack: StackShape
    num_taps: int
    draft_vocab: int
    steps: int


# The fitted terms of one iteration's time, in the order `StepCost.terms` lists what each multiplies.
OVERHEAD_FIELDS = (
    "collective_slowdown",
    "step_overhead_s",
    "spec_overhead_s",
    "sequence_overhead_s",
    "token_overhead_s",
)


@dataclass(frozen=True)
class Calibration:
    """How much of the peaks real kernels reach, and what a serving runtime adds that a roofline cannot see.

    `bandwidth_efficiency` and `compute_efficiency` are assumptions (typical large-kernel fractions), not fits.
    The rest is what `evaluation` (published points) or `calibrate` (a user's own bench results) fits per
    harness, each term multiplying one count of `StepCost`: `collective_slowdown` (the isolated all-reduce
    kernels' time, priced by `comm.py`, times this: rank skew and launch gaps inside a real step; 1 = the kernels
    alone), `step_overhead_s` (every iteration, AR included: launches, scheduling, host sync),
    `spec_overhead_s` (extra per speculative iteration: acceptance, cache rewind, draft inputs),
    `sequence_overhead_s` (per sequence in the batch, per iteration: per-request bookkeeping and sampling) and
    `token_overhead_s` (per token the target takes: a sequence's 1 token in AR, its whole verified block in
    speculation). `error_band` is the relative error a prediction made with it carries (fit residuals and the
    harness's drift between versions, `band_source` says how it was derived); `source` says where the values
    came from, so every prediction carries it.
    """

    name: str = "default"
    source: str = "assumed defaults, no overhead fitted"
    bandwidth_efficiency: float = 0.80
    compute_efficiency: float = 0.60
    collective_slowdown: float = 1.0
    step_overhead_s: float = 0.0
    spec_overhead_s: float = 0.0
    sequence_overhead_s: float = 0.0
    token_overhead_s: float = 0.0
    error_band: float = 0.0
    band_source: str = "no error band: nothing was fitted"
    allreduce_algorithm: str = "trtllm-auto"  # the runtime's custom-kernel / NCCL switch (comm.ALGORITHMS)

    def seconds(self, cost: StepCost) -> float:
        """The iteration's time: the roofline, plus every fitted term times the count it multiplies."""
        return cost.roofline_s + sum(getattr(self, f) * t for f, t in zip(OVERHEAD_FIELDS, cost.terms(), strict=True))


@dataclass(frozen=True)
class Deployment:
    gpu: GpuSpec
    precision: str = "bf16"  # weight (and GEMM input) precision of target and drafter
    kv_dtype: str = "bf16"
    tp: int = 1
    calibration: Calibration = Calibration()

    def __post_init__(self) -> None:
        if self.precision not in WEIGHT_BYTES:
            raise DFlashTrtError(f"unknown precision {self.precision!r} (known: {', '.join(WEIGHT_BYTES)})")
        if self.kv_dtype not in KV_BYTES:
            raise DFlashTrtError(f"unknown KV-cache dtype {self.kv_dtype!r} (known: {', '.join(KV_BYTES)})")
        if self.tp < 1:
            raise DFlashTrtError(f"tp must be >= 1, got {self.tp}")
        if self.calibration.allreduce_algorithm not in ALGORITHMS:
            known = ", ".join(ALGORITHMS)
            raise DFlashTrtError(
                f"unknown all-reduce algorithm {self.calibration.allreduce_algorithm!r} (known: {known})"
            )
        self.gpu.dense_flops(self.precision)  # refuses NVFP4 on Hopper

    @property
    def link(self) -> Interconnect:
        return INTERCONNECTS[self.gpu.interconnect]


@dataclass(frozen=True)
class Acceptance:
    """Distribution of tokens one verify step yields (accepted drafts + the bonus token): probs[n-1] = P(n)."""

    probs: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.probs or any(p < 0 or not math.isfinite(p) for p in self.probs):
            raise DFlashTrtError("acceptance distribution must be non-empty and non-negative")
        if abs(sum(self.probs) - 1.0) > 1e-6:
            raise DFlashTrtError(f"acceptance probabilities must sum to 1, got {sum(self.probs):.6f}")

    @property
    def max_length(self) -> int:
        return len(self.probs)

    def mean(self) -> float:
        return sum((n + 1) * p for n, p in enumerate(self.probs))

    @classmethod
    def from_histogram(cls, counts: Sequence[float]) -> Acceptance:
        """counts[n-1] = number of verify steps that produced n tokens (as the golden model reports them)."""
        total = float(sum(counts))
        if total <= 0:
            raise DFlashTrtError("acceptance histogram is empty")
        return cls(tuple(c / total for c in counts))

    @classmethod
    def from_position_rates(cls, rates: Sequence[float]) -> Acceptance:
        """rates[i] = P(draft i+1 accepted | drafts 1..i accepted), the per-position acceptance of a block."""
        probs, alive = [], 1.0
        for r in rates:
            if not 0.0 <= r <= 1.0:
                raise DFlashTrtError(f"per-position acceptance rates must lie in [0, 1], got {r}")
            probs.append(alive * (1.0 - r))
            alive *= r
        return cls((*probs, alive))

    @classmethod
    def from_mean(cls, mean: float, max_length: int) -> Acceptance:
        """The truncated-geometric distribution (same acceptance rate at every position) with this mean."""
        if max_length < 1 or not 1.0 <= mean <= max_length:
            raise DFlashTrtError(f"mean acceptance length {mean} must lie in [1, {max_length}]")
        if max_length == 1 or mean == 1.0:
            return cls.from_position_rates([0.0] * (max_length - 1))
        lo, hi = 0.0, 1.0
        for _ in range(100):
            mid = (lo + hi) / 2
            if cls.from_position_rates([mid] * (max_length - 1)).mean() < mean:
                lo = mid
            else:
                hi = mid
        return cls.from_position_rates([(lo + hi) / 2] * (max_length - 1))

    def resized(self, max_length: int) -> Acceptance:
        """The same drafter run with `max_length - 1` drafts: a shorter draft stops every longer run at
        `max_length`; a longer one continues at the acceptance rate of the last measured draft position (an
        assumption: the rate past what was measured is unknown; a truncated geometric keeps its one rate)."""
        if max_length < 1:
            raise DFlashTrtError("max_length must be >= 1")
        if max_length <= self.max_length:
            head = list(self.probs[: max_length - 1])
            return Acceptance((*head, 1.0 - sum(head)))
        rates = [self.conditional_rate(i) for i in range(self.max_length - 1)]
        last = rates[-1] if rates else 0.0
        return Acceptance.from_position_rates(rates + [last] * (max_length - self.max_length))

    def conditional_rate(self, position: int) -> float:
        """P(draft `position` + 1 accepted | drafts 1..`position` accepted); 0 where no run gets that far."""
        reached = sum(self.probs[position:])
        return sum(self.probs[position + 1 :]) / reached if reached > 0 else 0.0


@dataclass(frozen=True)
class PassCost:
    """Per-GPU work of one forward pass, and the collectives tensor parallelism adds to it."""

    bytes: float
    linear_flops: float
    attention_flops: float
    allreduce_calls: int
    allreduce_bytes: float  # per call: every token's hidden state, bf16
    gather_bytes: float  # the lm_head's logits gathered across the vocabulary split (0 without TP or logits)


def stack_pass(
    stack: StackShape, batch: int, q: int, ctx: float, dep: Deployment, logits_rows: int, vocab: int
) -> PassCost:
    """`batch` sequences each feeding `q` new tokens on top of `ctx` cached ones, then `logits_rows` lm_head rows."""
    tp = dep.tp
    tokens = batch * q
    wbytes = WEIGHT_BYTES[dep.precision]
    mlp_read = stack.experts_touched(tokens) * stack.expert_params()
    router = stack.hidden * stack.num_experts
    weight_bytes = stack.num_layers * ((stack.attn_params() + mlp_read) * wbytes + router * ACTIVATION_BYTES)
    mlp_used = stack.expert_params() * (stack.experts_per_token if stack.num_experts else 1)
    linear = 2.0 * tokens * stack.num_layers * (stack.attn_params() + mlp_used + router)
    kv_heads_per_gpu = max(stack.num_kv_heads / tp, 1.0)
    kv_row = 2 * kv_heads_per_gpu * stack.head_dim * KV_BYTES[dep.kv_dtype]
    full_layers = stack.num_layers - stack.num_sliding_layers
    window = stack.sliding_window or 0
    seen = [(full_layers, ctx + q), (stack.num_sliding_layers, min(ctx, window) + q)]
    kv_bytes = sum(n * batch * keys * kv_row for n, keys in seen)
    attention = sum(4.0 * n * tokens * keys * stack.num_heads * stack.head_dim for n, keys in seen)
    lm_bytes = vocab * stack.hidden * LM_HEAD_BYTES if logits_rows else 0.0
    lm_flops = 2.0 * logits_rows * vocab * stack.hidden
    split = tp > 1
    return PassCost(
        bytes=(weight_bytes + lm_bytes) / tp + kv_bytes,
        linear_flops=(linear + lm_flops) / tp,
        attention_flops=attention / tp,
        allreduce_calls=2 * stack.num_layers if split else 0,
        allreduce_bytes=tokens * stack.hidden * ACTIVATION_BYTES,
        gather_bytes=logits_rows * vocab * ACTIVATION_BYTES if split else 0.0,
    )


def roofline_seconds(cost: PassCost, dep: Deployment) -> float:
    """max(bytes over achievable bandwidth, FLOPs over achievable tensor rate) for one GPU."""
    cal, gpu = dep.calibration, dep.gpu
    memory = cost.bytes / (gpu.hbm_bandwidth * cal.bandwidth_efficiency)
    compute = (
        cost.linear_flops / gpu.dense_flops(dep.precision) + cost.attention_flops / gpu.bf16_flops
    ) / cal.compute_efficiency
    return max(memory, compute)


def collective_seconds(cost: PassCost, dep: Deployment) -> float:
    """The pass's all-reduces and logits all-gather as isolated kernels on the GPU's interconnect."""
    link, tp = dep.link, dep.tp
    algorithm = dep.calibration.allreduce_algorithm
    reduces = cost.allreduce_calls * allreduce_seconds(link, tp, cost.allreduce_bytes, algorithm)
    gather = allgather_seconds(link, tp, cost.gather_bytes) if cost.gather_bytes else 0.0
    return reduces + gather


@dataclass(frozen=True)
class StepCost:
    """One decoding iteration, split into what the hardware prices (roofline, isolated collectives) and the counts
    a harness's fitted overheads multiply; the public per-step cost a draft-length schedule compares."""

    roofline_s: float
    collective_s: float
    sequences: int
    target_tokens: int
    speculative: bool

    def terms(self) -> tuple[float, ...]:
        """What each of `OVERHEAD_FIELDS` multiplies, in that order."""
        return (self.collective_s, 1.0, float(self.speculative), float(self.sequences), float(self.target_tokens))


def _passes(costs: Sequence[PassCost], dep: Deployment) -> tuple[float, float]:
    return sum(roofline_seconds(c, dep) for c in costs), sum(collective_seconds(c, dep) for c in costs)


def ar_step(target: TargetShape, batch: int, ctx: float, dep: Deployment) -> StepCost:
    """One AR iteration: a target pass of 1 token per sequence."""
    roof, comm = _passes([stack_pass(target.stack, batch, 1, ctx, dep, batch, target.vocab)], dep)
    return StepCost(roof, comm, batch, batch, speculative=False)


def dflash_step(
    target: TargetShape,
    drafter: DFlashShape,
    batch: int,
    verify_tokens: int,
    injected_tokens: float,
    ctx: float,
    dep: Deployment,
    drafter_tokens: int | None = None,
    tree: bool = False,
) -> StepCost:
    """One DFlash iteration verifying `verify_tokens` (= draft length + 1) per sequence: the target verify, one
    drafter pass over `drafter_tokens` block positions (lm_head on all but the anchor's row) and the KV injection of
    `injected_tokens` accepted tokens per sequence (fc over their taps, then every draft layer's K/V projection).
    `drafter_tokens` defaults to `verify_tokens` (a runtime that sizes the block by the draft length); our engine
    drafts its whole block whatever the draft length, so a draft-length schedule passes the block size, and so does
    a draft tree, which verifies its N nodes + 1 (more than the block: `tree` True)."""
    width = verify_tokens if drafter_tokens is None else drafter_tokens
    if not 1 <= width <= drafter.block_size or not (width < verify_tokens if tree else 1 <= verify_tokens <= width):
        raise DFlashTrtError(
            f"a DFlash step verifies 1..{drafter.block_size} tokens (the block; a tree more) and drafts the block, got "
            f"{verify_tokens} verified of {width} drafted"
        )
    verify = stack_pass(target.stack, batch, verify_tokens, ctx, dep, batch * verify_tokens, target.vocab)
    draft = stack_pass(drafter.stack, batch, width, ctx, dep, batch * (width - 1), target.vocab)
    injected = batch * injected_tokens
    h = drafter.stack.hidden
    fc_params = drafter.num_taps * h * h
    tap_bytes = injected * drafter.num_taps * h * ACTIVATION_BYTES
    inject_bytes = (fc_params * WEIGHT_BYTES[dep.precision] + tap_bytes) / dep.tp
    inject_flops = 2.0 * injected * (fc_params + drafter.stack.num_layers * drafter.stack.kv_proj_params()) / dep.tp
    draft = replace(draft, bytes=draft.bytes + inject_bytes, linear_flops=draft.linear_flops + inject_flops)
    roof, comm = _passes([verify, draft], dep)
    return StepCost(roof, comm, batch, batch * verify_tokens, speculative=True)


def eagle3_step(target: TargetShape, drafter: Eagle3Shape, batch: int, ctx: float, dep: Deployment) -> StepCost:
    """One EAGLE-3 iteration: the target verify of `steps` + 1 tokens and `steps` sequential one-layer drafter
    passes (the first also runs the fc over the fused taps)."""
    width = drafter.steps + 1
    verify = stack_pass(target.stack, batch, width, ctx, dep, batch * width, target.vocab)
    step = stack_pass(drafter.stack, batch, 1, ctx, dep, batch, drafter.draft_vocab)
    h = drafter.stack.hidden
    fc = drafter.num_taps * h * h
    fused = replace(
        step,
        bytes=step.bytes + fc * WEIGHT_BYTES[dep.precision] / dep.tp,
        linear_flops=step.linear_flops + 2.0 * batch * fc / dep.tp,
    )
    roof, comm = _passes([verify, fused] + [step] * (drafter.steps - 1), dep)
    return StepCost(roof, comm, batch, batch * width, speculative=True)


@dataclass(frozen=True)
class Iteration:
    """One decoding iteration at one batch size: its time, what it yields per sequence and its cost split."""

    seconds: float
    tokens_per_seq: float
    cost: StepCost

    def tok_s_user(self) -> float:
        return self.tokens_per_seq / self.seconds


@dataclass(frozen=True)
class Method:
    """What runs: AR (no drafter), DFlash or EAGLE-3, with the acceptance it achieves. A DFlash method with a
    draft-length `schedule` is our engine: its acceptance is the full block's, each batch verifies the schedule's
    draft length (the acceptance cut to it) and the drafter always runs the whole block."""

    name: str
    drafter: DFlashShape | Eagle3Shape | None = None
    acceptance: Acceptance | None = None
    schedule: DraftLenSchedule | None = None
    # Draft trees of at most N nodes (our engine's `--draft_tree`): a step with a node budget of B (the schedule's
    # value for the batch, else N) verifies B + 1 tokens and yields `tree_tokens[B - 1]` (bonus included; up to the
    # block's drafts the chain's; `tree_acceptance.tree_method` sets both from the acceptance).
    draft_tree: int | None = None
    tree_tokens: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if (self.draft_tree is None) != (self.tree_tokens is None):
            raise DFlashTrtError(f"{self.name}: a draft tree needs its node count and its tokens per step")
        if self.draft_tree is not None and not isinstance(self.drafter, DFlashShape):
            raise DFlashTrtError(f"{self.name}: draft trees are a DFlash engine's")
        if self.tree_tokens is not None and len(self.tree_tokens) != self.draft_tree:
            raise DFlashTrtError(f"{self.name}: a tree of {self.draft_tree} nodes needs tokens for every budget")

    def tree_budget(self, batch: int) -> int:
        """Nodes a tree engine verifies per request at this batch: the schedule's value, else all its nodes."""
        assert self.draft_tree is not None
        return (self.schedule or FIXED).draft_len(batch, self.draft_tree)

    def tokens_per_step(self, batch: int) -> float:
        """Tokens a sequence keeps per step (bonus included): the acceptance's mean, or the tree budget's."""
        if self.tree_tokens is not None:
            return self.tree_tokens[self.tree_budget(batch) - 1]
        acceptance = self.acceptance_at(batch)
        return 1.0 if acceptance is None else acceptance.mean()

    def acceptance_at(self, batch: int) -> Acceptance | None:
        """The acceptance of one step at this batch: the schedule's draft length cuts longer accepted runs."""
        if self.schedule is None or self.acceptance is None or not isinstance(self.drafter, DFlashShape):
            return self.acceptance
        if self.draft_tree is not None:
            return self.acceptance
        return self.acceptance.resized(self.schedule.draft_len(batch, self.drafter.block_size - 1) + 1)

    def step(self, target: TargetShape, batch: int, ctx: float, dep: Deployment) -> StepCost:
        if self.drafter is None:
            return ar_step(target, batch, ctx, dep)
        acceptance = self.acceptance_at(batch)
        if acceptance is None:
            raise DFlashTrtError(f"{self.name}: a speculative method needs an acceptance distribution")
        width = acceptance.max_length
        if isinstance(self.drafter, DFlashShape):
            if width > self.drafter.block_size:
                raise DFlashTrtError(
                    f"acceptance lengths reach {width} but the drafter's block size is {self.drafter.block_size}"
                )
            if self.draft_tree is not None:  # a budget past the block's drafts is a tree, verified beside the block
                verify, drafted = self.tree_budget(batch) + 1, self.drafter.block_size
                tokens = self.tokens_per_step(batch)
                return dflash_step(target, self.drafter, batch, verify, tokens, ctx, dep, drafted, verify > drafted)
            block = None if self.schedule is None else self.drafter.block_size
            return dflash_step(target, self.drafter, batch, width, acceptance.mean(), ctx, dep, block)
        steps = self.drafter.steps
        if width > steps + 1:
            raise DFlashTrtError(f"acceptance lengths reach {width} but {steps} drafts yield at most {steps + 1}")
        return eagle3_step(target, self.drafter, batch, ctx, dep)

    def iteration(self, target: TargetShape, batch: int, ctx: float, dep: Deployment) -> Iteration:
        cost = self.step(target, batch, ctx, dep)
        return Iteration(dep.calibration.seconds(cost), self.tokens_per_step(batch), cost)


def mean_context(input_len: int, output_len: int) -> float:
    """Average cached length over a request's decode phase."""
    return input_len + output_len / 2.0


def predict_curve(
    method: Method, target: TargetShape, dep: Deployment, concurrencies: Sequence[int], ctx: float
) -> list[Point]:
    """Predicted (tok/s/user = 1/TPOT, tok/s/GPU) at each concurrency, steady state, all sequences decoding."""
    points = []
    for c in concurrencies:
        it = method.iteration(target, c, ctx, dep)
        points.append(Point(method.name, c, it.tok_s_user(), c * it.tokens_per_seq / it.seconds / dep.tp))
    return points
