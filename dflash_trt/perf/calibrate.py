"""Fit the model's overhead constants to a user's own `dflash-trt bench` results and report residuals per point.

The roofline part stays as it is (datasheet peaks, assumed efficiencies); only the two overheads a roofline
cannot see are fitted: `step_overhead_s` on the AR points (every iteration pays it) and then `spec_overhead_s`
on the DFlash points (what a speculative iteration costs beyond that). With no AR points, the DFlash points fit
`step_overhead_s` alone. The measured acceptance length of each DFlash point is what the model is given, so the
residuals judge the time model, not the drafter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_trt.errors import DFlashTrtError
from dflash_trt.perf.model import Acceptance, Calibration, Deployment, DFlashShape, Method, TargetShape

OVERHEAD_SEARCH_S = (0.0, 0.05)
# A bench run writes one point per mode and concurrency; each costs a model evaluation per search step, so the
# fit is bounded here rather than left to run for hours on a file of a million points.
MAX_POINTS = 1000


@dataclass(frozen=True)
class MeasuredPoint:
    """One (mode, concurrency) point of a bench run: what the fit needs from it."""

    mode: str  # "dflash" or "ar"
    concurrency: int
    tok_s_user: float  # 1 / median TPOT
    throughput_tok_s: float
    acceptance_length: float


def _number(point: dict, key: str, where: str, sub: str | None = None) -> float:
    value = point.get(key)
    if sub is not None:
        value = value.get(sub) if isinstance(value, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        name = f"{key}.{sub}" if sub else key
        raise DFlashTrtError(f"{where}: {name} must be a positive number, got {value!r}")
    return float(value)


def read_bench_points(path: str | Path) -> list[MeasuredPoint]:
    """Points of a `dflash-trt bench` results.json ({"points": [...]}, keys of the bench results schema).

    The only reader of that file in the model: if the schema's definition moves, this is the one place to repoint.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DFlashTrtError(f"cannot read bench results {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("points"), list) or not data["points"]:
        raise DFlashTrtError(f"{path}: expected a JSON object with a non-empty 'points' list")
    if len(data["points"]) > MAX_POINTS:
        raise DFlashTrtError(
            f"{path}: 'points' must hold at most {MAX_POINTS} points (one per mode and concurrency), got "
            f"{len(data['points'])}"
        )
    points = []
    for i, p in enumerate(data["points"]):
        where = f"{path}: points[{i}]"
        if not isinstance(p, dict):
            raise DFlashTrtError(f"{where} must be an object")
        mode = p.get("mode")
        if mode not in ("dflash", "ar"):
            raise DFlashTrtError(f"{where}: mode must be 'dflash' or 'ar', got {mode!r}")
        if p.get("concurrency") is None and p.get("request_rate") is not None:
            continue  # an open-loop point: its concurrency is whatever the arrivals made it, not a model input
        conc = p.get("concurrency")
        if isinstance(conc, bool) or not isinstance(conc, int) or conc < 1:
            raise DFlashTrtError(f"{where}: concurrency must be a positive integer, got {conc!r}")
        tau = 1.0 if mode == "ar" else _number(p, "acceptance_length", where)
        points.append(
            MeasuredPoint(
                mode,
                conc,
                1.0 / _number(p, "tpot_s", where, "p50"),
                _number(p, "throughput_tok_s", where),
                tau,
            )
        )
    if not points:
        raise DFlashTrtError(
            f"{path} holds only open-loop points (bench --request_rate); calibration fits closed-loop points: run "
            "bench with --concurrency"
        )
    return points


@dataclass(frozen=True)
class Residual:
    point: MeasuredPoint
    predicted_tok_s_user: float

    @property
    def error(self) -> float:
        return self.predicted_tok_s_user / self.point.tok_s_user - 1.0


def _predict(p: MeasuredPoint, target: TargetShape, drafter: DFlashShape | None, dep: Deployment, ctx: float):
    if p.mode == "ar":
        return Method("ar").iteration(target, p.concurrency, ctx, dep).tok_s_user()
    if drafter is None:
        raise DFlashTrtError("the bench results hold DFlash points: the drafter's shape is needed")
    if p.acceptance_length > drafter.block_size:
        raise DFlashTrtError(
            f"measured acceptance length {p.acceptance_length} exceeds the drafter's block {drafter.block_size}"
        )
    method = Method("dflash", drafter, Acceptance.from_mean(p.acceptance_length, drafter.block_size))
    return method.iteration(target, p.concurrency, ctx, dep).tok_s_user()


def golden_min(f: Callable[[float], float], lo: float, hi: float, iterations: int = 60) -> float:
    """Minimizer of a unimodal f on [lo, hi] (golden-section search)."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    for _ in range(iterations):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if f(c) <= f(d):
            b = d
        else:
            a = c
    return (a + b) / 2


def fit(
    points: list[MeasuredPoint],
    target: TargetShape,
    drafter: DFlashShape | None,
    dep: Deployment,
    ctx: float,
    source: str,
) -> tuple[Calibration, list[Residual]]:
    """The deployment's calibration with both overheads fitted to `points`, and each point's residual."""

    def loss(cal: Calibration, subset: list[MeasuredPoint]) -> float:
        d = replace(dep, calibration=cal)
        return sum((_predict(p, target, drafter, d, ctx) / p.tok_s_user - 1.0) ** 2 for p in subset)

    ar = [p for p in points if p.mode == "ar"]
    spec = [p for p in points if p.mode == "dflash"]
    base = replace(dep.calibration, step_overhead_s=0.0, spec_overhead_s=0.0)
    first = ar or spec
    step = golden_min(lambda v: loss(replace(base, step_overhead_s=v), first), *OVERHEAD_SEARCH_S)
    cal = replace(base, step_overhead_s=step)
    fitted = ["step_overhead_s on the " + ("AR" if ar else "DFlash") + " points"]
    if ar and spec:
        extra = golden_min(lambda v: loss(replace(cal, spec_overhead_s=v), spec), *OVERHEAD_SEARCH_S)
        cal = replace(cal, spec_overhead_s=extra)
        fitted.append("spec_overhead_s on the DFlash points")
    cal = replace(cal, name="measured", source=f"{' and '.join(fitted)} of {source}")
    d = replace(dep, calibration=cal)
    return cal, [Residual(p, _predict(p, target, drafter, d, ctx)) for p in points]
