"""Fit the model's overheads on a fixed set of published points and judge it on every other point.

The split below is written in code and is not changed by the results: per harness, the points its overhead
constants are fitted on. Every other evaluable point is held out, and each held-out point is also given to two
trivial baselines: `speedup = k * tau` (k fitted on the same fit set) and persistence (a source's own
concurrency-1 figure carried to its higher concurrencies: the speedup stays, or each user's speed stays), so
the tables show where the roofline adds anything. Points whose settings a source leaves open are predicted over
every candidate setting (`published.Unknown`), and over every reading of the fitted overhead that fits the fit
points equally well (`READINGS`): the reported value is the median, with the range beside it.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from dataclasses import dataclass, replace

from dflash_trt.analysis.calibrate import golden_min
from dflash_trt.analysis.gpus import get_gpu
from dflash_trt.analysis.memory import EngineLimits, feasible_curve
from dflash_trt.analysis.model import Acceptance, Calibration, Deployment, DFlashShape, Method, TargetShape
from dflash_trt.analysis.pareto import Point, pareto_frontier, throughput_at
from dflash_trt.analysis.published import PAIRS, POINTS, SOURCES, Published, Unknown, point
from dflash_trt.analysis.shapes import eagle3_like
from dflash_trt.decoding_modes import AR, DFLASH, EAGLE3
from dflash_trt.errors import DFlashTrtError

# Written before fitting. Per harness: the points its constants are fitted on. A harness with points at two
# concurrencies also fits `token_overhead_s` (what grows with the tokens a step verifies).
FIT_SET: dict[str, tuple[str, ...]] = {
    "hf-transformers": ("zlab-qwen3-8b-dflash-gsm8k",),
    "sglang-v2": ("sglang-v2-c1", "sglang-v2-c32"),
    "sglang-v1": ("sglang-v1-c1", "sglang-v1-c32"),
}
# Where a fit point's residual time belongs cannot be told from speculative points alone: every iteration (AR
# included) or speculative iterations only. Each reading that fits its fit points is kept and carried as a range.
READINGS = {"every-step": "step_overhead_s", "spec-only": "spec_overhead_s"}
READING_MEANS = {"every-step": "every iteration, AR included", "spec-only": "speculative iterations only"}
READING_TOLERANCE = 0.01  # a reading whose fit leaves a fit point off by more than this does not fit
# No source publishes an absolute TensorRT-LLM figure for these pairs, so its overhead cannot be fitted: it is
# assumed equal to another C++/CUDA-graph serving runtime's fit, under each of that fit's readings.
TRANSFERRED = {"trtllm": "sglang-v2"}
HARNESSES = (*FIT_SET, *TRANSFERRED)
EAGLE3_DRAFT_VOCAB = 32000  # assumed: the reduced draft vocabulary of the Qwen3 / Llama EAGLE-3 speculators
OVERHEAD_SEARCH_S = (0.0, 0.02)
TOKEN_OVERHEAD_SEARCH_S = (0.0, 1e-4)
BAND_CONCURRENCIES = tuple(2**i for i in range(11))


def _grid(p: Published) -> list[dict]:
    fields = {
        "gpu": p.gpu,
        "precision": p.precision,
        "concurrency": p.concurrency,
        "tau": p.tau,
        "draft_steps": p.draft_steps,
        "lengths": p.lengths,
        "interactivity": p.interactivity,
    }
    options = [v.values if isinstance(v, Unknown) else (v,) for v in fields.values()]
    return [dict(zip(fields, combo, strict=True)) for combo in itertools.product(*options)]


@functools.cache
def _acceptance(tau: float, length: int) -> Acceptance:
    return Acceptance.from_mean(tau, length)


def _method(p: Published, tgt: TargetShape, drafter: DFlashShape, tau: float, steps: int | None) -> Method:
    if p.method == EAGLE3:
        if steps is None:
            raise DFlashTrtError(f"{p.id}: an EAGLE-3 point needs a draft length")
        return Method(EAGLE3, eagle3_like(tgt, steps, EAGLE3_DRAFT_VOCAB), _acceptance(tau, steps + 1))
    return Method(DFLASH, drafter, _acceptance(tau, p.block or drafter.block_size))


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


@functools.cache
def _shapes(pair: str) -> tuple[TargetShape, DFlashShape]:
    return PAIRS[pair].load()


def _predict_setting(p: Published, s: dict, cal: Calibration) -> float | None:
    tgt, drafter = _shapes(p.pair)
    dep = Deployment(get_gpu(s["gpu"]), s["precision"], "bf16", p.num_gpus, cal)
    isl, osl = s["lengths"]
    method = _method(p, tgt, drafter, s["tau"], s["draft_steps"])
    if p.metric == "ratio_at_interactivity":
        return band_ratio(method, Method(AR), tgt, dep, s["interactivity"], (isl, osl))
    ctx = isl + osl / 2.0
    it = method.iteration(tgt, s["concurrency"], ctx, dep)
    if p.metric == "tok_s":
        return s["concurrency"] * it.tokens_per_seq / it.seconds
    return it.tok_s_user() / Method(AR).iteration(tgt, s["concurrency"], ctx, dep).tok_s_user()


def evaluable(p: Published) -> bool:
    return p.tau is not None and p.versus == AR


def _values(p: Published, cals: tuple[Calibration, ...]) -> list[float]:
    return [v for cal in cals for s in _grid(p) if (v := _predict_setting(p, s, cal)) is not None]


def predict(p: Published, cals: tuple[Calibration, ...]) -> tuple[float | None, tuple[float, float] | None]:
    """Median and range of the model's prediction over the settings the source leaves open and the readings."""
    values = _values(p, cals)
    if not values:
        return None, None
    return statistics.median(values), (min(values), max(values))


