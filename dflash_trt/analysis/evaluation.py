"""The model against every published row: one committed prediction with its error band, beside two baselines.

Each harness's calibration is fitted on the rows `published.FIT_ROWS` names (`harness_fits`); every other row is
held out. A row whose source leaves settings open is predicted at every candidate setting and the median is the
committed prediction; the candidates' spread widens its band. Each held-out row is also given to two trivial
baselines: `speedup = k * tau` (k fitted on the fit rows' speedups) and persistence (the same source's
concurrency-1 figure for the same setting carried to its higher concurrencies: the speedup stays, or each user's
speed stays), so the tables show where the roofline adds anything. `leave_one_source_out` refits every harness
without one source's rows and predicts that source, the check a held-out source gets.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

from dflash_trt.analysis import harness_fits, rows
from dflash_trt.analysis.model import Calibration
from dflash_trt.analysis.published import FIT_ROWS, POINTS, SOURCES, Published, Unknown, point


def predict(p: Published, cal: Calibration) -> tuple[float | None, float]:
    """The committed prediction (the median over the candidate settings) and the settings' relative spread."""
    if not rows.evaluable(p):
        return None, 0.0
    values = [v for s in rows.settings(p) if (v := rows.value(p, s, cal)) is not None]
    if not values:
        return None, 0.0
    lo, hi = min(values), max(values)
    return statistics.median(values), (hi - lo) / (hi + lo)


def derived(p: Published) -> bool:
    """A row computed from other published figures of its source (an AR baseline = throughput / speedup)."""
    return p.note.startswith("derived")


def baseline(p: Published, k: float) -> float | None:
    """speedup = k * tau; it has no notion of absolute throughput."""
    if p.metric != "speedup" or not rows.evaluable(p):
        return None
    return statistics.median(k * s["tau"] for s in rows.settings(p))


def fit_ids() -> set[str]:
    """The fit rows, and the speedup rows their throughputs imply (both sides of the ratio are fit rows)."""
    ids = harness_fits.fit_row_ids()
    implied = {i.replace("-dflash", "-speedup") for i in ids if i.replace("-dflash", "-ar") in ids}
    return ids | (implied & {p.id for p in POINTS})


@functools.cache
def baseline_k(harness: str | None = None) -> float:
    """k of speedup = k * tau (a one-user baseline), least relative squares over the single-user speedups among
    the fit rows of `harness` (of every harness when it has none, or when `harness` is None)."""
    fit = [p for p in map(point, sorted(fit_ids())) if p.metric == "speedup" and p.concurrency == 1]
    own = [p for p in fit if p.harness == harness]
    pairs = [(s["tau"], p.published) for p in (own or fit) for s in rows.settings(p)]
    return sum(t / s for t, s in pairs) / sum((t / s) ** 2 for t, s in pairs)


def _family(p: Published) -> tuple:
    return (p.source, p.pair, p.method, p.block, p.harness, p.metric, p.num_gpus, p.gpu)


def anchor(p: Published) -> Published | None:
    """The same source's concurrency-1 figure for the same setting, for a row above concurrency 1."""
    if not isinstance(p.concurrency, int) or p.concurrency <= 1:
        return None
    return next((q for q in POINTS if _family(q) == _family(p) and q.concurrency == 1), None)


def persistence(p: Published) -> float | None:
    """The concurrency-1 figure carried over: the same speedup, or each user as fast as alone (tok/s x users)."""
    a = anchor(p)
    if a is None or not isinstance(p.concurrency, int):
        return None
    return a.published * (p.concurrency if p.metric == "tok_s" else 1)


def duplicate_of(p: Published) -> str | None:
    """An earlier row of the same source with the same inputs and the same figure: it adds no evidence."""
    key = (p.source, p.pair, p.method, p.harness, p.concurrency, p.num_gpus, p.tau, p.published)
    for q in POINTS:
        if q is p:
            return None
        if (q.source, q.pair, q.method, q.harness, q.concurrency, q.num_gpus, q.tau, q.published) == key:
            return q.id
    return None


def k_tau_by_construction(p: Published) -> bool:
    """At concurrency 1 the model's step time does not depend on tau, so for a fit row's own pair, method, harness
    and deployment its speedup is k * tau with k set by that row: such rows cannot show the model doing better."""
    key = (p.pair, p.method, p.harness, p.metric, p.num_gpus, p.gpu)
    return (
        p.concurrency == 1
        and p.metric == "speedup"
        and any((f.pair, f.method, f.harness, f.metric, f.num_gpus, f.gpu) == key for f in map(point, fit_ids()))
    )


