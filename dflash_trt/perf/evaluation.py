"""Fit the model's overheads on a fixed set of published points and judge it on every other point.

The split below was decided before any fit and is not changed by the results: per harness, the points its
overhead constant is fitted on. Every other evaluable point is held out, and each held-out point is also given
to the trivial baseline `speedup = k * tau` (k fitted on the same fit set), so the table shows where the roofline
adds anything. Points whose settings a source leaves open are predicted over every candidate setting
(`published.Unknown`): the reported value is the median, with the range beside it.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from dataclasses import dataclass, replace

from dflash_trt.errors import DFlashTrtError
from dflash_trt.perf.calibrate import golden_min
from dflash_trt.perf.gpus import get_gpu
from dflash_trt.perf.model import (
    Acceptance,
    Calibration,
    Deployment,
    DFlashShape,
    Method,
    TargetShape,
    mean_context,
    predict_curve,
)
from dflash_trt.perf.pareto import pareto_frontier, throughput_at
from dflash_trt.perf.published import PAIRS, POINTS, SOURCES, Published, Unknown, point
from dflash_trt.perf.shapes import eagle3_like

# Decided before fitting. One constant per harness, fitted on these points only.
FIT_SET: dict[str, tuple[str, ...]] = {
    # The HumanEval row has the same tau and speedup as the GSM8K row, so it cannot be a held-out check.
    "hf-transformers": ("zlab-qwen3-8b-dflash-gsm8k", "zlab-qwen3-8b-dflash-humaneval"),
    "sglang-v2": ("sglang-v2-c1",),
    "sglang-v1": ("sglang-v1-c1",),
}
FITTED_CONSTANT = {"hf-transformers": "spec_overhead_s", "sglang-v2": "step_overhead_s", "sglang-v1": "step_overhead_s"}
# No source publishes an absolute TensorRT-LLM figure for these pairs, so its overhead cannot be fitted: it is
# assumed equal to another C++/CUDA-graph serving runtime's fit.
TRANSFERRED = {"trtllm": "sglang-v2"}
HARNESSES = (*FIT_SET, *TRANSFERRED)
EAGLE3_DRAFT_VOCAB = 32000  # assumed: the reduced draft vocabulary of the Qwen3 / Llama EAGLE-3 speculators
OVERHEAD_SEARCH_S = (0.0, 0.02)
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


def _method(p: Published, tgt: TargetShape, drafter: DFlashShape, tau: float, steps: int | None) -> Method:
    if p.method == "eagle3":
        if steps is None:
            raise DFlashTrtError(f"{p.id}: an EAGLE-3 point needs a draft length")
        return Method("eagle3", eagle3_like(tgt, steps, EAGLE3_DRAFT_VOCAB), Acceptance.from_mean(tau, steps + 1))
    return Method("dflash", drafter, Acceptance.from_mean(tau, p.block or drafter.block_size))


def band_ratio(a: Method, b: Method, tgt: TargetShape, dep: Deployment, tok_s_user: float, ctx: float) -> float | None:
    """tok/s/GPU ratio of two methods' predicted frontiers at equal interactivity (None if either misses it)."""
    fa = pareto_frontier(predict_curve(a, tgt, dep, BAND_CONCURRENCIES, ctx))
    fb = pareto_frontier(predict_curve(b, tgt, dep, BAND_CONCURRENCIES, ctx))
    ya, yb = throughput_at(fa, tok_s_user), throughput_at(fb, tok_s_user)
    return None if ya is None or yb is None else ya / yb


def _predict_setting(p: Published, s: dict, cal: Calibration) -> float | None:
    tgt, drafter = PAIRS[p.pair].load()
    dep = Deployment(get_gpu(s["gpu"]), s["precision"], "bf16", p.num_gpus, cal)
    ctx = mean_context(*s["lengths"])
    method = _method(p, tgt, drafter, s["tau"], s["draft_steps"])
    if p.metric == "ratio_at_interactivity":
        return band_ratio(method, Method("ar"), tgt, dep, s["interactivity"], ctx)
    it = method.iteration(tgt, s["concurrency"], ctx, dep)
    if p.metric == "tok_s":
        return s["concurrency"] * it.tokens_per_seq / it.seconds
    return it.tok_s_user() / Method("ar").iteration(tgt, s["concurrency"], ctx, dep).tok_s_user()


def evaluable(p: Published) -> bool:
    return p.tau is not None and p.versus == "ar"