def baseline(p: Published, k: float) -> float | None:
    """speedup = k * tau; it has no notion of absolute throughput."""
    if p.metric == "tok_s" or not evaluable(p):
        return None
    return statistics.median(k * s["tau"] for s in _grid(p))


def _family(p: Published) -> tuple:
    return (p.source, p.pair, p.method, p.block, p.harness, p.metric)


def anchor(p: Published) -> Published | None:
    """The same source's concurrency-1 figure for the same setting, for a point above concurrency 1."""
    if not isinstance(p.concurrency, int) or p.concurrency <= 1:
        return None
    return next((q for q in POINTS if _family(q) == _family(p) and q.concurrency == 1), None)


def persistence(p: Published) -> float | None:
    """The concurrency-1 figure carried over: the same speedup, or each user as fast as alone (tok/s x users)."""
    a = anchor(p)
    if a is None or not isinstance(p.concurrency, int):
        return None
    return a.published * (p.concurrency if p.metric == "tok_s" else 1)


def _loss(points: list[Published], cal: Calibration) -> float:
    total = 0.0
    for p in points:
        value, _ = predict(p, (cal,))
        total += math.inf if value is None else (value / p.published - 1.0) ** 2
    return total


def _fit_reading(harness: str, reading: str, points: list[Published]) -> Calibration:
    constant = READINGS[reading]

    def with_values(fixed_s: float, token: float) -> Calibration:
        if constant == "spec_overhead_s":
            return Calibration(harness, spec_overhead_s=fixed_s, token_overhead_s=token)
        return Calibration(harness, step_overhead_s=fixed_s, token_overhead_s=token)

    def fixed(token: float) -> Calibration:
        inner = golden_min(lambda v: _loss(points, with_values(v, token)), *OVERHEAD_SEARCH_S, 40)
        return with_values(inner, token)

    two_concurrencies = len({p.concurrency for p in points}) > 1
    token = golden_min(lambda t: _loss(points, fixed(t)), *TOKEN_OVERHEAD_SEARCH_S, 40) if two_concurrencies else 0.0
    fitted = [constant] + (["token_overhead_s"] if two_concurrencies else [])
    ids = ", ".join(p.id for p in points)
    return replace(
        fixed(token),
        name=f"{harness} ({reading})",
        source=f"{' and '.join(fitted)} fitted on {ids}, residual charged to {READING_MEANS[reading]}",
    )