def single_value(value: object) -> object:
    """An unknown with one candidate stands for that candidate (a derived or assumed single setting)."""
    return value.values[0] if isinstance(value, Unknown) and len(value.values) == 1 else value


@dataclass(frozen=True)
class Evaluated:
    """One published row next to the model's committed prediction, its band and the two baselines."""

    point: Published
    split: str  # "fit", "eval" or "duplicate"
    predicted: float | None
    band: float | None  # relative, one standard deviation
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
    def within_band(self) -> bool | None:
        if self.error is None or self.band is None:
            return None
        return abs(math.log1p(self.error)) <= math.log1p(self.band)

    @property
    def regime(self) -> str:
        p = self.point
        if p.metric == "ratio_at_interactivity":
            return "at equal interactivity"
        concurrency = single_value(p.concurrency)
        if isinstance(concurrency, Unknown):
            return "concurrency unknown"
        if p.metric == "tok_s":
            return "tok/s"
        return "speedup, concurrency 1" if concurrency == 1 else "speedup, concurrency > 1"

    def as_json(self) -> dict:
        p = self.point
        return {
            "id": p.id,
            "source": SOURCES[p.source],
            "setting": p.setting,
            "metric": p.metric,
            "published": p.published,
            "bound": p.bound or None,
            "derived": derived(p),
            "predicted": self.predicted,
            "band": self.band,
            "error": self.error,
            "within_band": self.within_band,
            "baselines": {"k_tau": self.k_tau, "persistence": self.persistence},
            "baseline_errors": {"k_tau": self.k_tau_error, "persistence": self.persistence_error},
            "split": self.split,
            "duplicate_of": duplicate_of(p),
            "k_tau_by_construction": k_tau_by_construction(p),
            "concurrency": single_value(p.concurrency) if isinstance(single_value(p.concurrency), int) else None,
            "tp": p.num_gpus,
            "regime": self.regime,
            "harness": p.harness,
            "calibration": vars(harness_fits.calibration(p.harness)),
            "unknowns": {k: {"values": list(v.values), "kind": v.kind, "why": v.why} for k, v in vars(p).items()
                         if isinstance(v, Unknown)},
            "note": p.note,
        }  # fmt: skip


def evaluate_one(p: Published, split: str, cal: Calibration) -> Evaluated:
    value, spread = predict(p, cal) if split != "duplicate" else (None, 0.0)
    band = None if value is None else math.hypot(cal.error_band, spread)
    return Evaluated(p, split, value, band, baseline(p, baseline_k(p.harness)), persistence(p))


@functools.cache
def evaluate() -> tuple[Evaluated, ...]:
    fitted = fit_ids()
    out = []
    for p in POINTS:
        split = "fit" if p.id in fitted else "duplicate" if duplicate_of(p) else "eval"
        out.append(evaluate_one(p, split, harness_fits.calibration(p.harness)))
    return tuple(out)


@dataclass(frozen=True)
class LosoRow:
    """One fit source's rows predicted with every harness refitted without them, beside the full fit."""

    source: str
    rows: int
    median_without: float | None
    median_with: float | None  # over the same source's held-out rows, with its fit rows in the fit
    worst_without: float | None


def _median_abs(values: list[float | None]) -> float | None:
    got = [abs(v) for v in values if v is not None]
    return statistics.median(got) if got else None


@functools.cache
def leave_one_source_out() -> tuple[LosoRow, ...]:
    """Every source with fit rows, predicted from calibrations fitted on the other sources only."""
    full = {r.point.id: r for r in evaluate()}
    out = []
    for source in sorted({point(i).source for ids in FIT_ROWS.values() for i in ids}):
        excluded = frozenset({source})
        mine = [p for p in POINTS if p.source == source and not derived(p) and full[p.id].split != "duplicate"]
        without = [evaluate_one(p, "eval", harness_fits.calibration(p.harness, excluded)).error for p in mine]
        held = [full[p.id].error for p in mine if full[p.id].split == "eval"]
        worst = max((e for e in without if e is not None), key=abs, default=None)
        out.append(LosoRow(source, len(mine), _median_abs(without), _median_abs(held), worst))
    return tuple(out)