def predict(p: Published, cal: Calibration) -> tuple[float | None, tuple[float, float] | None]:
    """Median and range of the model's prediction over the settings the source leaves open."""
    values = [v for s in _grid(p) if (v := _predict_setting(p, s, cal)) is not None]
    if not values:
        return None, None
    return statistics.median(values), (min(values), max(values))


def baseline(p: Published, k: float) -> float | None:
    """speedup = k * tau; it has no notion of absolute throughput."""
    if p.metric == "tok_s" or not evaluable(p):
        return None
    return statistics.median(k * s["tau"] for s in _grid(p))


def _loss(points: list[Published], cal: Calibration) -> float:
    total = 0.0
    for p in points:
        value, _ = predict(p, cal)
        total += math.inf if value is None else (value / p.published - 1.0) ** 2
    return total


@functools.cache
def calibration(harness: str) -> Calibration:
    """The harness's calibration: its constant fitted on FIT_SET, or transferred from another harness's fit."""
    if harness in TRANSFERRED:
        base = calibration(TRANSFERRED[harness])
        return replace(base, name=harness, source=f"assumed equal to the {base.name} fit ({base.source})")
    if harness not in FIT_SET:
        raise DFlashTrtError(f"unknown calibration {harness!r} (known: {', '.join(HARNESSES)})")
    points = [point(i) for i in FIT_SET[harness]]
    constant = FITTED_CONSTANT[harness]

    def with_value(v: float) -> Calibration:
        if constant == "spec_overhead_s":
            return Calibration(harness, spec_overhead_s=v)
        return Calibration(harness, step_overhead_s=v)

    value = golden_min(lambda v: _loss(points, with_value(v)), *OVERHEAD_SEARCH_S)
    return replace(with_value(value), source=f"{constant} fitted on {', '.join(FIT_SET[harness])}")


def fit_set_ids() -> set[str]:
    return {i for ids in FIT_SET.values() for i in ids}


@functools.cache
def baseline_k() -> float:
    """k of speedup = k * tau, least relative squares over the fit set's speedup points."""
    pairs = [
        (s["tau"], p.published) for p in map(point, sorted(fit_set_ids())) if p.metric == "speedup" for s in _grid(p)
    ]
    return sum(t / s for t, s in pairs) / sum((t / s) ** 2 for t, s in pairs)


@dataclass(frozen=True)
class Evaluated:
    """One published point next to the model and the k * tau baseline."""

    point: Published
    split: str  # "fit" or "eval"
    predicted: float | None
    predicted_range: tuple[float, float] | None
    baseline_predicted: float | None

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
    def baseline_error(self) -> float | None:
        return self._err(self.baseline_predicted, self.point)

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
            "baseline_predicted": self.baseline_predicted,
            "error": self.error,
            "baseline_error": self.baseline_error,
            "split": self.split,
            "concurrency": p.concurrency if isinstance(p.concurrency, int) else None,
            "regime": self.regime,
            "harness": p.harness,
            "calibration": vars(calibration(p.harness)),
            "unknowns": {k: v.why for k, v in vars(p).items() if isinstance(v, Unknown)},
            "note": p.note,
        }


@functools.cache
def evaluate() -> tuple[Evaluated, ...]:
    fitted, k = fit_set_ids(), baseline_k()
    rows = []
    for p in POINTS:
        value, span = predict(p, calibration(p.harness)) if evaluable(p) else (None, None)
        rows.append(Evaluated(p, "fit" if p.id in fitted else "eval", value, span, baseline(p, k)))
    return tuple(rows)


@dataclass(frozen=True)
class Summary:
    """Held-out errors of one regime: median of |error| and the error of largest magnitude (signed)."""

    regime: str
    model_points: int
    baseline_points: int
    model_median: float | None
    model_worst: float | None
    baseline_median: float | None
    baseline_worst: float | None


def _stats(errors: list[float]) -> tuple[float | None, float | None]:
    if not errors:
        return None, None
    return statistics.median(abs(e) for e in errors), max(errors, key=abs)


