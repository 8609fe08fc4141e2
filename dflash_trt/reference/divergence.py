"""Tie-aware comparison of another implementation's decoding (the emulated or a real engine) with the golden loop.

Two correct implementations of the same network round differently (another CPU kernel set, bf16 against fp32, FP8
inputs crossing a rounding boundary), so at a position where the golden model's two best logits are closer than the
precision resolves, either may win the argmax and everything after it differs. Such a first divergence is a labelled
near-tie; a divergence where the golden margin is wider than the resolution, or one no margin explains (sampled
tokens, acceptance lengths, a length), is a failure.

The golden run may be given more tokens than the other (K more lets it verify a full block wherever the engine
does): tokens are compared over the other's budget, drafts and acceptance on the steps where the golden block was
full, and the other's last acceptance length may be clipped by its budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.formats import resolution
from dflash_trt.reference.decode import SequenceResult
from dflash_trt.reference.model import GoldenModel


@dataclass(frozen=True)
class Divergence:
    """The first difference in one sequence, with the golden model's top-2 logit margin where one applies."""

    sequence: int
    what: str
    margin: float | None = None
    resolution: float = 0.0

    @property
    def near_tie(self) -> bool:
        return self.margin is not None and self.margin <= self.resolution

    def __str__(self) -> str:
        if self.margin is None:
            return f"sequence {self.sequence}: {self.what} (failure)"
        verdict = "near-tie" if self.near_tie else "failure"
        relation = "<=" if self.near_tie else ">"
        return (
            f"sequence {self.sequence}: {self.what}; golden top-2 margin {self.margin:.3g} {relation} "
            f"resolution {self.resolution:.3g} ({verdict})"
        )


def failures(divergences: list[Divergence]) -> list[Divergence]:
    """The divergences that are not near-ties."""
    return [d for d in divergences if not d.near_tie]


def _top2(logits: torch.Tensor, relative: float) -> tuple[float, float]:
    """(top-1 minus top-2 logit, the resolution at the top logit's magnitude)."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1]), relative * max(1.0, abs(float(top[0])))


def _target_logits(model: GoldenModel, tokens: list[int]) -> torch.Tensor:
    """The golden target's logits `[len(tokens), vocab]` over `tokens`, from an empty cache."""
    ids = torch.tensor([tokens])
    positions = torch.arange(len(tokens))[None]
    logits, _ = model.target.forward(
        ids, positions, torch.ones_like(ids, dtype=torch.bool), model.target.new_cache(1, len(tokens))
    )
    return logits[0]


def _draft_scores(model: GoldenModel, tokens: list[int]) -> torch.Tensor:
    """The golden drafter's scores `[drafts, candidates]` for the block anchored at `tokens[-1]` (context: the
    rest): its logits, or a DFlash2 selector's candidate scores along its chain. Each slot's draft is their argmax."""
    block, start = model.draft.spec.block_size, len(tokens) - 1
    ids = torch.tensor([tokens[:start]])
    positions = torch.arange(start)[None]
    valid = torch.ones_like(ids, dtype=torch.bool)
    _, taps = model.target.forward(ids, positions, valid, model.target.new_cache(1, start))
    cache = model.draft.new_cache(1, start + block)
    model.draft.inject(taps, positions, valid, cache)
    block_ids = torch.full((1, block), model.draft.spec.mask_token_id, dtype=torch.long)
    block_ids[0, 0] = tokens[-1]
    hidden = model.draft.forward(block_ids, torch.tensor([start]), torch.ones(1, block, dtype=torch.bool), cache)
    return model.draft.choose(hidden, block_ids[:, 0]).scores[0]


def _first_token_difference(golden: list[int], other: list[int]) -> int | None:
    for j, (g, o) in enumerate(zip(golden, other, strict=False)):
        if g != o:
            return j
    return None if len(golden) == len(other) else min(len(golden), len(other))


def _sequence_divergence(
    model: GoldenModel, index: int, golden: SequenceResult, other: SequenceResult, budget: int, greedy: bool
) -> Divergence | None:
    relative = resolution(model.config)
    expected = golden.output_ids[:budget]
    token = _first_token_difference(expected, other.output_ids)

    def token_divergence(j: int) -> Divergence:
        what = f"token {j}: {other.output_ids[j : j + 1]} != golden {expected[j : j + 1]}"
        if not greedy or j >= min(len(expected), len(other.output_ids)):
            return Divergence(index, what)
        margin, scale = _top2(_target_logits(model, golden.input_ids + expected[:j])[-1], relative)
        return Divergence(index, what, margin, scale)

    if token == 0:
        return token_divergence(0)
    if len(golden.steps) < len(other.steps):
        return Divergence(index, f"{len(other.steps)} steps, the golden loop took {len(golden.steps)}")
    produced = 1  # the context step's token
    full = model.draft.spec.num_drafts
    last = len(other.acceptance_lengths) - 1
    for step, (g_len, o_len) in enumerate(zip(golden.acceptance_lengths, other.acceptance_lengths, strict=False)):
        g_step = golden.steps[step]
        o_step = other.steps[step] if step < len(other.steps) else None
        g_full = g_step.drafted_positions == full
        if o_step is not None and g_full and g_step.parents is not None and o_step.parents != g_step.parents:
            return Divergence(index, f"step {step}: draft tree parents {o_step.parents} != golden {g_step.parents}")
        if o_step is not None and g_full and o_step.draft_ids != g_step.draft_ids:
            slot = next(
                (d for d, (g, o) in enumerate(zip(g_step.draft_ids, o_step.draft_ids, strict=False)) if g != o),
                min(len(g_step.draft_ids), len(o_step.draft_ids)),
            )
            what = f"step {step} draft {slot}: {o_step.draft_ids} != golden {g_step.draft_ids}"
            if slot >= min(len(g_step.draft_ids), len(o_step.draft_ids)) or g_step.parents is not None:
                return Divergence(index, what)  # a tree's node rides on log-probability sums, not one argmax
            context = golden.input_ids + expected[:produced]
            margin, scale = _top2(_draft_scores(model, context)[slot], relative)
            return Divergence(index, what, margin, scale)
        if token is not None and token < produced + o_len:
            return token_divergence(token)
        if g_full and (o_len > g_len or (o_len < g_len and step != last)):
            return Divergence(index, f"step {step}: acceptance length {o_len} != golden {g_len}")
        produced += o_len
    return None if token is None else token_divergence(token)


def compare_decodings(
    model: GoldenModel,
    golden: list[SequenceResult],
    other: list[SequenceResult],
    max_new_tokens: int,
    temperatures: list[float] | None = None,
) -> list[Divergence]:
    """The first divergence of each sequence of `other` from `golden` (golden run with at least `max_new_tokens`).

    Token margins are the golden target's at the diverging position, and apply to greedy sequences only (a sampled
    token depends on a uniform, not an argmax); draft margins are the golden drafter's at the diverging slot (drafts
    are the drafter's argmax at any temperature)."""
    temperatures = temperatures or [0.0] * len(golden)
    divergences = []
    with torch.no_grad():
        for i, (g, o, t) in enumerate(zip(golden, other, temperatures, strict=True)):
            divergence = _sequence_divergence(model, i, g, o, max_new_tokens, t == 0)
            if divergence is not None:
                divergences.append(divergence)
    return divergences
