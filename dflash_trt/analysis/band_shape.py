"""The shape of NVIDIA's ">15x the users of AR at 500-600 tok/s/user" (gpt-oss-120b, 8x B300): how the ratio at
equal interactivity depends on the runtime's fixed per-step cost, which no source publishes for TensorRT-LLM."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.analysis import harness_fits
from dflash_trt.analysis.gpus import get_gpu
from dflash_trt.analysis.memory import EngineLimits, feasible_curve
from dflash_trt.analysis.model import Acceptance, Calibration, Deployment, Method, mean_context
from dflash_trt.analysis.rows import BAND_CONCURRENCIES, band_ratio, shapes
from dflash_trt.decoding_modes import AR, DFLASH

SHAPE_OVERHEADS_S = (1.0e-3, 0.5e-3, 0.25e-3, 0.1e-3)  # assumed alternatives: a per-step overhead alone
SHAPE_TAUS = (3.7, 4.6, 5.4)  # low, middle and high of the card's block-10 acceptance lengths
SHAPE_BAND = (500.0, 600.0)
SHAPE_LENGTHS = (1024, 1024)


@dataclass(frozen=True)
class BandShape:
    """The >15x claim's shape under one calibration: AR's single-user ceiling and DFlash's ratio."""

    label: str
    ar_ceiling_tok_s_user: float
    ratios: dict[float, tuple[float | None, float | None]]  # tau -> ratio at the band's low and high ends
    users: dict[float, int]  # tau -> largest batch that fits and still serves the band's middle


def _shape(label: str, cal: Calibration) -> BandShape:
    tgt, drafter = shapes("gpt-oss-120b")
    dep = Deployment(get_gpu("b300"), "mxfp4", "bf16", 8, cal)
    ceiling = Method(AR).iteration(tgt, 1, mean_context(*SHAPE_LENGTHS), dep).tok_s_user()
    ratios, users = {}, {}
    for tau in SHAPE_TAUS:
        method = Method(DFLASH, drafter, Acceptance.from_mean(tau, drafter.block_size))
        lo, hi = (band_ratio(method, Method(AR), tgt, dep, x, SHAPE_LENGTHS) for x in SHAPE_BAND)
        ratios[tau] = (lo, hi)
        curve = feasible_curve(method, tgt, dep, BAND_CONCURRENCIES, SHAPE_LENGTHS, EngineLimits())
        middle = sum(SHAPE_BAND) / 2
        users[tau] = max([fp.batch for fp in curve if fp.point and fp.point.tok_s_user >= middle] or [0])
    return BandShape(label, ceiling, ratios, users)


def band_shape() -> list[BandShape]:
    """gpt-oss-120b on 8x B300 (MXFP4) under the committed TensorRT-LLM calibration, then under a per-step overhead
    alone (collectives at their kernels' own time)."""
    committed = harness_fits.calibration("trtllm")
    return [_shape("committed trtllm calibration", committed)] + [
        _shape(f"{1e3 * o:.2f} ms per step alone", Calibration("assumed", step_overhead_s=o)) for o in SHAPE_OVERHEADS_S
    ]


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"


def markdown_band_shape(rows: list[BandShape]) -> str:
    head = " | ".join(f"τ {t}: ratio at 500 / 600, users at 550" for t in SHAPE_TAUS)
    lines = [f"| runtime cost | AR at concurrency 1 | {head} |", "|---" * (2 + len(SHAPE_TAUS)) + "|"]
    for r in rows:
        cells = " | ".join(f"{_num(r.ratios[t][0])} / {_num(r.ratios[t][1])}, {r.users[t]}" for t in SHAPE_TAUS)
        lines.append(f"| {r.label} | {r.ar_ceiling_tok_s_user:.0f} tok/s/user | {cells} |")
    return "\n".join(lines)