@functools.cache
def calibrations(harness: str) -> tuple[Calibration, ...]:
    """The harness's calibration under every reading that fits its fit points (transferred ones: the source's)."""
    if harness in TRANSFERRED:
        return tuple(
            replace(c, name=c.name.replace(TRANSFERRED[harness], harness, 1), source=f"assumed equal to {c.source}")
            for c in calibrations(TRANSFERRED[harness])
        )
    if harness not in FIT_SET:
        raise DFlashTrtError(f"unknown calibration {harness!r} (known: {', '.join(HARNESSES)})")
    points = [point(i) for i in FIT_SET[harness]]
    fits = []
    for reading in READINGS:
        cal = _fit_reading(harness, reading, points)
        worst = max(abs(predict(p, (cal,))[0] / p.published - 1.0) for p in points)  # type: ignore[operator]
        if worst <= READING_TOLERANCE:
            fits.append(cal)
    if not fits:
        raise DFlashTrtError(f"no reading of the {harness} overhead fits its fit points")
    return tuple(fits)


def fit_set_ids() -> set[str]:
    return {i for ids in FIT_SET.values() for i in ids}


@functools.cache
def baseline_k() -> float:
    """k of speedup = k * tau, least relative squares over the fit set's speedup points."""
    pairs = [
        (s["tau"], p.published) for p in map(point, sorted(fit_set_ids())) if p.metric == "speedup" for s in _grid(p)
    ]
    return sum(t / s for t, s in pairs) / sum((t / s) ** 2 for t, s in pairs)


def duplicate_of(p: Published) -> str | None:
    """An earlier point of the same source with the same inputs and the same figure: it adds no evidence."""
    key = (p.source, p.pair, p.method, p.harness, p.concurrency, p.tau, p.published)
    for q in POINTS:
        if q is p:
            return None
        if (q.source, q.pair, q.method, q.harness, q.concurrency, q.tau, q.published) == key:
            return q.id
    return None


def k_tau_by_construction(p: Published) -> bool:
    """At concurrency 1 the model's step time does not depend on tau, so for the fit row's own pair, method and
    harness its speedup is k * tau with k set by that row: such rows cannot show the model doing better."""
    return (
        p.concurrency == 1
        and p.metric == "speedup"
        and any(
            (f.pair, f.method, f.harness, f.metric, f.concurrency) == (p.pair, p.method, p.harness, p.metric, 1)
            for f in map(point, fit_set_ids())
        )
    )


@dataclass(frozen=True)
class Evaluated:
    """One published point next to the model, the k * tau baseline and persistence."""

    point: Published
    split: str  # "fit", "eval" or "duplicate"
    predicted: float | None
    predicted_range: tuple[float, float] | None
    k_tau: float | None
    persistence: float | None

    @staticmethod
    def _err(value: float | None, p: Published) -> float | None:
        if value is None:
            return None
        err = value / p.published - 1.0
        return min(err, 0.0) if p.bound == ">" else err  # any value above a lower bound agrees with it

    @property
    def error(self) -> float | None:
        return self._err(self.predicted, self.point)

    @property
    def k_tau_error(self) -> float | None:
        return self._err(self.k_tau, self.point)

    @property
    def persistence_error(self) -> float | None:
        return self._err(self.persistence, self.point)

    @property
    def regime(self) -> str:
        p = self.point
        if p.metric == "ratio_at_interactivity":
            return "at equal interactivity"
        if isinstance(p.concurrency, Unknown):
            return "concurrency unknown"
        return "concurrency 1" if p.concurrency == 1 else "concurrency > 1"

    def as_json(self) -> dict:
        p = self.point
        return {
            "id": p.id,
            "source": SOURCES[p.source],
            "setting": p.setting,
            "metric": p.metric,
            "published": p.published,
            "bound": p.bound or None,
            "predicted": self.predicted,
            "predicted_range": self.predicted_range,
            "error": self.error,
            "baselines": {"k_tau": self.k_tau, "persistence": self.persistence},
            "baseline_errors": {"k_tau": self.k_tau_error, "persistence": self.persistence_error},
            "split": self.split,
            "duplicate_of": duplicate_of(p),
            "k_tau_by_construction": k_tau_by_construction(p),
            "concurrency": p.concurrency if isinstance(p.concurrency, int) else None,
            "regime": self.regime,
            "harness": p.harness,
            "calibrations": [vars(c) for c in calibrations(p.harness)],
            "unknowns": {k: {"values": list(v.values), "kind": v.kind, "why": v.why} for k, v in vars(p).items()
                         if isinstance(v, Unknown)},
            "note": p.note,
        }  # fmt: skip


