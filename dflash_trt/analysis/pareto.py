"""Throughput-vs-interactivity analysis of sweep points: frontiers, banded speedups, crossover concurrency.

A serving configuration is judged the way the DFlash / EAGLE-3 results are published: every concurrency gives
one point (x = output tokens/s per user, y = output tokens/s per GPU); a configuration's best trade-offs are the
points no other point beats on both axes. Comparisons are made at equal interactivity, reading y off each
frontier at the same x, because equal concurrency would credit speculation with the speed it buys.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from dflash_trt.errors import DFlashTrtError


@dataclass(frozen=True)
class Point:
    """One measured or predicted operating point of one engine."""

    engine: str
    concurrency: int
    tok_s_user: float
    tok_s_gpu: float


def _check_point(point: Point) -> None:
    for value, what in ((point.tok_s_user, "tok/s/user"), (point.tok_s_gpu, "tok/s/GPU")):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise DFlashTrtError(
                f"{point.engine} at concurrency {point.concurrency}: {what} must be a positive number, got {value!r}"
            )


def pareto_frontier(points: Iterable[Point]) -> list[Point]:
    """Points not dominated on (tok/s/user, tok/s/GPU), ordered by rising interactivity (falling throughput)."""
    pts = list(points)
    for p in pts:
        _check_point(p)
    # Sort by x descending, ties by y descending; sweep keeps each point that beats every faster one on y.
    ordered = sorted(pts, key=lambda p: (-p.tok_s_user, -p.tok_s_gpu))
    frontier: list[Point] = []
    best_y = -math.inf
    for p in ordered:
        if p.tok_s_gpu > best_y:
            frontier.append(p)
            best_y = p.tok_s_gpu
    frontier.reverse()
    return frontier


def throughput_at(frontier: Sequence[Point], tok_s_user: float) -> float | None:
    """Best tok/s/GPU at interactivity of at least `tok_s_user`, interpolating linearly along the frontier.

    Below the frontier's slowest point that point itself qualifies (it serves every user faster than asked), so
    its throughput is returned, a lower bound. Above the fastest point there is None: extrapolating a measured
    curve would invent data.
    """
    if not frontier:
        return None
    xs = [p.tok_s_user for p in frontier]
    if tok_s_user > xs[-1]:
        return None
    if tok_s_user <= xs[0]:
        return frontier[0].tok_s_gpu
    for left, right in pairwise(frontier):
        if left.tok_s_user <= tok_s_user <= right.tok_s_user:
            span = right.tok_s_user - left.tok_s_user
            if span == 0:
                return max(left.tok_s_gpu, right.tok_s_gpu)
            t = (tok_s_user - left.tok_s_user) / span
            return left.tok_s_gpu + t * (right.tok_s_gpu - left.tok_s_gpu)
    raise AssertionError("unreachable: x lies within the frontier's range")


def speedup_at(frontier: Sequence[Point], baseline: Sequence[Point], tok_s_user: float) -> float | None:
    """Throughput ratio of two frontiers at equal interactivity; None where either cannot reach it."""
    mine, theirs = throughput_at(frontier, tok_s_user), throughput_at(baseline, tok_s_user)
    if mine is None or theirs is None:
        return None
    return mine / theirs


@dataclass(frozen=True)
class Crossover:
    """Where speculation stops paying against a baseline, judged at equal concurrency."""

    concurrency: float | None  # interpolated (log2 concurrency); None if it pays (or never pays) everywhere
    pays_at: tuple[int, ...]
    loses_at: tuple[int, ...]


def crossover_concurrency(spec: Iterable[Point], baseline: Iterable[Point]) -> Crossover:
    """First concurrency at which the speculative engine's tok/s/GPU falls to the baseline's.

    Only concurrencies both sweeps measured are compared; between the last paying and the first losing one the
    throughput ratio is interpolated linearly in log2(concurrency), the spacing sweeps are run at.
    """
    spec_by_c = {p.concurrency: p for p in spec}
    base_by_c = {p.concurrency: p for p in baseline}
    common = sorted(set(spec_by_c) & set(base_by_c))
    if not common:
        raise DFlashTrtError("the two sweeps share no concurrency value, so no crossover can be computed")
    ratios = [(c, spec_by_c[c].tok_s_gpu / base_by_c[c].tok_s_gpu) for c in common]
    pays = tuple(c for c, r in ratios if r > 1.0)
    loses = tuple(c for c, r in ratios if r <= 1.0)
    crossing = None
    for (c0, r0), (c1, r1) in pairwise(ratios):
        if r0 > 1.0 >= r1:
            l0, l1 = math.log2(c0), math.log2(c1)
            crossing = 2 ** (l0 + (1.0 - r0) * (l1 - l0) / (r1 - r0))
            break
    if crossing is None and ratios[0][1] <= 1.0:
        crossing = float(ratios[0][0])
    return Crossover(concurrency=crossing, pays_at=pays, loses_at=loses)


def group_by_engine(points: Iterable[Point]) -> dict[str, list[Point]]:
    groups: dict[str, list[Point]] = {}
    for p in points:
        groups.setdefault(p.engine, []).append(p)
    for pts in groups.values():
        pts.sort(key=lambda p: p.concurrency)
    return groups


@dataclass(frozen=True)
class BandRow:
    """Speedups of every engine over one baseline at one interactivity level."""

    tok_s_user: float
    throughput: dict[str, float | None]
    speedup: dict[str, float | None]


def speedup_table(points: Iterable[Point], baseline: str, levels: Sequence[float]) -> list[BandRow]:
    """Throughput of each engine's frontier, and its ratio to `baseline`, at each interactivity level."""
    groups = group_by_engine(points)
    if baseline not in groups:
        raise DFlashTrtError(f"baseline engine {baseline!r} has no points (engines: {', '.join(sorted(groups))})")
    frontiers = {name: pareto_frontier(pts) for name, pts in groups.items()}
    rows = []
    for level in levels:
        throughput = {name: throughput_at(f, level) for name, f in frontiers.items()}
        base = throughput[baseline]
        speedup = {name: (None if y is None or base is None else y / base) for name, y in throughput.items()}
        rows.append(BandRow(tok_s_user=level, throughput=throughput, speedup=speedup))
    return rows
