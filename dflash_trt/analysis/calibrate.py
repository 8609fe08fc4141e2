"""Fit the model's overhead terms to a user's own `dflash-trt bench` results and report residuals per point.

The roofline part stays as it is (datasheet peaks, assumed efficiencies, collectives priced by `comm.py`); only
the terms a roofline cannot see are fitted, with the same least-squares fit as the published harnesses
(`fitting.py`), on the terms the points can tell apart. The measured acceptance length of each DFlash point is
what the model is given, so the residuals judge the time model, not the drafter.

A fit is only valid where it was measured: `write_calibration` stamps it with the hardware, backend, target,
engine settings and ISL/OSL of the results (from their `provenance` object), and `load_calibration` hands the
stamp back so that `plan` can refuse to apply it to other hardware.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dflash_trt.analysis.comm import ALGORITHMS
from dflash_trt.analysis.fitting import fit_terms, identifiable, time_equation
from dflash_trt.analysis.gpus import GPUS
from dflash_trt.analysis.model import Acceptance, Calibration, Deployment, DFlashShape, Method, TargetShape
from dflash_trt.analysis.sweep import write_json_atomic
from dflash_trt.bench.results import read_results
from dflash_trt.decoding_modes import AR, DFLASH, DecodingMode
from dflash_trt.errors import DFlashTrtError

# Fitted first to last where the points can tell the terms apart: AR points fit the per-step overhead.
PRIORITY = ("step_overhead_s", "token_overhead_s", "spec_overhead_s", "sequence_overhead_s")
# A bench run writes one point per mode and concurrency; each costs a model evaluation per search step, so the
# fit is bounded here rather than left to run for hours on a file of a million points.
MAX_POINTS = 1000


@dataclass(frozen=True)
class MeasuredPoint:
    """One (mode, concurrency) point of a bench run: what the fit needs from it."""

    mode: DecodingMode  # dflash or ar
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


BACKENDS = ("trtllm", "triton", "golden", "emulation", "openai")


@dataclass(frozen=True)
class BenchResults:
    """What a fit needs from one results.json: its points, where they ran, and the mean lengths they ran at."""

    points: list[MeasuredPoint]
    provenance: dict | None
    lengths: tuple[int, int] | None


def _lengths(data: dict) -> tuple[int, int] | None:
    """Mean prompt and output tokens over every request of every point (None when no request is recorded)."""
    requests = [r for p in data["points"] if isinstance(p.get("per_request"), list) for r in p["per_request"]]
    sizes = [
        (r["input_len"], len(r["output_ids"]))
        for r in requests
        if isinstance(r, dict) and isinstance(r.get("input_len"), int) and isinstance(r.get("output_ids"), list)
    ]
    if not sizes or min(min(s) for s in sizes) < 1:
        return None
    return round(sum(i for i, _ in sizes) / len(sizes)), round(sum(o for _, o in sizes) / len(sizes))


def _provenance(data: dict, path: Path) -> dict | None:
    prov = data.get("provenance")
    if prov is None:
        return None
    host = prov.get("host") if isinstance(prov, dict) else None
    if (
        not isinstance(prov, dict)
        or prov.get("backend") not in BACKENDS
        or not isinstance(prov.get("target"), str)
        or not isinstance(host, dict)
        or not isinstance(host.get("cpu"), str)
        or not isinstance(host.get("gpus"), list)
        or not all(isinstance(g, str) for g in host["gpus"])
    ):
        raise DFlashTrtError(
            f"{path}: provenance must hold backend (one of {', '.join(BACKENDS)}), target and host.cpu / host.gpus"
        )
    return prov


def read_bench_results(path: str | Path) -> BenchResults:
    """Points of a `dflash-trt bench` results.json (read by the schema's own reader, `bench.results.read_results`),
    its `provenance` object when present, and the mean ISL/OSL of its requests."""
    path = Path(path)
    data = read_results(path)
    if not data["points"]:
        raise DFlashTrtError(f"{path}: expected a non-empty 'points' list")
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
        if mode not in (DFLASH, AR):
            raise DFlashTrtError(f"{where}: mode must be 'dflash' or 'ar', got {mode!r}")
        if p.get("concurrency") is None and p.get("request_rate") is not None:
            continue  # an open-loop point: its concurrency is whatever the arrivals made it, not a model input
        conc = p.get("concurrency")
        if isinstance(conc, bool) or not isinstance(conc, int) or conc < 1:
            raise DFlashTrtError(f"{where}: concurrency must be a positive integer, got {conc!r}")
        tau = 1.0 if mode == AR else _number(p, "acceptance_length", where)
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
    return BenchResults(points, _provenance(data, path), _lengths(data))


def hardware_of(provenance: dict) -> str:
    """The GPU table's key for the results' first GPU ("h200" for "NVIDIA H200"), its raw name when the table
    lacks it, or "cpu: <model>" for a CPU-only run."""
    gpus = provenance["host"]["gpus"]
    if not gpus:
        return f"cpu: {provenance['host']['cpu']}"
    name = gpus[0].lower()
    return next((key for key in GPUS if key in name), gpus[0])


CALIBRATION_FORMAT = "dflash-trt-calibration/2"
STAMP_KEYS = ("hardware", "gpus", "backend", "target", "gpu", "tp_size", "precision", "kv_dtype", "isl", "osl")


def write_calibration(path: str | Path, cal: Calibration, stamp: dict, overwrite: bool = False) -> None:
    """The calibration and where it was measured, written whole or not at all; an existing file is kept unless
    `overwrite`."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise DFlashTrtError(f"{path} exists: pass --overwrite to replace it")
    write_json_atomic(path, {"format": CALIBRATION_FORMAT, "calibration": vars(cal), "stamp": stamp})


def load_calibration(path: str | Path) -> tuple[Calibration, dict]:
    """A calibration written by `write_calibration`, checked field by field, and its stamp."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DFlashTrtError(f"cannot read calibration {path}: {exc}") from None
    if isinstance(data, dict) and data.get("format") == "dflash-trt-calibration/1":
        raise DFlashTrtError(
            f"{path} was written by an older plan --calibrate (format 1, without the collective and per-sequence "
            "terms): fit it again from its results with plan --calibrate --output"
        )
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        raise DFlashTrtError(f"{path} is not a calibration file ({CALIBRATION_FORMAT}, written by plan --calibrate)")
    fields, stamp = data.get("calibration"), data.get("stamp")
    if not isinstance(fields, dict) or not isinstance(stamp, dict) or set(STAMP_KEYS) - set(stamp):
        raise DFlashTrtError(f"{path}: needs a 'calibration' object and a 'stamp' with {', '.join(STAMP_KEYS)}")
    numbers = [k for k, v in vars(Calibration()).items() if isinstance(v, float)]
    texts = [k for k, v in vars(Calibration()).items() if isinstance(v, str)]
    for key in numbers:
        value = fields.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise DFlashTrtError(f"{path}: calibration.{key} must be a finite number >= 0, got {value!r}")
    for key in ("bandwidth_efficiency", "compute_efficiency"):
        if not 0 < fields[key] <= 1:
            raise DFlashTrtError(f"{path}: calibration.{key} must lie in (0, 1], got {fields[key]!r}")
    for key in texts:
        if not isinstance(fields.get(key), str):
            raise DFlashTrtError(f"{path}: calibration.{key} must be a string")
    if fields["allreduce_algorithm"] not in ALGORITHMS:
        raise DFlashTrtError(f"{path}: calibration.allreduce_algorithm must be one of {', '.join(ALGORITHMS)}")
    values: dict[str, Any] = {k: fields[k] for k in texts} | {k: float(fields[k]) for k in numbers}
    return Calibration(**values), stamp


@dataclass(frozen=True)
class Residual:
    point: MeasuredPoint
    predicted_tok_s_user: float

    @property
    def error(self) -> float:
        return self.predicted_tok_s_user / self.point.tok_s_user - 1.0


@functools.cache
def _acceptance(mean: float, block: int) -> Acceptance:
    return Acceptance.from_mean(mean, block)


def _method(p: MeasuredPoint, drafter: DFlashShape | None) -> Method:
    if p.mode == AR:
        return Method(AR)
    if drafter is None:
        raise DFlashTrtError("the bench results hold DFlash points: the drafter's shape is needed")
    if p.acceptance_length > drafter.block_size:
        raise DFlashTrtError(
            f"measured acceptance length {p.acceptance_length} exceeds the drafter's block {drafter.block_size}"
        )
    return Method(DFLASH, drafter, _acceptance(p.acceptance_length, drafter.block_size))


def fit(
    points: list[MeasuredPoint],
    target: TargetShape,
    drafter: DFlashShape | None,
    dep: Deployment,
    ctx: float,
    source: str,
) -> tuple[Calibration, list[Residual]]:
    """The deployment's calibration with its overheads fitted to `points` (each DFlash point at its own measured
    acceptance length), and each point's residual.

    Every point is one observed iteration time (1 / tok/s/user, times its acceptance length for DFlash). Fitted
    are the terms the points can tell apart (`fitting.identifiable`), the per-step overhead first: the speculative
    overhead needs AR points beside DFlash ones, the per-sequence and per-token terms several concurrencies; the
    collective slowdown, which needs two TP widths, stays at the kernels' own time. The error band is the points'
    RMS residual: drift between versions of the runtime is not measured by one results file."""
    base = replace(Calibration(), bandwidth_efficiency=dep.calibration.bandwidth_efficiency,
                   compute_efficiency=dep.calibration.compute_efficiency)  # fmt: skip
    d = replace(dep, calibration=base)
    methods = [_method(p, drafter) for p in points]
    costs = [m.step(target, p.concurrency, ctx, d) for m, p in zip(methods, points, strict=True)]
    times = [
        (1.0 if m.acceptance is None else m.acceptance.mean()) / p.tok_s_user
        for m, p in zip(methods, points, strict=True)
    ]
    eqs = [time_equation(c, t) for c, t in zip(costs, times, strict=True)]
    batch_terms = len({p.concurrency for p in points}) > 1
    candidates = [t for t in PRIORITY if batch_terms or t not in ("token_overhead_s", "sequence_overhead_s")]
    free = identifiable(eqs, candidates)
    cal = fit_terms(eqs, free, base)
    d = replace(dep, calibration=cal)
    residuals = [
        Residual(p, m.iteration(target, p.concurrency, ctx, d).tok_s_user())
        for m, p in zip(methods, points, strict=True)
    ]
    dof = len(residuals) - len(free)
    band = math.sqrt(sum(r.error**2 for r in residuals) / dof) if dof > 0 else 0.0
    cal = replace(
        cal,
        name="measured",
        source=f"{', '.join(free) or 'nothing'} fitted on the {len(points)} closed-loop points of {source}",
        error_band=band,
        band_source="the points' RMS residual; drift between versions of the runtime is not measured",
    )
    return cal, [Residual(r.point, r.predicted_tok_s_user) for r in residuals]