def summarize(rows: tuple[Evaluated, ...]) -> list[Summary]:
    """Median |error| and worst error per regime, over held-out points the model predicts."""
    out = []
    regimes = ["concurrency 1", "concurrency > 1", "concurrency unknown", "at equal interactivity", "all held out"]
    for regime in regimes:
        sel = [
            r
            for r in rows
            if r.split == "eval"
            and (r.error, r.baseline_error) != (None, None)
            and (regime == "all held out" or r.regime == regime)
        ]
        if not sel:
            continue
        model = [r.error for r in sel if r.error is not None]
        base = [r.baseline_error for r in sel if r.baseline_error is not None]
        out.append(Summary(regime, len(model), len(base), *_stats(model), *_stats(base)))
    return out


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
        "| point | setting | metric | published | model (range) | error | k·τ | k·τ error | split |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.point
        span = (
            ""
            if r.predicted_range is None or r.predicted_range[0] == r.predicted_range[1]
            else (f" ({_num(r.predicted_range[0])}–{_num(r.predicted_range[1])})")
        )
        lines.append(
            f"| {p.id} | {p.setting} | {p.metric} | {p.bound}{_num(p.published)} | {_num(r.predicted)}{span} | "
            f"{_pct(r.error)} | {_num(r.baseline_predicted)} | {_pct(r.baseline_error)} | {r.split} |"
        )
    lines += [
        "",
        "| held-out regime | model points | model median abs error | model worst | k·τ points | "
        "k·τ median abs error | k·τ worst |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summarize(rows):
        lines.append(
            f"| {s.regime} | {s.model_points} | {_abs_pct(s.model_median)} | {_pct(s.model_worst)} | "
            f"{s.baseline_points} | {_abs_pct(s.baseline_median)} | {_pct(s.baseline_worst)} |"
        )
    return "\n".join(lines)


SHAPE_OVERHEADS_S = (1.0e-3, 0.5e-3, 0.25e-3, 0.1e-3)  # assumed alternatives to the transferred trtllm overhead
SHAPE_TAUS = (3.7, 4.6, 5.4)  # low, middle and high of the card's block-10 acceptance lengths
SHAPE_BAND = (500.0, 600.0)


@dataclass(frozen=True)
class BandShape:
    """The >15x claim's shape under one per-step overhead: AR's single-user ceiling and DFlash's ratio."""

    step_overhead_s: float
    ar_ceiling_tok_s_user: float
    ratios: dict[float, tuple[float | None, float | None]]  # tau -> ratio at the band's low and high ends
    users: dict[float, int]  # tau -> largest swept concurrency at which DFlash still serves the band's middle


def band_shape() -> list[BandShape]:
    """gpt-oss-120b on 8x B300 (MXFP4): how the ratio at 500-600 tok/s/user depends on the runtime's overhead."""
    tgt, drafter = PAIRS["gpt-oss-120b"].load()
    ctx = mean_context(1024, 1024)
    transferred = calibration("trtllm").step_overhead_s
    rows = []
    for overhead in (transferred, *SHAPE_OVERHEADS_S):
        dep = Deployment(get_gpu("b300"), "mxfp4", "bf16", 8, replace(Calibration("trtllm"), step_overhead_s=overhead))
        ceiling = Method("ar").iteration(tgt, 1, ctx, dep).tok_s_user()
        ratios, users = {}, {}
        for tau in SHAPE_TAUS:
            method = Method("dflash", drafter, Acceptance.from_mean(tau, drafter.block_size))
            lo, hi = (band_ratio(method, Method("ar"), tgt, dep, x, ctx) for x in SHAPE_BAND)
            ratios[tau] = (lo, hi)
            curve = predict_curve(method, tgt, dep, BAND_CONCURRENCIES, ctx)
            users[tau] = max([p.concurrency for p in curve if p.tok_s_user >= sum(SHAPE_BAND) / 2] or [0])
        rows.append(BandShape(overhead, ceiling, ratios, users))
    return rows


def markdown_band_shape(rows: list[BandShape]) -> str:
    head = " | ".join(f"τ {t}: ratio at 500 / 600, users at 550" for t in SHAPE_TAUS)
    lines = [f"| per-step overhead | AR at concurrency 1 | {head} |", "|---" * (2 + len(SHAPE_TAUS)) + "|"]
    for r in rows:
        cells = " | ".join(f"{_num(r.ratios[t][0])} / {_num(r.ratios[t][1])}, {r.users[t]}" for t in SHAPE_TAUS)
        lines.append(f"| {1e3 * r.step_overhead_s:.2f} ms | {r.ar_ceiling_tok_s_user:.0f} tok/s/user | {cells} |")
    return "\n".join(lines)
