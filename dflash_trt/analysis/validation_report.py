"""The tables `plan --validate` prints and docs/performance.md carries: every row, the summaries per regime and
per source (fit rows and validation rows apart), the goals the held-out rows are checked against, and the
leave-one-source-out check."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from dflash_trt.analysis import harness_fits
from dflash_trt.analysis.evaluation import (
    Evaluated,
    derived,
    duplicate_of,
    k_tau_by_construction,
    leave_one_source_out,
)

REGIMES = (
    "speedup, concurrency 1",
    "speedup, concurrency > 1",
    "tok/s",
    "concurrency unknown",
    "at equal interactivity",
)
# The goals held-out rows are judged against: above one user the model's median speedup error at most this share
# of persistence's; at one user and on throughput at most this median error.
GOAL_VS_PERSISTENCE = 0.6
GOAL_MEDIAN_ERROR = 0.12


@dataclass(frozen=True)
class Summary:
    """One group of rows: per predictor (rows, median |error|, largest-magnitude error), and the model's rows whose
    published value lies inside the band."""

    group: str
    model: tuple[int, float | None, float | None]
    k_tau: tuple[int, float | None, float | None]
    persistence: tuple[int, float | None, float | None]
    within_band: tuple[int, int]


def _stats(errors: list[float | None]) -> tuple[int, float | None, float | None]:
    got = [e for e in errors if e is not None]
    if not got:
        return 0, None, None
    return len(got), statistics.median(abs(e) for e in got), max(got, key=abs)


def _summary(group: str, rows: list[Evaluated]) -> Summary:
    bands = [r.within_band for r in rows if r.within_band is not None]
    return Summary(
        group,
        _stats([r.error for r in rows]),
        _stats([r.k_tau_error for r in rows]),
        _stats([r.persistence_error for r in rows]),
        (sum(bands), len(bands)),
    )


def summarize(rows: tuple[Evaluated, ...]) -> list[Summary]:
    """Held-out rows per regime (derived rows, which repeat two published figures, left out), then every source's
    fit rows and validation rows apart."""
    counted = [r for r in rows if not derived(r.point) and r.split != "duplicate"]
    held = [r for r in counted if r.split == "eval" and (r.error, r.k_tau_error, r.persistence_error) != (None,) * 3]
    out = [_summary(regime, sel) for regime in REGIMES if (sel := [r for r in held if r.regime == regime])]
    informative = [r for r in held if r.regime == REGIMES[0] and not k_tau_by_construction(r.point)]
    out.append(_summary(f"{REGIMES[0]}, rows not k·τ by construction", informative))
    both = [r for r in held if r.regime == REGIMES[1] and r.persistence is not None and r.error is not None]
    out.append(_summary(f"{REGIMES[1]}, rows all three predict", both))
    for source in sorted({r.point.source for r in counted}):
        for split, label in (("fit", "fit rows"), ("eval", "validation rows")):
            sel = [r for r in counted if r.point.source == source and r.split == split]
            if sel:
                out.append(_summary(f"{source}: {label}", sel))
    out.append(_summary("all held out", held))
    return out


def goals(summaries: list[Summary]) -> list[tuple[str, float | None, float, bool | None]]:
    """(goal, achieved, target, met) for the held-out checks the model is judged by."""
    by = {s.group: s for s in summaries}
    above = by.get(f"{REGIMES[1]}, rows all three predict")
    ratio = None
    if above and above.model[1] is not None and above.persistence[1]:
        ratio = above.model[1] / above.persistence[1]
    out = [("above one user: median speedup error over persistence's", ratio, GOAL_VS_PERSISTENCE)]
    for group in (REGIMES[0], REGIMES[2]):
        s = by.get(group)
        out.append((f"{group}: median error", None if s is None else s.model[1], GOAL_MEDIAN_ERROR))
    return [(g, v, t, None if v is None else v <= t) for g, v, t in out]


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.1f}%"


def _abs_pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _row(r: Evaluated) -> str:
    p = r.point
    model = "-" if r.predicted is None else f"{_num(r.predicted)} ±{_abs_pct(r.band)}"
    inside = {None: "-", True: "yes", False: "no"}[r.within_band]
    split = f"duplicate of {duplicate_of(p)}" if r.split == "duplicate" else r.split
    split += ", derived" if derived(p) else ""
    return (
        f"| {p.id} | {p.setting} | {p.metric} | {p.bound}{_num(p.published)} | {model} | {_pct(r.error)} | {inside} | "
        f"{_num(r.k_tau)} | {_pct(r.k_tau_error)} | {_num(r.persistence)} | {_pct(r.persistence_error)} | {split} |"
    )


def markdown_tables(rows: tuple[Evaluated, ...]) -> str:
    """Every row, the summaries, the goals and the leave-one-source-out check."""
    lines = [
        "| point | setting | metric | published | model ± band | error | in band | k·τ | k·τ error | persistence | "
        "persistence error | split |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *map(_row, rows),
        "",
        "| group | model rows | model median abs error | model worst | in band | k·τ rows | k·τ median | k·τ worst | "
        "persistence rows | persistence median | persistence worst |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    summaries = summarize(rows)
    for s in summaries:
        n, med, worst = s.model
        inside = "-" if not s.within_band[1] else f"{s.within_band[0]}/{s.within_band[1]}"
        rest = " | ".join(f"{k} | {_abs_pct(m)} | {_pct(w)}" for k, m, w in (s.k_tau, s.persistence))
        lines.append(f"| {s.group} | {n} | {_abs_pct(med)} | {_pct(worst)} | {inside} | {rest} |")
    lines += ["", "| goal (held-out rows) | achieved | target | met |", "|---|---|---|---|"]
    for goal, value, target, met in goals(summaries):
        ratio = goal.startswith("above one user")
        shown = "-" if value is None else (f"{value:.2f}" if ratio else _abs_pct(value))
        aim = f"{target:.2f}" if ratio else _abs_pct(target)
        lines.append(f"| {goal} | {shown} | ≤ {aim} | {'-' if met is None else 'yes' if met else 'no'} |")
    lines += [
        "",
        "| source left out of every fit | rows | median abs error without it | worst | median abs error of its "
        "held-out rows with it |",
        "|---|---|---|---|---|",
    ]
    for loso in leave_one_source_out():
        lines.append(
            f"| {loso.source} | {loso.rows} | {_abs_pct(loso.median_without)} | {_pct(loso.worst_without)} | "
            f"{_abs_pct(loso.median_with)} |"
        )
    return "\n".join(lines)


def markdown_calibrations() -> str:
    """One row per harness: every fitted term, the error band, and what it was fitted on."""
    lines = [
        "| harness | collectives × | per step | per speculative step | per sequence | per token | band | fitted on |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for harness in harness_fits.HARNESSES:
        c = harness_fits.calibration(harness)
        lines.append(
            f"| {harness} | {c.collective_slowdown:.2f} | {1e3 * c.step_overhead_s:.3f} ms | "
            f"{1e3 * c.spec_overhead_s:.3f} ms | {1e6 * c.sequence_overhead_s:.1f} µs | "
            f"{1e6 * c.token_overhead_s:.2f} µs | ±{100 * c.error_band:.0f}% | {c.source} |"
        )
    return "\n".join(lines)
