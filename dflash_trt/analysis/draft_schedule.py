"""`--draft_len_schedule auto`: the draft length at each batch size that the roofline says serves the most tokens/s.

Our engine drafts its whole block in one drafter pass whatever the draft length, and verifies `K + 1` target tokens
per request (`Method` with a schedule prices exactly that). For every batch `c` up to the engine's `max_batch_size`
and every draft length `K` in 1..block - 1, a step yields `mean(K)` tokens per request (the drafter's acceptance cut
at `K` drafts) in `seconds(c, K)`, so throughput is `c * mean(K) / seconds(c, K)`; per-user speed is the same ratio
without `c`, so one `K` maximises both. Where that best `K` rises with the batch (a mixture-of-experts target at a
small batch reads more experts per verified token, so short drafts win there first), the schedule, whose draft
lengths may only fall, takes the non-increasing sequence of draft lengths with the largest mean log-throughput,
each batch weighted 1/c so that every doubling of the load counts alike.

The same derivation serves a draft-tree engine of at most `N` nodes (`nodes`): its schedule's values are node budgets
1..N (draft_schedule.py), a budget `B` verifies `B + 1` target tokens per request and yields the chain's `mean(B)` up
to the block's drafts, the best static tree's tokens past them (`tree_acceptance.tree_method`); only the yield per
value differs, so wide trees win where the step is bound by reading the weights and the chain (or less) where the
verify is compute-bound.

The acceptance is per draft position: a measured histogram or per-position rates (`plan --acceptance_json`, bench
`results.json`, `generate --json`), a given mean, or by default the lowest acceptance length the sources publish for
the pair (any dataset and temperature: the schedule then errs towards short drafts, where a shorter draft costs at
most a little speed and a longer one than the traffic supports can cost more than AR). A pair with no published
acceptance is planned with the lowest published for any DFlash drafter, and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_trt.analysis.acceptance_file import read_acceptance_file
from dflash_trt.analysis.gpus import get_gpu
from dflash_trt.analysis.harness_fits import calibration
from dflash_trt.analysis.model import (
    PRECISION,
    Acceptance,
    Deployment,
    DFlashShape,
    Method,
    TargetShape,
    mean_context,
)
from dflash_trt.analysis.published import TAU_SOURCES, TAUS
from dflash_trt.analysis.shapes import dflash_from_spec, target_from_spec
from dflash_trt.analysis.tree_acceptance import tree_method
from dflash_trt.checkpoint.trtllm_config import specs_from_config
from dflash_trt.decoding_modes import AR, DFLASH
from dflash_trt.draft_schedule import FIXED, DraftLenSchedule
from dflash_trt.formats import FP8, NONE, quant_algo
from dflash_trt.inputs import draft_tree_nodes
from dflash_trt.jsonfile import read_json_object
from dflash_trt.trtllm.checkpoint_facts import read_checkpoint_facts, weights_qformat

# The harness whose committed calibration prices our engine's steps (TensorRT-LLM's C++ executor).
ENGINE_HARNESS = "trtllm"


@dataclass(frozen=True)
class ScheduleRow:
    """One batch size: the draft length the schedule takes and the predicted output tok/s (whole engine) of AR, of
    DFlash at the full draft length and of DFlash under the schedule."""

    batch: int
    draft_len: int
    best_draft_len: int
    fixed_draft_len: int  # the engine's full draft length, block - 1
    ar_tok_s: float
    fixed_tok_s: float
    scheduled_tok_s: float
    best_tok_s: float  # at the best draft length for this batch alone

    def as_json(self) -> dict:
        return dict(vars(self))


@dataclass(frozen=True)
class DerivedSchedule:
    schedule: DraftLenSchedule
    rows: tuple[ScheduleRow, ...]  # batch 1, 2, ..., max_batch_size

    def worst_vs_ar(self) -> ScheduleRow:
        return min(self.rows, key=lambda r: r.scheduled_tok_s / r.ar_tok_s)


def scheduled_method(
    drafter: DFlashShape, acceptance: Acceptance, schedule: DraftLenSchedule, nodes: int = 0
) -> Method:
    """Our engine under `schedule` (`none`: the full draft length every step), with the full block's acceptance;
    with `nodes`, the draft-tree engine of at most that many nodes, the schedule's values its node budgets."""
    if nodes:
        return tree_method(DFLASH, drafter, acceptance, nodes, schedule)
    return Method(DFLASH, drafter, acceptance.resized(drafter.block_size), schedule)


