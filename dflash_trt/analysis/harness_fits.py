"""One committed calibration per harness, fitted on the rows `published.FIT_ROWS` names, with its error band.

Which terms a harness's rows can tell apart decides what is fitted (`fitting.identifiable`): the collective
slowdown needs rows at two TP widths, the per-sequence and per-token terms rows at two concurrencies, the
speculative overhead AR rows beside speculative ones (or speedups of two pairs). Every other term is taken from
the harness's donor, a related runtime (`DONORS`): SGLang spec v2 keeps spec v1's AR side (AR decoding does not
go through either speculative worker), vLLM its per-sequence terms. TensorRT-LLM publishes no absolute figure for
these pairs, so its calibration is SGLang spec v2's, transferred whole.

The error band a calibration carries (relative, one standard deviation) combines, in quadrature: the residuals of
its fit rows; the harness's drift between versions (`published.DRIFT_PAIRS`: the same SGLang sweep on the same
B200 five weeks apart, measured for SGLang only and assumed for every harness); and, for a transferred
calibration, the spread between the fitted runtimes' step times over a reference grid.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import replace

from dflash_trt.analysis import rows
from dflash_trt.analysis.fitting import Equation, fit_terms, identifiable
from dflash_trt.analysis.gpus import get_gpu
from dflash_trt.analysis.model import Acceptance, Calibration, Deployment, Method
from dflash_trt.analysis.published import DRIFT_PAIRS, FIT_ROWS, Published, point
from dflash_trt.decoding_modes import AR, DFLASH
from dflash_trt.errors import DFlashTrtError

DONORS: dict[str, str | None] = {
    "hf-transformers": None,
    "sglang-v1": None,
    "sglang-v2": "sglang-v1",
    "vllm": "sglang-v1",
    "trtllm": "sglang-v2",
}
HARNESSES = tuple(DONORS)
# The TensorRT-LLM engine switches to NCCL by message size; the other runtimes keep their custom kernel.
ALGORITHM = {"trtllm": "trtllm-auto"}
TRANSFERRED = tuple(h for h in HARNESSES if h not in FIT_ROWS)
# Fitted first where a donor supplies the AR side; first alone otherwise (AR rows then fit the per-step term).
PRIORITY_WITH_DONOR = ("spec_overhead_s", "token_overhead_s", "step_overhead_s", "sequence_overhead_s")
PRIORITY_ALONE = ("step_overhead_s", "token_overhead_s", "spec_overhead_s", "sequence_overhead_s")
BATCH_TERMS = ("token_overhead_s", "sequence_overhead_s")
# Where the transferred calibration's spread is measured: Qwen3-8B AR and DFlash (tau 6.55) at 1024/1024.
TRANSFER_GPUS, TRANSFER_TPS, TRANSFER_CONCURRENCIES = ("h100", "b200"), (1, 8), (1, 32)


def drift() -> float:
    """RMS relative error of a harness's newer figure taken as a prediction of its older one."""
    errors = [point(new).published / point(old).published - 1.0 for new, old in DRIFT_PAIRS]
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def free_terms(points: list[Published], eqs: list[Equation], with_donor: bool) -> list[str]:
    """The terms these rows can tell apart (see the module docstring)."""
    tps, concurrencies = rows.spans(points)
    order = PRIORITY_WITH_DONOR if with_donor else PRIORITY_ALONE
    candidates = [t for t in order if t not in BATCH_TERMS or len(concurrencies) > 1]
    free = identifiable(eqs, candidates)
    if len(tps) > 1 and max(tps) > 1:
        free.append("collective_slowdown")
    return free


def _row_error(p: Published, cal: Calibration) -> float:
    values = [v for s in rows.settings(p) if (v := rows.value(p, s, cal)) is not None]
    return statistics.median(values) / p.published - 1.0


def _fit_band(points: list[Published], cal: Calibration, n_free: int) -> float:
    """RMS relative error over the fit rows, with the degrees of freedom the fit used taken out."""
    errors = [_row_error(p, cal) for p in points]
    dof = len(errors) - n_free
    return math.sqrt(sum(e * e for e in errors) / dof) if dof > 0 else 0.0


