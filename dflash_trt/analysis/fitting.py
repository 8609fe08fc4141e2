"""Fit a harness's overhead terms to observed rows: one weighted, non-negative linear least-squares problem.

An iteration's time is the roofline plus each fitted term of `model.OVERHEAD_FIELDS` times the count it
multiplies (`StepCost.terms`), so every observation is a linear equation in those terms:

* a throughput or per-user speed row observes one iteration time T: terms . x = T - roofline, weighted 1 / T
  (a relative residual);
* a speedup row observes S = tau x T_ar / T_spec: (tau terms_ar - S terms_spec) . x = S roofline_spec -
  tau roofline_ar, weighted 1 / (tau T_ar).

Only the terms the rows can tell apart are fitted (`free`); the others keep a stated value (`fixed`). The
non-negative solution with the least weighted squared residual is found exactly: every subset of the free
terms is solved by ordinary least squares and the best feasible one kept (at most 2^5 small solves). numpy is
imported where it is used, so that `dflash-trt plan --help` stays light.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from dflash_trt.analysis.model import OVERHEAD_FIELDS, Calibration, StepCost
from dflash_trt.errors import DFlashTrtError


@dataclass(frozen=True)
class Equation:
    """terms . x = rhs for the fitted terms x (in `OVERHEAD_FIELDS` order), with a weight on its residual."""

    terms: tuple[float, ...]
    rhs: float
    weight: float


def time_equation(cost: StepCost, observed_s: float) -> Equation:
    """An observed iteration time."""
    if not (math.isfinite(observed_s) and observed_s > 0):
        raise DFlashTrtError(f"an observed iteration time must be positive, got {observed_s}")
    return Equation(cost.terms(), observed_s - cost.roofline_s, 1.0 / observed_s)


def speedup_equation(ar: StepCost, spec: StepCost, tau: float, speedup: float, ar_seconds: float) -> Equation:
    """An observed speedup of a speculative iteration yielding `tau` tokens over an AR one (`ar_seconds`, the AR
    iteration's time under the current estimate, sets the weight)."""
    terms = tuple(tau * a - speedup * s for a, s in zip(ar.terms(), spec.terms(), strict=True))
    return Equation(terms, speedup * spec.roofline_s - tau * ar.roofline_s, 1.0 / (tau * ar_seconds))


def _solve(a: Any, b: Any) -> Any:
    """Non-negative least squares by exhaustive subsets (few columns) of numpy arrays."""
    import numpy as np

    n = a.shape[1]
    best: tuple[float, Any] | None = None
    for mask in itertools.product((False, True), repeat=n):
        cols = [i for i in range(n) if mask[i]]
        x = np.zeros(n)
        if cols:
            sol = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if (sol < 0).any():
                continue
            x[cols] = sol
        err = float(np.sum((a @ x - b) ** 2))
        if best is None or err < best[0] - 1e-18:
            best = (err, x)
    assert best is not None  # the empty subset is always feasible
    return best[1]


def fit_terms(equations: Sequence[Equation], free: Sequence[str], fixed: Calibration) -> Calibration:
    """`fixed` with its `free` terms replaced by the best non-negative fit to `equations`."""
    unknown = [f for f in free if f not in OVERHEAD_FIELDS]
    if unknown:
        raise DFlashTrtError(f"cannot fit {', '.join(unknown)} (fittable: {', '.join(OVERHEAD_FIELDS)})")
    if not equations:
        raise DFlashTrtError("nothing to fit: no observations")
    import numpy as np

    cols = [OVERHEAD_FIELDS.index(f) for f in free]
    held = [(i, getattr(fixed, f)) for i, f in enumerate(OVERHEAD_FIELDS) if f not in free]
    a = np.array([[e.terms[i] * e.weight for i in cols] for e in equations]).reshape(len(equations), len(cols))
    b = np.array([(e.rhs - sum(e.terms[i] * v for i, v in held)) * e.weight for e in equations])
    x = _solve(a, b) if cols else np.zeros(0)
    values: dict[str, Any] = {f: float(v) for f, v in zip(free, x, strict=True)}
    return replace(fixed, **values)


def identifiable(equations: Sequence[Equation], candidates: Sequence[str]) -> list[str]:
    """The candidates, in order, whose columns add rank to the weighted design matrix: a term the rows cannot tell
    apart from the ones already kept (a constant column beside the per-step term, say) is left to its stated
    value instead of being fitted to noise."""
    import numpy as np

    kept: list[str] = []
    columns: list[Any] = []
    for name in candidates:
        i = OVERHEAD_FIELDS.index(name)
        col = np.array([e.terms[i] * e.weight for e in equations])
        norm = float(np.linalg.norm(col))
        if norm == 0.0:
            continue
        trial = np.column_stack([*columns, col / norm])
        if np.linalg.matrix_rank(trial, tol=1e-6) > len(columns):
            kept.append(name)
            columns.append(col / norm)
    return kept
