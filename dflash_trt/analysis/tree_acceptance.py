"""What a draft tree of N nodes yields per verify step, predicted from per-position rank rates (a static tree).

At draft position j, given the positions before it accepted, the target's token is the drafter's rank-r token with
probability `rates[j][r - 1]` (rank 1 is the chain's per-position acceptance; `generate --json` measures all of them
as `per_position_rank_rates`). Taking positions as independent, a tree node (a rank path `(r_1, ..., r_d)`) is
accepted with probability `prod_j rates[j][r_j - 1]`, so the best static tree of N nodes holds the N most likely
rank paths (a best-first search; they are prefix-closed, a path being no likelier than its prefix) and a step
yields one token plus their sum. This is the shape a tree of measured per-position acceptance takes; the engine
builds its tree per step from the drafter's own distributions instead, which can only do better when the drafter's
confidence tells likely positions from unlikely ones (measured on the tiny pair: docs/engine.md §6.1).

Without measured ranks, the chain's per-position acceptance `a_j` (published) is extended by the assumption that
the target's token, when not the drafter's best, is its rank-r token with probability `(1 - a_j)(1 - rho) rho^(r-2)`
(r >= 2), `rho` = `RESIDUAL_RATIO`, fitted on the embedded tiny pair's held-out prompts (`perf/tree_acceptance.py`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from dflash_trt.analysis.model import Acceptance, DFlashShape, Method
from dflash_trt.draft_schedule import DraftLenSchedule
from dflash_trt.errors import DFlashTrtError

# Geometric ratio of the ranks past the drafter's best (r >= 2), fitted by `residual_ratio` on the tiny pair's 32
# held-out prompts, 64 new tokens (0.744 at T = 0 and at T = 1: perf/tree_acceptance.py): an assumption for drafters
# with no measured rank rates.
RESIDUAL_RATIO = 0.74
# Ranks a derived rate table holds per position: a tree of up to this many branches at one position.
RANKS = 16


@dataclass(frozen=True)
class RankRates:
    """`rates[j][r - 1]`: P(the target's token at draft position j + 1 is the drafter's rank-r token | the
    positions before it accepted). A row may sum to less than 1 (the ranks past the last one listed)."""

    rates: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not self.rates or not all(self.rates):
            raise DFlashTrtError("rank rates need at least one position with at least one rank")
        for row in self.rates:
            if any(not 0.0 <= r <= 1.0 for r in row) or sum(row) > 1.0 + 1e-6:
                raise DFlashTrtError(f"rank rates of a position must be probabilities summing to at most 1: {row}")

    @property
    def positions(self) -> int:
        return len(self.rates)

    @classmethod
    def from_chain(cls, acceptance: Acceptance, ratio: float = RESIDUAL_RATIO, ranks: int = RANKS) -> RankRates:
        """The chain's per-position acceptance, the rest of each position's mass spread geometrically over the
        ranks from 2 (the `RESIDUAL_RATIO` assumption); positions past the chain's last take its rate."""
        if not 0.0 <= ratio < 1.0:
            raise DFlashTrtError(f"the residual ratio must lie in [0, 1), got {ratio}")
        chain = [acceptance.conditional_rate(j) for j in range(acceptance.max_length - 1)]
        return cls(tuple((a, *((1 - a) * (1 - ratio) * ratio**r for r in range(ranks - 1))) for a in chain))

    def chain(self) -> Acceptance:
        """The chain of every position's best token: the rank-1 rates."""
        return Acceptance.from_position_rates([row[0] for row in self.rates])

    def tree_mean(self, nodes: int) -> float:
        """Tokens per step (bonus included) of the best static tree of `nodes` nodes over these positions."""
        if nodes < 1:
            raise DFlashTrtError(f"a tree needs at least one node, got {nodes}")
        frontier: list[tuple[float, tuple[int, ...]]] = [(-p, (r,)) for r, p in enumerate(self.rates[0]) if p > 0]
        heapq.heapify(frontier)
        total = 1.0
        for _ in range(nodes):
            if not frontier:
                break
            value, path = heapq.heappop(frontier)
            total -= value
            if len(path) < self.positions:
                for r, p in enumerate(self.rates[len(path)]):
                    if p > 0:
                        heapq.heappush(frontier, (value * p, (*path, r)))
        return total


def residual_ratio(table: RankRates) -> float:
    """The geometric ratio whose ranks from 2 have the table's mean rank past the best (pooled over positions): the
    maximum-likelihood fit of `RESIDUAL_RATIO`'s assumption to measured rates."""
    weight = sum(p for row in table.rates for p in row[1:])
    if weight <= 0:
        raise DFlashTrtError("no position ever had the drafter's second choice or later: nothing to fit")
    mean = sum(r * p for row in table.rates for r, p in enumerate(row[1:], start=2)) / weight
    return (mean - 2.0) / (mean - 1.0)


def rank_rates(rows: Sequence[Sequence[float]]) -> RankRates:
    """A measured table (`generate --json`'s `per_position_rank_rates`), positions no step reached dropped."""
    kept = [tuple(float(r) for r in row) for row in rows]
    while kept and not any(kept[-1]):
        kept.pop()
    return RankRates(tuple(kept))


def tree_method(
    name: str, drafter: DFlashShape, acceptance: Acceptance, nodes: int, schedule: DraftLenSchedule | None = None
) -> Method:
    """The performance model's DFlash engine verifying draft trees of at most `nodes` nodes, under `schedule`'s node
    budget per batch (draft_schedule.py; none: every step all `nodes`). A budget B verifies B + 1 target tokens and
    yields, up to the block's drafts, the chain's tokens (the acceptance cut at B drafts) and past them the best
    static tree's over the chain's per-position rates (`RankRates.from_chain`: an assumption for a drafter with no
    measured rank rates)."""
    block = acceptance.resized(drafter.block_size)
    rates = RankRates.from_chain(block)
    chain = drafter.block_size - 1
    tokens = tuple(block.resized(b + 1).mean() if b <= chain else rates.tree_mean(b) for b in range(1, nodes + 1))
    return Method(name, drafter, block, schedule, draft_tree=nodes, tree_tokens=tokens)
