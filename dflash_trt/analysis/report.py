"""Plots of sweep points and frontiers: a self-contained HTML page (inline SVG) and, with matplotlib, a PNG.

The HTML needs no library and no network, so a sweep host without plotting packages still produces a report
that can be copied anywhere and opened in a browser.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from pathlib import Path

from dflash_trt.analysis.pareto import BandRow, Point, group_by_engine, pareto_frontier
from dflash_trt.decoding_modes import AR, EAGLE3
from dflash_trt.errors import DFlashTrtError

Y_LABEL_GPU = "output tok/s per GPU"
Y_LABEL_CPU = "output tok/s (whole server or CPU host)"
# One colour per engine, in sorted name order, for the HTML and the PNG alike.
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
_W, _H, _M = 720, 440, 64


LOG_SCALE = " (log scale)"


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Plain values to label a log axis from lo to hi with: 1-2-5 per decade, finer steps when that gives fewer
    than two (a narrow range, e.g. one point's), and the range's middle as a last resort."""
    for mantissas in ((1, 2, 5), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8)):
        ticks = [
            m * 10.0**e
            for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
            for m in mantissas
            if lo <= m * 10.0**e <= hi
        ]
        if len(ticks) >= 2:
            return ticks
    return [float(f"{math.sqrt(lo * hi):.2g}")]


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 else f"{v:g}"


def y_label(records: Sequence[dict]) -> str:
    """Per GPU only when every measured point knows its GPUs (a CPU golden-model point, and an OpenAI server's
    without --gpus, record `gpus` 0)."""
    return Y_LABEL_GPU if all(r.get("gpus", 1) for r in records if r.get("status") == "ok") else Y_LABEL_CPU


def _engine_colors(points: Sequence[Point]) -> list[tuple[str, str, list[Point]]]:
    return [
        (name, _COLORS[i % len(_COLORS)], pts) for i, (name, pts) in enumerate(sorted(group_by_engine(points).items()))
    ]


