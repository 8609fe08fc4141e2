"""How one published row meets the model: the settings its source leaves open, the step costs behind its figure,
the linear equations a fit draws from it, and the model's value for it under a calibration.

A row's figure is a throughput (`tok_s`: output tokens/s of the whole deployment), a speedup over AR at equal
concurrency, or a throughput ratio at equal interactivity (read off two predicted frontiers). Whatever the source
leaves open is an `Unknown`; the model is evaluated at every combination of candidates (`settings`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

from dflash_trt.analysis.fitting import Equation, speedup_equation, time_equation
from dflash_trt.analysis.gpus import get_gpu
from dflash_trt.analysis.memory import EngineLimits, feasible_curve
from dflash_trt.analysis.model import Acceptance, Calibration, Deployment, DFlashShape, Method, TargetShape
from dflash_trt.analysis.pareto import Point, pareto_frontier, throughput_at
from dflash_trt.analysis.published import PAIRS, Published, Unknown
from dflash_trt.analysis.shapes import eagle3_like
from dflash_trt.decoding_modes import AR, EAGLE3
from dflash_trt.errors import DFlashTrtError

EAGLE3_DRAFT_VOCAB = 32000  # assumed: the reduced draft vocabulary of the Qwen3 / Llama EAGLE-3 speculators
BAND_CONCURRENCIES = tuple(2**i for i in range(11))
SETTING_FIELDS = ("gpu", "precision", "concurrency", "tau", "draft_steps", "lengths", "interactivity")


def settings(p: Published) -> list[dict]:
    """Every combination of the candidate values of what the row's source leaves open."""
    options = [v.values if isinstance(v, Unknown) else (v,) for v in (getattr(p, f) for f in SETTING_FIELDS)]
    return [dict(zip(SETTING_FIELDS, combo, strict=True)) for combo in itertools.product(*options)]


def evaluable(p: Published) -> bool:
    """The model can give a value: an acceptance length is known and the comparison is with AR."""
    return p.tau is not None and p.versus == AR


@functools.cache
def shapes(pair: str) -> tuple[TargetShape, DFlashShape]:
    return PAIRS[pair].load()


@functools.cache
def _acceptance(tau: float, length: int) -> Acceptance:
    return Acceptance.from_mean(tau, length)


def method(p: Published, s: dict) -> Method:
    """The decoding method the row measures, with its acceptance at the draft length it ran with."""
    tgt, drafter = shapes(p.pair)
    if p.method == AR:
        return Method(AR)
    if p.method == EAGLE3:
        if s["draft_steps"] is None:
            raise DFlashTrtError(f"{p.id}: an EAGLE-3 point needs a draft length")
        return Method(
            EAGLE3, eagle3_like(tgt, s["draft_steps"], EAGLE3_DRAFT_VOCAB), _acceptance(s["tau"], s["draft_steps"] + 1)
        )
    return Method(p.method, drafter, _acceptance(s["tau"], p.block or drafter.block_size))


def deployment(p: Published, s: dict, cal: Calibration) -> Deployment:
    return Deployment(get_gpu(s["gpu"]), s["precision"], "bf16", p.num_gpus, cal)


def context(s: dict) -> float:
    isl, osl = s["lengths"]
    return isl + osl / 2.0


def _frontier(m: Method, tgt: TargetShape, dep: Deployment, lengths: tuple[int, int]) -> list[Point]:
    """The method's predicted frontier over the band's concurrencies, each capped at what fits in memory."""
    curve = feasible_curve(m, tgt, dep, BAND_CONCURRENCIES, lengths, EngineLimits())
    ran = {fp.batch: fp.point for fp in curve if fp.point is not None}
    return pareto_frontier(Point(p.engine, b, p.tok_s_user, p.tok_s_gpu) for b, p in ran.items())


def band_ratio(
    a: Method, b: Method, tgt: TargetShape, dep: Deployment, tok_s_user: float, lengths: tuple[int, int]
) -> float | None:
    """tok/s/GPU ratio of two methods' predicted frontiers at equal interactivity (None if either misses it)."""
    ya = throughput_at(_frontier(a, tgt, dep, lengths), tok_s_user)
    yb = throughput_at(_frontier(b, tgt, dep, lengths), tok_s_user)
    return None if ya is None or yb is None else ya / yb


def fits(m: Method, tgt: TargetShape, dep: Deployment, s: dict) -> bool:
    """The row's batch fits in memory and the default engine limits (no prediction is made for one that does
    not, nor fitted on)."""
    (point,) = feasible_curve(m, tgt, dep, [s["concurrency"]], s["lengths"], EngineLimits())
    return point.fits


def value(p: Published, s: dict, cal: Calibration) -> float | None:
    """The model's figure for the row at one setting (None: it does not fit in memory or misses the band)."""
    tgt, _ = shapes(p.pair)
    dep = deployment(p, s, cal)
    m = method(p, s)
    if p.metric == "ratio_at_interactivity":
        return band_ratio(m, Method(AR), tgt, dep, s["interactivity"], s["lengths"])
    if not fits(m, tgt, dep, s):
        return None
    ctx = context(s)
    it = m.iteration(tgt, s["concurrency"], ctx, dep)
    if p.metric == "tok_s":
        return s["concurrency"] * it.tokens_per_seq / it.seconds
    return it.tok_s_user() / Method(AR).iteration(tgt, s["concurrency"], ctx, dep).tok_s_user()


def equations(p: Published, cal: Calibration) -> list[Equation]:
    """The row as linear equations in the fitted terms, one per setting, weighted so that the settings of one row
    count as one observation (`cal` only sets the speedup rows' weights)."""
    if p.metric not in ("tok_s", "speedup") or not evaluable(p):
        raise DFlashTrtError(f"{p.id}: only throughput and speedup rows with an acceptance length can be fitted")
    tgt, _ = shapes(p.pair)
    grid = settings(p)
    out = []
    for s in grid:
        dep, m, ctx, c = deployment(p, s, cal), method(p, s), context(s), s["concurrency"]
        if not fits(m, tgt, dep, s):
            raise DFlashTrtError(f"{p.id}: a fit row whose batch does not fit in memory")
        cost = m.step(tgt, c, ctx, dep)
        if p.metric == "tok_s":
            tokens = 1.0 if m.acceptance is None else m.acceptance.mean()
            eq = time_equation(cost, c * tokens / p.published)
        else:
            ar = Method(AR).step(tgt, c, ctx, dep)
            eq = speedup_equation(ar, cost, s["tau"], p.published, cal.seconds(ar))
        out.append(Equation(eq.terms, eq.rhs, eq.weight / len(grid)))
    return out


def spans(points: Sequence[Published]) -> tuple[set[int], set[int]]:
    """The TP widths and concurrencies a set of rows spans (what decides which terms they can tell apart)."""
    tps = {p.num_gpus for p in points}
    concs = {
        c for p in points for c in (p.concurrency.values if isinstance(p.concurrency, Unknown) else (p.concurrency,))
    }
    return tps, {c for c in concs if c is not None}