def _fitted(harness: str, points: list[Published], base: Calibration, with_donor: bool) -> Calibration:
    eqs = [e for p in points for e in rows.equations(p, base)]
    free = free_terms(points, eqs, with_donor)
    cal = fit_terms(eqs, free, base)
    eqs = [e for p in points for e in rows.equations(p, cal)]  # speedup rows' weights at the fitted times
    cal = fit_terms(eqs, free, base)
    fit_band, run_drift = _fit_band(points, cal, len(free)), drift()
    ids = ", ".join(p.id for p in points)
    kept = [f for f in ("collective_slowdown", *PRIORITY_ALONE) if f not in free]
    donor = f"; {', '.join(kept)} from {base.name}" if kept and with_donor else ""
    return replace(
        cal,
        name=harness,
        source=f"{', '.join(free)} fitted on {ids}{donor}",
        error_band=math.hypot(fit_band, run_drift),
        band_source=f"fit rows' RMS error {100 * fit_band:.1f}% and version drift {100 * run_drift:.1f}% "
        "(SGLang, five weeks apart), in quadrature",
    )


@functools.cache
def _calibration(harness: str, excluded: frozenset[str]) -> Calibration:
    if harness not in DONORS:
        raise DFlashTrtError(f"unknown calibration {harness!r} (known: {', '.join(HARNESSES)})")
    donor_name = DONORS[harness]
    donor = None if donor_name is None else _calibration(donor_name, excluded)
    points = [p for p in map(point, FIT_ROWS.get(harness, ())) if p.source not in excluded]
    if points:
        base = replace(donor or Calibration(), allreduce_algorithm=ALGORITHM.get(harness, "custom"))
        return _fitted(harness, points, base, donor is not None)
    if donor is None:
        return Calibration(harness, source=f"no rows to fit {harness} on: assumed defaults")
    return replace(
        donor,
        name=harness,
        source=f"assumed equal to {donor.name}: {donor.source}",
        allreduce_algorithm=ALGORITHM.get(harness, "custom"),
    )


def calibration(harness: str, excluded_sources: frozenset[str] = frozenset()) -> Calibration:
    """The harness's committed calibration (fitted without the rows of `excluded_sources`); a transferred one
    carries the spread between fitted runtimes in its band."""
    cal = _calibration(harness, excluded_sources)
    if harness in TRANSFERRED and not excluded_sources:
        spread = transfer_spread(cal, DONORS[harness] or harness)
        return replace(
            cal,
            error_band=math.hypot(cal.error_band, spread),
            band_source=f"{cal.band_source}; plus {100 * spread:.1f}% for the transfer (the RMS spread of the other "
            "fitted serving runtimes' step times around it over Qwen3-8B, H100 / B200, TP 1 / 8, concurrency 1 / 32)",
        )
    return cal


def transfer_spread(reference: Calibration, donor: str) -> float:
    """RMS relative difference of the other fitted serving runtimes' iteration times (all but `donor` and the
    transformers harness, which is no serving runtime) from `reference`'s."""
    tgt, drafter = rows.shapes("qwen3-8b")
    methods = (Method(AR), Method(DFLASH, drafter, Acceptance.from_mean(6.55, drafter.block_size)))
    others = [_calibration(h, frozenset()) for h in FIT_ROWS if h not in ("hf-transformers", donor)]
    diffs = []
    for gpu in TRANSFER_GPUS:
        for tp in TRANSFER_TPS:
            for c in TRANSFER_CONCURRENCIES:
                for m in methods:
                    cost = m.step(tgt, c, 1024 + 512, Deployment(get_gpu(gpu), "bf16", "bf16", tp))
                    ref = reference.seconds(cost)
                    diffs += [other.seconds(cost) / ref - 1.0 for other in others]
    return math.sqrt(sum(d * d for d in diffs) / len(diffs))


def fit_row_ids() -> set[str]:
    return {i for ids in FIT_ROWS.values() for i in ids}