def _throughputs(method: Method, target: TargetShape, dep: Deployment, ctx: float, batch: int) -> list[float]:
    """tok/s of the whole engine at `batch` for every value its schedule may take: draft lengths 1..block - 1, or a
    tree engine's node budgets 1..N (index value - 1)."""
    assert isinstance(method.drafter, DFlashShape)
    out = []
    for value in range(1, (method.draft_tree or method.drafter.block_size - 1) + 1):
        it = replace(method, schedule=DraftLenSchedule(((1, value),))).iteration(target, batch, ctx, dep)
        out.append(batch * it.tokens_per_seq / it.seconds)
    return out


def non_increasing_choice(scores: list[list[float]]) -> list[int]:
    """Index per row maximising the sum of `scores[row][index]` with the index never rising from row to row."""
    best = list(scores[0])
    choice: list[list[int]] = []
    for row in scores[1:]:
        # Best total so far for an index >= j, and which index gives it (scan from the largest index down).
        suffix, arg, back = [0.0] * len(best), [0] * len(best), len(best) - 1
        for j in range(len(best) - 1, -1, -1):
            if best[j] >= best[back]:
                back = j
            suffix[j], arg[j] = best[back], back
        choice.append(arg)
        best = [suffix[j] + row[j] for j in range(len(row))]
    index = max(range(len(best)), key=lambda j: (best[j], j))
    path = [index]
    for arg in reversed(choice):
        index = arg[index]
        path.append(index)
    return path[::-1]


def _row(
    target: TargetShape, dep: Deployment, ctx: float, batch: int, draft_len: int, throughputs: list[float]
) -> ScheduleRow:
    return ScheduleRow(
        batch=batch,
        draft_len=draft_len,
        best_draft_len=throughputs.index(max(throughputs)) + 1,
        fixed_draft_len=len(throughputs),
        ar_tok_s=batch / Method(AR).iteration(target, batch, ctx, dep).seconds,
        fixed_tok_s=throughputs[-1],
        scheduled_tok_s=throughputs[draft_len - 1],
        best_tok_s=max(throughputs),
    )


def compare_schedule(
    target: TargetShape,
    drafter: DFlashShape,
    acceptance: Acceptance,
    schedule: DraftLenSchedule,
    dep: Deployment,
    ctx: float,
    batches: list[int],
    nodes: int = 0,
) -> tuple[ScheduleRow, ...]:
    """AR, the full draft length (a tree engine's `nodes`) and `schedule` side by side at each batch."""
    method = scheduled_method(drafter, acceptance, FIXED, nodes)
    longest = nodes or drafter.block_size - 1
    return tuple(
        _row(target, dep, ctx, c, schedule.draft_len(c, longest), _throughputs(method, target, dep, ctx, c))
        for c in batches
    )


def derive_schedule(
    target: TargetShape,
    drafter: DFlashShape,
    acceptance: Acceptance,
    dep: Deployment,
    ctx: float,
    max_batch_size: int,
    nodes: int = 0,
) -> DerivedSchedule:
    """The `auto` schedule for batches 1..`max_batch_size` and the predictions behind it; with `nodes`, a draft-tree
    engine's node budgets (at most `nodes`)."""
    k_max = nodes or drafter.block_size - 1
    batches = range(1, max_batch_size + 1)
    method = scheduled_method(drafter, acceptance, FIXED, nodes)
    tps = [_throughputs(method, target, dep, ctx, c) for c in batches]
    scores = [[math.log(t) / c for t in row] for c, row in zip(batches, tps, strict=True)]
    chosen = [i + 1 for i in non_increasing_choice(scores)]
    steps, previous = [], k_max
    for c, k in zip(batches, chosen, strict=True):
        if k != previous:
            steps.append((c, k))
            previous = k
    rows = tuple(_row(target, dep, ctx, c, k, row) for c, k, row in zip(batches, chosen, tps, strict=True))
    return DerivedSchedule(DraftLenSchedule(tuple(steps)), rows)


