"""Frontier, interpolation, speedup and crossover on hand-checkable data; HTML report rendering."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.analysis.pareto import (
    Point,
    crossover_concurrency,
    pareto_frontier,
    speedup_at,
    speedup_table,
    throughput_at,
)
from dflash_trt.analysis.report import render_html
from dflash_trt.errors import DFlashTrtError


def P(x, y, c=1, engine="e"):
    return Point(engine, c, float(x), float(y))


def test_frontier_drops_dominated_points_and_orders_by_interactivity():
    pts = [P(10, 100), P(20, 90), P(15, 80), P(30, 50), P(30, 40), P(5, 100)]
    front = pareto_frontier(pts)
    assert [(p.tok_s_user, p.tok_s_gpu) for p in front] == [(10, 100), (20, 90), (30, 50)]


def test_throughput_interpolates_along_frontier_and_never_extrapolates():
    front = pareto_frontier([P(10, 100), P(20, 90), P(30, 50)])
    assert throughput_at(front, 25) == pytest.approx(70.0)
    assert throughput_at(front, 10) == pytest.approx(100.0)
    assert throughput_at(front, 30) == pytest.approx(50.0)
    assert throughput_at(front, 35) is None
    assert throughput_at(front, 9) == pytest.approx(100.0)  # the slowest frontier point already serves 9
    assert throughput_at([], 10) is None


def test_speedup_at_equal_interactivity():
    spec = pareto_frontier([P(100, 1000), P(400, 200)])
    base = pareto_frontier([P(50, 500), P(200, 50)])
    # At 150 tok/s/user: spec 1000 - (50/300)*800 = 866.67; base 500 - (100/150)*450 = 200.
    assert speedup_at(spec, base, 150) == pytest.approx(866.6667 / 200.0, rel=1e-5)
    assert speedup_at(spec, base, 300) is None  # the baseline cannot reach 300 tok/s/user


def test_speedup_table_against_baseline():
    pts = [
        Point("ar", 1, 100.0, 100.0), Point("ar", 8, 50.0, 400.0),
        Point("dflash", 1, 300.0, 300.0), Point("dflash", 8, 150.0, 1200.0),
    ]  # fmt: skip
    (row,) = speedup_table(pts, "ar", [100.0])
    assert row.throughput["ar"] == pytest.approx(100.0)
    assert row.throughput["dflash"] == pytest.approx(1200.0)
    assert row.speedup == {"ar": pytest.approx(1.0), "dflash": pytest.approx(12.0)}
    with pytest.raises(DFlashTrtError, match="baseline"):
        speedup_table(pts, "eagle3", [100.0])


def test_crossover_interpolates_in_log2_concurrency():
    spec = [P(0, 200, 1), P(0, 300, 2), P(0, 200, 4), P(0, 900, 8)]
    base = [P(0, 100, 1), P(0, 200, 2), P(0, 400, 4), P(0, 800, 8)]
    spec = [Point("s", p.concurrency, 1.0, p.tok_s_gpu) for p in spec]
    base = [Point("b", p.concurrency, 1.0, p.tok_s_gpu) for p in base]
    cross = crossover_concurrency(spec, base)
    # ratio 1.5 at c2, 0.5 at c4: reaches 1 halfway in log2 space -> 2 ** 1.5.
    assert cross.concurrency == pytest.approx(2**1.5)
    assert cross.pays_at == (1, 2, 8) and cross.loses_at == (4,)


def test_crossover_absent_when_speculation_always_pays():
    spec = [Point("s", c, 1.0, 2.0 * c) for c in (1, 2, 4)]
    base = [Point("b", c, 1.0, 1.0 * c) for c in (1, 2, 4)]
    assert crossover_concurrency(spec, base).concurrency is None
    with pytest.raises(DFlashTrtError, match="share no concurrency"):
        crossover_concurrency(spec, [Point("b", 16, 1.0, 1.0)])


def test_non_positive_values_are_refused():
    with pytest.raises(DFlashTrtError, match="positive"):
        pareto_frontier([P(0, 1)])
    with pytest.raises(DFlashTrtError, match="positive"):
        pareto_frontier([P(1, math.nan)])


coords = st.floats(min_value=0.01, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(coords, coords), min_size=1, max_size=30))
def test_frontier_is_exactly_the_non_dominated_set(pairs):
    pts = [P(x, y) for x, y in pairs]
    front = pareto_frontier(pts)
    key = {(p.tok_s_user, p.tok_s_gpu) for p in front}

    def dominated(p):
        return any(
            q.tok_s_user >= p.tok_s_user
            and q.tok_s_gpu >= p.tok_s_gpu
            and (q.tok_s_user, q.tok_s_gpu) != (p.tok_s_user, p.tok_s_gpu)
            for q in pts
        )

    assert key == {(p.tok_s_user, p.tok_s_gpu) for p in pts if not dominated(p)}
    assert all(a.tok_s_user < b.tok_s_user and a.tok_s_gpu > b.tok_s_gpu for a, b in pairwise(front))


def test_html_report_is_self_contained_and_lists_every_engine():
    pts = [Point("ar", 1, 100.0, 100.0), Point("ar", 8, 50.0, 400.0), Point("dflash <b>", 1, 300.0, 300.0)]
    html = render_html(pts, "tok/s/user = 1000 / TPOT", title="t")
    assert html.startswith("<!DOCTYPE html>") and "<svg" in html
    assert (
        "dflash &lt;b&gt;" in html
        and "<script" not in html
        and "http" not in html.replace("http://www.w3.org/2000/svg", "")
    )


def test_png_and_html_show_the_same_title_colours_labels_and_axes(tmp_path, monkeypatch):
    """The PNG is drawn by matplotlib, the HTML by hand: the figure matplotlib holds and the SVG the page holds
    must name the same title, axes, per-engine colours and concurrency labels."""
    import re

    import matplotlib
    import matplotlib.colors
    import matplotlib.pyplot as plt

    from dflash_trt.analysis.report import LOG_SCALE, Y_LABEL_CPU, write_png

    matplotlib.use("Agg")
    pts = [Point("ar", 1, 100.0, 100.0), Point("ar", 8, 50.0, 400.0), Point("dflash", 1, 300.0, 300.0)]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert write_png(pts, "tok/s/user", tmp_path / "p.png", title="T on CPU", y_axis=Y_LABEL_CPU)
    page = render_html(pts, "tok/s/user", "T on CPU", y_axis=Y_LABEL_CPU)
    (ax,) = figures[0].axes
    assert ax.get_title() == "T on CPU" and ax.get_ylabel() == Y_LABEL_CPU + LOG_SCALE and Y_LABEL_CPU in page
    assert "per GPU" not in page and ax.get_xscale() == ax.get_yscale() == "log"
    assert f"tok/s/user{LOG_SCALE}" in page and ax.get_xlabel() == f"tok/s/user{LOG_SCALE}"
    png_colours = {
        line.get_label(): matplotlib.colors.to_hex(line.get_color())
        for line in ax.get_lines()
        if not line.get_label().startswith("_")
    }
    svg_colours = dict(
        zip(
            re.findall(r'<text x="\d+" y="[\d.]+">(\w+)</text>', page),
            re.findall(r'<rect x="\d+" y="[\d.]+" width="10" height="10" fill="(#\w+)"', page),
            strict=True,
        )
    )
    assert png_colours == svg_colours == {"ar": svg_colours["ar"], "dflash": svg_colours["dflash"]}
    png_labels = sorted(text.get_text() for text in ax.texts)
    assert png_labels == sorted(re.findall(r">(c=\d+)</text>", page)) == ["c=1", "c=1", "c=8"]


def test_a_one_point_plot_has_plain_tick_labels_and_the_png_carries_its_title(tmp_path, monkeypatch):
    """A single point spans less than one 1-2-5 step: both axes still get at least one plain label (hand-checked:
    37 tok/s/user plots from 28.5 to 48.1, labelled 30 and 40; 148 tok/s from 113.8 to 192.4, labelled 120 and 150), and
    the PNG's text chunk holds the title."""
    import matplotlib.pyplot as plt
    from PIL import Image

    from dflash_trt.analysis.report import write_png

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    title = "dflash-trt bench\nmodel | 8 prompts | 2026-01-01"
    assert write_png([Point("dflash", 4, 37.0, 148.0)], "tok/s/user", tmp_path / "one.png", title=title)
    (ax,) = figures[0].axes
    figures[0].canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["30", "40"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["120", "150"]
    page = render_html([Point("dflash", 4, 37.0, 148.0)], "tok/s/user", title)
    assert ">30</text>" in page and ">40</text>" in page
    assert Image.open(tmp_path / "one.png").text["Title"] == title


def test_the_report_compares_measured_points_at_equal_concurrency(tmp_path):
    """Beside the interpolated equal-interactivity table, a table of measured points only: dflash 300 vs ar 100
    tok/s at concurrency 1 is 3.00x (hand-computed), and a concurrency only one engine ran shows no ratio."""
    from dflash_trt.analysis.report import analyze_records

    def record(engine: str, kind: str, concurrency: int, user: float, total: float) -> dict:
        return {"engine": engine, "kind": kind, "concurrency": concurrency, "status": "ok", "gpus": 0,
                "tok_s_user_tpot": user, "tok_s_gpu": total}  # fmt: skip

    records = [record("ar", "ar", 1, 100.0, 100.0), record("ar", "ar", 8, 50.0, 400.0)]
    records += [record("dflash", "dflash", 1, 300.0, 300.0), record("dflash", "dflash", 4, 200.0, 800.0)]
    analyze_records(records, "tpot", None, tmp_path)
    page = (tmp_path / "report.html").read_text()
    table = page.split("at equal concurrency (measured points)")[1].split("</table>")[0]
    assert "<td>1</td><td>100.0</td><td>300.0</td><td>1.00x</td><td>3.00x</td>" in table
    assert "<td>8</td><td>400.0</td><td>-</td><td>1.00x</td><td>-</td>" in table
    assert "interpolated along each frontier" in page
