"""The overhead fit: terms recovered from times the model itself produced, only the terms the rows can tell
apart fitted, never a negative term."""

from __future__ import annotations

import pytest

from dflash_trt.analysis.fitting import fit_terms, identifiable, speedup_equation, time_equation
from dflash_trt.analysis.gpus import get_gpu
from dflash_trt.analysis.model import OVERHEAD_FIELDS, Acceptance, Calibration, Deployment, Method
from dflash_trt.analysis.published import PAIRS

TRUTH = Calibration(
    collective_slowdown=2.5,
    step_overhead_s=6e-4,
    spec_overhead_s=1.2e-3,
    sequence_overhead_s=3e-5,
    token_overhead_s=5e-6,
)


def _steps(tps=(1, 8), concurrencies=(1, 32)):
    tgt, drafter = PAIRS["qwen3-8b"].load()
    methods = (Method("ar"), Method("dflash", drafter, Acceptance.from_mean(6.4, 16)))
    return [
        m.step(tgt, c, 400, Deployment(get_gpu("h200"), "bf16", "bf16", tp))
        for tp in tps for c in concurrencies for m in methods
    ]  # fmt: skip


def test_every_term_is_recovered_from_rows_that_tell_them_apart():
    costs = _steps()
    eqs = [time_equation(c, TRUTH.seconds(c)) for c in costs]
    free = identifiable(eqs, OVERHEAD_FIELDS)
    assert sorted(free) == sorted(OVERHEAD_FIELDS)
    fitted = fit_terms(eqs, free, Calibration())
    for field in OVERHEAD_FIELDS:
        assert getattr(fitted, field) == pytest.approx(getattr(TRUTH, field), rel=1e-6)
    assert all(fitted.seconds(c) == pytest.approx(TRUTH.seconds(c), rel=1e-9) for c in costs)


def test_terms_the_rows_cannot_separate_are_not_fitted():
    # One TP width and one concurrency: the collectives are the same share of every AR and DFlash step and the
    # per-sequence and per-token counts move with the per-step one, so only the per-step and speculative terms
    # stay (in the order asked).
    costs = _steps(tps=(1,), concurrencies=(4,))
    eqs = [time_equation(c, TRUTH.seconds(c)) for c in costs]
    assert identifiable(eqs, ("step_overhead_s", "sequence_overhead_s", "spec_overhead_s")) == [
        "step_overhead_s",
        "spec_overhead_s",
    ]
    # DFlash rows alone cannot tell a speculative overhead from a per-step one.
    dflash = [time_equation(c, TRUTH.seconds(c)) for c in costs if c.speculative]
    assert identifiable(dflash, ("step_overhead_s", "spec_overhead_s")) == ["step_overhead_s"]


def test_speedup_rows_fit_the_same_terms():
    tgt, drafter = PAIRS["qwen3-8b"].load()
    tgt4, drafter4 = PAIRS["qwen3-4b"].load()
    truth = Calibration(step_overhead_s=2e-3, spec_overhead_s=3e-4)
    eqs = []
    for t, d in ((tgt, drafter), (tgt4, drafter4)):
        dep = Deployment(get_gpu("b200"))
        ar = Method("ar").step(t, 1, 300, dep)
        spec = Method("dflash", d, Acceptance.from_mean(6.5, 16)).step(t, 1, 300, dep)
        speedup = 6.5 * truth.seconds(ar) / truth.seconds(spec)
        eqs.append(speedup_equation(ar, spec, 6.5, speedup, truth.seconds(ar)))
    fitted = fit_terms(eqs, ["step_overhead_s", "spec_overhead_s"], Calibration())
    assert (fitted.step_overhead_s, fitted.spec_overhead_s) == pytest.approx((2e-3, 3e-4), rel=1e-6)


def test_no_term_goes_negative_and_fixed_terms_keep_their_values():
    costs = _steps(tps=(1,))
    # Times below the roofline's own: the unconstrained fit would need negative overheads.
    eqs = [time_equation(c, 0.5 * c.roofline_s) for c in costs]
    fixed = Calibration(collective_slowdown=1.7)
    fitted = fit_terms(eqs, ["step_overhead_s", "spec_overhead_s"], fixed)
    assert fitted.step_overhead_s == 0.0 and fitted.spec_overhead_s == 0.0
    assert fitted.collective_slowdown == 1.7