@functools.cache
def evaluate() -> tuple[Evaluated, ...]:
    fitted, k = fit_set_ids(), baseline_k()
    rows = []
    for p in POINTS:
        split = "fit" if p.id in fitted else "duplicate" if duplicate_of(p) else "eval"
        value, span = predict(p, calibrations(p.harness)) if evaluable(p) and split != "duplicate" else (None, None)
        rows.append(Evaluated(p, split, value, span, baseline(p, k), persistence(p)))
    return tuple(rows)


@dataclass(frozen=True)
class Summary:
    """Held-out errors of one group of points: per predictor, (points, median |error|, largest-magnitude error)."""

    group: str
    model: tuple[int, float | None, float | None]
    k_tau: tuple[int, float | None, float | None]
    persistence: tuple[int, float | None, float | None]


def _stats(errors: list[float | None]) -> tuple[int, float | None, float | None]:
    got = [e for e in errors if e is not None]
    if not got:
        return 0, None, None
    return len(got), statistics.median(abs(e) for e in got), max(got, key=abs)


def _summary(group: str, rows: list[Evaluated]) -> Summary:
    return Summary(
        group,
        _stats([r.error for r in rows]),
        _stats([r.k_tau_error for r in rows]),
        _stats([r.persistence_error for r in rows]),
    )


def summarize(rows: tuple[Evaluated, ...]) -> list[Summary]:
    """Per regime and per source, over held-out points; above concurrency 1 also over the points every
    predictor answers (persistence needs the source's own concurrency-1 figure)."""
    held = [r for r in rows if r.split == "eval" and (r.error, r.k_tau_error, r.persistence_error) != (None,) * 3]
    out = []
    for regime in ("concurrency 1", "concurrency > 1", "concurrency unknown", "at equal interactivity"):
        sel = [r for r in held if r.regime == regime]
        if sel:
            out.append(_summary(regime, sel))
    informative = [r for r in held if r.regime == "concurrency 1" and not k_tau_by_construction(r.point)]
    out.append(_summary("concurrency 1, rows not k·τ by construction", informative))
    both = [r for r in held if r.regime == "concurrency > 1" and r.persistence is not None and r.error is not None]
    out.append(
        _summary("concurrency > 1, speedup rows (all three predict)", [r for r in both if r.point.metric == "speedup"])
    )
    for source in sorted({r.point.source for r in held}):
        out.append(_summary(f"source {source}", [r for r in held if r.point.source == source]))
    out.append(_summary("all held out", held))
    return out  # fmt: skip


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.1f}%"