# The lowest acceptance length published for any DFlash drafter (pair, dataset, temperature): the stated assumption
# for a pair whose own acceptance nobody published.
LOWEST_PUBLISHED = min((tau, pair) for pair, taus in TAUS.items() for tau in taus.values())


def default_acceptance(pair: str | None, block: int) -> tuple[Acceptance, str]:
    """The acceptance `auto` plans with when none is given: the pair's lowest published acceptance length, or
    (assumed) the lowest published for any DFlash drafter; read as measured with the drafter's full block."""
    if pair in TAUS:
        (dataset, temperature), tau = min(TAUS[pair].items(), key=lambda item: item[1])
        shown = "not stated" if temperature is None else f"{temperature:g}"
        note = f"acceptance length {tau} (the lowest {pair} publishes: {dataset}, T={shown}; {TAU_SOURCES[pair]})"
        return Acceptance.from_mean(tau, block), note
    tau, source = LOWEST_PUBLISHED
    note = (
        f"acceptance length {tau} assumed: nothing is published for this pair, so the lowest any DFlash drafter "
        f"publishes ({source}); measure yours (generate or emulate --json) and plan with it (--acceptance_json)"
    )
    return Acceptance.from_mean(tau, block), note


def checkpoint_schedule(
    checkpoint_dir: Path,
    gpu: str,
    max_batch_size: int,
    acceptance_file: Path | None = None,
    lengths: tuple[int, int] = (1024, 1024),
    nodes: int | None = None,
) -> tuple[DerivedSchedule, str]:
    """`auto` for an engine built from a converted checkpoint on `gpu` (`nodes`: `--draft_tree`, None the chain):
    its shapes, TP and formats from its config.json, TensorRT-LLM's committed calibration, and the acceptance
    measured in `acceptance_file` (else the stated assumption: a converted checkpoint does not name its pair).
    Returns the schedule and a note."""
    facts = read_checkpoint_facts(checkpoint_dir)
    config = read_json_object(Path(checkpoint_dir) / "config.json", f"{checkpoint_dir} has no config.json")
    target_spec, draft_spec = specs_from_config(config)
    target, drafter = target_from_spec(target_spec), dflash_from_spec(draft_spec)
    tree = draft_tree_nodes(nodes, drafter.block_size - 1, draft_spec.dflash2 is not None)
    if acceptance_file is not None:
        acceptance = read_acceptance_file(acceptance_file, drafter.block_size)
        note = f"acceptance from {acceptance_file}, measured with {acceptance.max_length - 1} drafts per step"
    else:
        acceptance, note = default_acceptance(None, drafter.block_size)
    kv = FP8 if facts.kv_cache_quant_algo == quant_algo(FP8) else NONE
    dep = Deployment(
        get_gpu(gpu), PRECISION[weights_qformat(facts)], PRECISION[kv], facts.tp_size, calibration(ENGINE_HARNESS)
    )
    derived = derive_schedule(target, drafter, acceptance, dep, mean_context(*lengths), max_batch_size, tree)
    budgets = f", node budgets of a draft tree of at most {tree} nodes" if tree else ""
    where = (
        f"auto: {ENGINE_HARNESS} calibration, {gpu} x{facts.tp_size}, {lengths[0]}/{lengths[1]} tokens, batches "
        f"1..{max_batch_size}{budgets}, {note}"
    )
    return derived, where