def render_svg(points: Sequence[Point], x_label: str, y_axis: str = Y_LABEL_GPU) -> str:
    """Log-log scatter of all points, each labelled with its concurrency, with each engine's frontier as a line."""
    if not points:
        raise DFlashTrtError("no successful points to plot")
    xs = [p.tok_s_user for p in points]
    ys = [p.tok_s_gpu for p in points]
    x_lo, x_hi = min(xs) / 1.3, max(xs) * 1.3
    y_lo, y_hi = min(ys) / 1.3, max(ys) * 1.3

    def sx(v: float) -> float:
        return _M + (math.log(v) - math.log(x_lo)) / (math.log(x_hi) - math.log(x_lo)) * (_W - 2 * _M)

    def sy(v: float) -> float:
        return _H - _M - (math.log(v) - math.log(y_lo)) / (math.log(y_hi) - math.log(y_lo)) * (_H - 2 * _M)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" font-family="sans-serif" font-size="11">',
        f'<rect x="{_M}" y="{_M}" width="{_W - 2 * _M}" height="{_H - 2 * _M}" fill="none" stroke="#444"/>',
    ]
    for t in _log_ticks(x_lo, x_hi):
        parts.append(f'<line x1="{sx(t):.1f}" y1="{_M}" x2="{sx(t):.1f}" y2="{_H - _M}" stroke="#ddd"/>')
        parts.append(f'<text x="{sx(t):.1f}" y="{_H - _M + 14}" text-anchor="middle">{_fmt(t)}</text>')
    for t in _log_ticks(y_lo, y_hi):
        parts.append(f'<line x1="{_M}" y1="{sy(t):.1f}" x2="{_W - _M}" y2="{sy(t):.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{_M - 4}" y="{sy(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    parts.append(f'<text x="{_W / 2}" y="{_H - 16}" text-anchor="middle">{html.escape(x_label + LOG_SCALE)}</text>')
    rotate = f"rotate(-90 14 {_H / 2})"
    y_text = html.escape(y_axis + LOG_SCALE)
    parts.append(f'<text x="14" y="{_H / 2}" text-anchor="middle" transform="{rotate}">{y_text}</text>')
    for i, (name, color, pts) in enumerate(_engine_colors(points)):
        front = pareto_frontier(pts)
        path = " ".join(f"{sx(p.tok_s_user):.1f},{sy(p.tok_s_gpu):.1f}" for p in front)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for p in pts:
            parts.append(
                f'<circle cx="{sx(p.tok_s_user):.1f}" cy="{sy(p.tok_s_gpu):.1f}" r="3.5" fill="{color}">'
                f"<title>{html.escape(name)} c={p.concurrency}: {p.tok_s_user:.1f} tok/s/user, "
                f"{p.tok_s_gpu:.1f} {html.escape(y_axis)}</title></circle>"
            )
            x, y = sx(p.tok_s_user) + 5, sy(p.tok_s_gpu) - 5
            parts.append(f'<text x="{x:.1f}" y="{y:.1f}" fill="{color}">c={p.concurrency}</text>')
        parts.append(f'<rect x="{_M + 10}" y="{_M + 8 + 16 * i}" width="10" height="10" fill="{color}"/>')
        parts.append(f'<text x="{_M + 26}" y="{_M + 17 + 16 * i}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


Table = tuple[str, Sequence[str], Sequence[Sequence[str]]]


def render_html(
    points: Sequence[Point], x_label: str, title: str, tables: Sequence[Table] = (), y_axis: str = Y_LABEL_GPU
) -> str:
    """One page: the plot, then each (caption, header, rows) table; all text escaped, no scripts or links."""
    body = [f"<h1>{html.escape(title)}</h1>", render_svg(points, x_label, y_axis)]
    for caption, header, rows in tables:
        body.append(f"<h2>{html.escape(caption)}</h2><table>")
        body.append("<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
        for row in rows:
            body.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
        body.append("</table>")
    style = (
        "body{font-family:sans-serif;margin:24px}table{border-collapse:collapse;margin-bottom:16px}"
        "td,th{border:1px solid #bbb;padding:3px 8px;text-align:right}"
    )
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def write_png(
    points: Sequence[Point], x_label: str, path: str | Path, title: str = "", y_axis: str = Y_LABEL_GPU
) -> bool:
    """Matplotlib PNG of the HTML's plot (same title, colours, labels and statistic); returns False (and writes
    nothing) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, color, pts in _engine_colors(points):
        front = pareto_frontier(pts)
        ax.plot([p.tok_s_user for p in front], [p.tok_s_gpu for p in front], "-", color=color, label=name)
        ax.plot([p.tok_s_user for p in pts], [p.tok_s_gpu for p in pts], "o", color=color)
        for p in pts:
            ax.annotate(
                f"c={p.concurrency}",
                (p.tok_s_user, p.tok_s_gpu),
                textcoords="offset points",
                xytext=(4, 4),
                color=color,
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis, values in ((ax.xaxis, [p.tok_s_user for p in points]), (ax.yaxis, [p.tok_s_gpu for p in points])):
        lo, hi = min(values) / 1.3, max(values) * 1.3  # the HTML plot's range and ticks
        (ax.set_xlim if axis is ax.xaxis else ax.set_ylim)(lo, hi)
        axis.set_major_locator(FixedLocator(_log_ticks(lo, hi)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: _fmt(v)))
        axis.set_minor_locator(NullLocator())
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(x_label + LOG_SCALE)
    ax.set_ylabel(y_axis + LOG_SCALE)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Title": title, "Software": "dflash-trt"})
    plt.close(fig)
    return True


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _equal_concurrency_table(groups: dict[str, list[Point]], names: list[str], unit: str, baseline: str) -> Table:
    """Each engine's measured throughput at every concurrency the baseline ran too, and its ratio there: a
    comparison of two measured points, no interpolation."""
    measured = {name: {p.concurrency: p.tok_s_gpu for p in groups[name]} for name in names}
    rows = []
    for concurrency in sorted(measured[baseline]):
        base = measured[baseline][concurrency]
        values = [measured[n].get(concurrency) for n in names]
        rows.append(
            [str(concurrency)]
            + ["-" if v is None else f"{v:.1f}" for v in values]
            + [_ratio(None if v is None else v / base) for v in values]
        )
    header = ["concurrency", *[f"{n} {unit}" for n in names], *[f"{n} vs {baseline}" for n in names]]
    return f"{unit} at equal concurrency (measured points), and speedup over {baseline} there", header, rows


def _comparison_tables(
    rows: Sequence[BandRow], crossovers: dict[str, float | None], names: list[str], unit: str, baseline: str
) -> list[Table]:
    """Throughput and speedup over the baseline at equal interactivity, and where speculation stops paying."""
    return [
        (
            f"{unit} at equal interactivity (same tok/s/user, interpolated along each frontier: the engines run at "
            f"different concurrencies there), and speedup over {baseline} there",
            ["tok/s/user", *[f"{n} {unit}" for n in names], *[f"{n} vs {baseline}" for n in names]],
            [
                [f"{r.tok_s_user:.1f}"]
                + ["-" if r.throughput[n] is None else f"{r.throughput[n]:.1f}" for n in names]
                + [_ratio(r.speedup[n]) for n in names]
                for r in rows
            ],
        ),
        (
            f"Concurrency where speculation stops paying ({unit} <= {baseline} at equal concurrency)",
            ["engine", "crossover concurrency"],
            [[n, "none in the swept range" if c is None else f"{c:.1f}"] for n, c in sorted(crossovers.items())],
        ),
    ]


def analyze_records(
    records: Sequence[dict],
    user_metric: str,
    levels: Sequence[float] | None,
    out_dir: str | Path,
    extra_tables: Sequence[Table] = (),
    title: str = "DFlash sweep: throughput vs interactivity",
) -> dict:
    """Frontiers, speedups at equal interactivity and crossover concurrencies; writes report.html (+ PNG).

    Levels default to the AR frontier's own interactivity values, the only ones where a ratio to AR exists;
    without AR points the report holds the plot and frontiers only.
    """
    from dflash_trt.analysis.pareto import crossover_concurrency, speedup_table
    from dflash_trt.analysis.sweep import USER_SPEED_METRICS, points_from_records

    points = points_from_records(records, user_metric)
    modes = {r["engine"]: r["kind"] for r in records}
    groups = group_by_engine(points)
    ar = [name for name in groups if modes.get(name) == AR]
    # Without an AR engine there is nothing to divide by: the plot and frontiers only.
    baseline = ar[0] if ar else None
    frontiers = {name: pareto_frontier(pts) for name, pts in groups.items()}
    if levels is None:
        levels = [p.tok_s_user for p in frontiers[baseline]] if baseline else []
    rows = speedup_table(points, baseline, levels) if baseline else []
    eagle = [name for name in groups if modes.get(name) == EAGLE3]
    eagle_rows = speedup_table(points, eagle[0], levels) if eagle and baseline else []
    crossovers = {
        name: crossover_concurrency(pts, groups[baseline]).concurrency
        for name, pts in groups.items()
        if baseline and name != baseline
    }
    failed = [
        {"engine": r["engine"], "concurrency": r["concurrency"], "error": r.get("error")}
        for r in records
        if r.get("status") != "ok"
    ]
    x_label = USER_SPEED_METRICS[user_metric]
    y_axis = y_label(records)
    unit = "tok/s/GPU" if y_axis == Y_LABEL_GPU else "tok/s (CPU)"
    summary: dict[str, object] = {
        "user_metric": user_metric,
        "x_axis": x_label,
        "y_axis": y_axis,
        "baseline": baseline,
        "frontiers": {
            name: [{"concurrency": p.concurrency, "tok_s_user": p.tok_s_user, "tok_s_gpu": p.tok_s_gpu} for p in f]
            for name, f in frontiers.items()
        },
        "speedup_vs_ar": [{"tok_s_user": r.tok_s_user, "throughput": r.throughput, "speedup": r.speedup} for r in rows],
        "speedup_vs_eagle3": [{"tok_s_user": r.tok_s_user, "speedup": r.speedup} for r in eagle_rows],
        "crossover_concurrency_vs_ar": crossovers,
        "failed_points": failed,
    }
    tables: list[Table] = list(extra_tables)
    if baseline is not None:
        tables.append(_equal_concurrency_table(groups, sorted(groups), unit, baseline))
        tables += _comparison_tables(rows, crossovers, sorted(groups), unit, baseline)
    if failed:
        tables.append(("Failed points", ["engine", "concurrency", "error"], [list(f.values()) for f in failed]))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.html").write_text(render_html(points, x_label, title, tables, y_axis))
    summary["png_written"] = write_png(points, x_label, out / "pareto.png", title, y_axis)
    return summary