def _abs_pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def markdown_tables(rows: tuple[Evaluated, ...]) -> str:
    """The tables docs/performance.md carries, regenerated by `dflash-trt plan --validate`."""
    lines = [
        "| point | setting | metric | published | model (range) | error | k·τ | k·τ error | persistence | "
        "persistence error | split |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.point
        span = (
            ""
            if r.predicted_range is None or r.predicted_range[0] == r.predicted_range[1]
            else (f" ({_num(r.predicted_range[0])}–{_num(r.predicted_range[1])})")
        )
        split = f"duplicate of {duplicate_of(p)}" if r.split == "duplicate" else r.split
        lines.append(
            f"| {p.id} | {p.setting} | {p.metric} | {p.bound}{_num(p.published)} | {_num(r.predicted)}{span} | "
            f"{_pct(r.error)} | {_num(r.k_tau)} | {_pct(r.k_tau_error)} | {_num(r.persistence)} | "
            f"{_pct(r.persistence_error)} | {split} |"
        )
    lines += [
        "",
        "| held-out group | model points | model median abs error | model worst | k·τ points | "
        "k·τ median | k·τ worst | persistence points | persistence median | persistence worst |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summarize(rows):
        cells = " | ".join(
            f"{n} | {_abs_pct(med)} | {_pct(worst)}" for n, med, worst in (s.model, s.k_tau, s.persistence)
        )
        lines.append(f"| {s.group} | {cells} |")
    return "\n".join(lines)  # fmt: skip


SHAPE_OVERHEADS_S = (1.0e-3, 0.5e-3, 0.25e-3, 0.1e-3)  # assumed alternatives to the transferred trtllm overhead
SHAPE_TAUS = (3.7, 4.6, 5.4)  # low, middle and high of the card's block-10 acceptance lengths
SHAPE_BAND = (500.0, 600.0)
SHAPE_LENGTHS = (1024, 1024)


@dataclass(frozen=True)
class BandShape:
    """The >15x claim's shape under one per-step overhead: AR's single-user ceiling and DFlash's ratio."""

    step_overhead_s: float
    ar_ceiling_tok_s_user: float
    ratios: dict[float, tuple[float | None, float | None]]  # tau -> ratio at the band's low and high ends
    users: dict[float, int]  # tau -> largest batch that fits and still serves the band's middle


def band_shape() -> list[BandShape]:
    """gpt-oss-120b on 8x B300 (MXFP4): how the ratio at 500-600 tok/s/user depends on the runtime's overhead
    (the transferred calibration's every-step reading first, then assumed alternatives)."""
    tgt, drafter = _shapes("gpt-oss-120b")
    transferred = [c for c in calibrations("trtllm") if c.step_overhead_s > 0]
    rows = []
    for cal in (*transferred, *(replace(Calibration("trtllm"), step_overhead_s=o) for o in SHAPE_OVERHEADS_S)):
        dep = Deployment(get_gpu("b300"), "mxfp4", "bf16", 8, cal)
        ceiling = Method(AR).iteration(tgt, 1, SHAPE_LENGTHS[0] + SHAPE_LENGTHS[1] / 2, dep).tok_s_user()
        ratios, users = {}, {}
        for tau in SHAPE_TAUS:
            method = Method(DFLASH, drafter, Acceptance.from_mean(tau, drafter.block_size))
            lo, hi = (band_ratio(method, Method(AR), tgt, dep, x, SHAPE_LENGTHS) for x in SHAPE_BAND)
            ratios[tau] = (lo, hi)
            curve = feasible_curve(method, tgt, dep, BAND_CONCURRENCIES, SHAPE_LENGTHS, EngineLimits())
            users[tau] = max([fp.batch for fp in curve if fp.point and fp.point.tok_s_user >= sum(SHAPE_BAND) / 2]
                             or [0])  # fmt: skip
        rows.append(BandShape(cal.step_overhead_s, ceiling, ratios, users))
    return rows


def markdown_band_shape(rows: list[BandShape]) -> str:
    head = " | ".join(f"τ {t}: ratio at 500 / 600, users at 550" for t in SHAPE_TAUS)
    lines = [f"| per-step overhead | AR at concurrency 1 | {head} |", "|---" * (2 + len(SHAPE_TAUS)) + "|"]
    for r in rows:
        cells = " | ".join(f"{_num(r.ratios[t][0])} / {_num(r.ratios[t][1])}, {r.users[t]}" for t in SHAPE_TAUS)
        lines.append(f"| {1e3 * r.step_overhead_s:.2f} ms | {r.ar_ceiling_tok_s_user:.0f} tok/s/user | {cells} |")
    return "\n".join(lines)
