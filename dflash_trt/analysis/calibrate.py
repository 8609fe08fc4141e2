"""Fit the model's overhead constants to a user's own `dflash-trt bench` results and report residuals per point.

The roofline part stays as it is (datasheet peaks, assumed efficiencies); only the two overheads a roofline
cannot see are fitted: `step_overhead_s` on the AR points (every iteration pays it) and then `spec_overhead_s`
on the DFlash points (what a speculative iteration costs beyond that). With no AR points, the DFlash points fit
`step_overhead_s` alone. The measured acceptance length of each DFlash point is what the model is given, so the
residuals judge the time model, not the drafter.

A fit is only valid where it was measured: `write_calibration` stamps it with the hardware, backend, target,
engine settings and ISL/OSL of the results (from their `provenance` object), and `load_calibration` hands the
stamp back so that `plan` can refuse to apply it to other hardware.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_trt.analysis.gpus import GPUS
from dflash_trt.analysis.model import Acceptance, Calibration, Deployment, DFlashShape, Method, TargetShape
from dflash_trt.analysis.sweep import write_json_atomic
from dflash_trt.decoding_modes import AR, DFLASH, DecodingMode
from dflash_trt.errors import DFlashTrtError

OVERHEAD_SEARCH_S = (0.0, 0.05)
TOKEN_OVERHEAD_SEARCH_S = (0.0, 1e-3)
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
    """Points of a `dflash-trt bench` results.json ({"points": [...]}, keys of the bench results schema), its
    `provenance` object when present, and the mean ISL/OSL of its requests.

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


CALIBRATION_FORMAT = "dflash-trt-calibration/1"
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
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        raise DFlashTrtError(f"{path} is not a calibration file ({CALIBRATION_FORMAT}, written by plan --calibrate)")
    fields, stamp = data.get("calibration"), data.get("stamp")
    if not isinstance(fields, dict) or not isinstance(stamp, dict) or set(STAMP_KEYS) - set(stamp):
        raise DFlashTrtError(f"{path}: needs a 'calibration' object and a 'stamp' with {', '.join(STAMP_KEYS)}")
    numbers = {k: v for k, v in vars(Calibration()).items() if isinstance(v, float)}
    for key in numbers:
        value = fields.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise DFlashTrtError(f"{path}: calibration.{key} must be a finite number >= 0, got {value!r}")
    for key in ("bandwidth_efficiency", "compute_efficiency"):
        if not 0 < fields[key] <= 1:
            raise DFlashTrtError(f"{path}: calibration.{key} must lie in (0, 1], got {fields[key]!r}")
    name, source = fields.get("name"), fields.get("source")
    if not isinstance(name, str) or not isinstance(source, str):
        raise DFlashTrtError(f"{path}: calibration.name and calibration.source must be strings")
    return Calibration(name, source, **{k: float(fields[k]) for k in numbers}), stamp


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


def _predict(p: MeasuredPoint, target: TargetShape, drafter: DFlashShape | None, dep: Deployment, ctx: float):
    if p.mode == AR:
        return Method(AR).iteration(target, p.concurrency, ctx, dep).tok_s_user()
    if drafter is None:
        raise DFlashTrtError("the bench results hold DFlash points: the drafter's shape is needed")
    if p.acceptance_length > drafter.block_size:
        raise DFlashTrtError(
            f"measured acceptance length {p.acceptance_length} exceeds the drafter's block {drafter.block_size}"
        )
    method = Method(DFLASH, drafter, _acceptance(p.acceptance_length, drafter.block_size))
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
    """The deployment's calibration with its overheads fitted to `points`, and each point's residual.

    `step_overhead_s` on the AR points (the DFlash points when there are none), then `spec_overhead_s` on the
    DFlash points; when the first set spans several concurrencies, `token_overhead_s` is fitted with the step
    overhead (per token the target takes, so what a larger batch adds beyond the roofline)."""

    def loss(cal: Calibration, subset: list[MeasuredPoint]) -> float:
        d = replace(dep, calibration=cal)
        return sum((_predict(p, target, drafter, d, ctx) / p.tok_s_user - 1.0) ** 2 for p in subset)

    ar = [p for p in points if p.mode == AR]
    spec = [p for p in points if p.mode == DFLASH]
    base = replace(dep.calibration, step_overhead_s=0.0, spec_overhead_s=0.0, token_overhead_s=0.0)
    first = ar or spec

    def with_step(token: float) -> Calibration:
        cal = replace(base, token_overhead_s=token)
        step = golden_min(lambda v: loss(replace(cal, step_overhead_s=v), first), *OVERHEAD_SEARCH_S)
        return replace(cal, step_overhead_s=step)

    several = len({p.concurrency for p in first}) > 1
    token = golden_min(lambda t: loss(with_step(t), first), *TOKEN_OVERHEAD_SEARCH_S, 40) if several else 0.0
    cal = with_step(token)
    what = "step_overhead_s" + (" and token_overhead_s" if several else "")
    fitted = [f"{what} on the " + ("AR" if ar else "DFlash") + " points"]
    if ar and spec:
        extra = golden_min(lambda v: loss(replace(cal, spec_overhead_s=v), spec), *OVERHEAD_SEARCH_S)
        cal = replace(cal, spec_overhead_s=extra)
        fitted.append("spec_overhead_s on the DFlash points")
    cal = replace(cal, name="measured", source=f"{' and '.join(fitted)} of {source}")
    d = replace(dep, calibration=cal)
    return cal, [Residual(p, _predict(p, target, drafter, d, ctx)) for p in points]
