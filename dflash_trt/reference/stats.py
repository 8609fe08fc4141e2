"""Acceptance statistics of a decoding run: what users read to see whether the drafter earns its keep."""

from __future__ import annotations

from dflash_trt.reference.decode import SequenceResult

# Ranks `generate --json` reports per draft position (`per_position_rank_rates`): what a tree of up to that many
# branches per position can catch.
REPORTED_RANKS = 16


def mean_acceptance_length(results: list[SequenceResult]) -> float:
    """Tokens produced per target verify step (bonus included), over every step of every sequence."""
    lengths = [n for r in results for n in r.acceptance_lengths]
    return sum(lengths) / len(lengths) if lengths else 0.0


def per_position_acceptance(results: list[SequenceResult], num_draft_positions: int) -> list[float | None]:
    """Fraction of steps whose draft token at position i was accepted, among steps that proposed one there (a tree
    proposes position i when it is at least i + 1 deep, and accepts it when its accepted path is)."""
    accepted = [0] * num_draft_positions
    proposed = [0] * num_draft_positions
    for result in results:
        for step in result.steps:
            for i in range(min(step.depth, num_draft_positions)):
                proposed[i] += 1
                accepted[i] += int(step.accepted > i)
    return [a / p if p else None for a, p in zip(accepted, proposed, strict=True)]


def per_position_rank_rates(results: list[SequenceResult], num_draft_positions: int, ranks: int) -> list[list[float]]:
    """Per draft position, among steps that reached it with the drafter's scores recorded: the fraction whose target
    token was the drafter's rank-r token, r = 1..`ranks` (rank 1 is the chain's per-position acceptance; the rest is
    what a tree's further branches can catch). Positions no step reached get zeros."""
    counts = [[0] * ranks for _ in range(num_draft_positions)]
    reached = [0] * num_draft_positions
    for result in results:
        for step in result.steps:
            for position, rank in enumerate((step.ranks or [])[:num_draft_positions]):
                reached[position] += 1
                if rank is not None and rank <= ranks:
                    counts[position][rank - 1] += 1
    return [[c / n if n else 0.0 for c in row] for row, n in zip(counts, reached, strict=True)]
