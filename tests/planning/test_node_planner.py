"""`plan --node`: the users a node serves at a per-user speed, checked against a brute-force search."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dflash_trt.analysis.gpus import get_gpu
from dflash_trt.analysis.memory import EngineLimits, batch_limit, budget, draft_len
from dflash_trt.analysis.model import Acceptance, Calibration, Deployment, Method, mean_context
from dflash_trt.analysis.node import best_layout, parse_node
from dflash_trt.analysis.published import PAIRS
from dflash_trt.cli import main
from dflash_trt.errors import DFlashTrtError

CAL = Calibration("unit", step_overhead_s=0.5e-3, token_overhead_s=2e-6)


def _brute_force(method: Method, gpus: int, gpu: str, target_speed: float) -> tuple[int, int]:
    """Most users over every tp dividing the node and every batch up to what fits, scanning batch by batch."""
    tgt, _ = PAIRS["qwen3-8b"].load()
    best = (0, 0)
    for tp in (1, 2, 4, 8):
        if gpus % tp:
            continue
        dep = Deployment(get_gpu(gpu), "fp8", "fp8", tp, CAL)
        k = draft_len(method)
        cap = batch_limit(budget(tgt, method.drafter, dep, EngineLimits(), k), EngineLimits(), 1024, 1024, k,
                          10**9, dep).batch  # fmt: skip
        ok = [b for b in range(1, cap + 1)
              if method.iteration(tgt, b, mean_context(1024, 1024), dep).tok_s_user() >= target_speed]  # fmt: skip
        if ok and (gpus // tp) * max(ok) > best[0]:
            best = ((gpus // tp) * max(ok), tp)
    return best


@pytest.mark.parametrize("speed", [300.0, 800.0])
def test_best_layout_matches_a_brute_force_search(speed: float):
    tgt, drafter = PAIRS["qwen3-8b"].load()
    for method in (Method("ar"), Method("dflash", drafter, Acceptance.from_mean(6.55, 16))):
        layout = best_layout(method, tgt, 8, "h200", "fp8", "fp8", CAL, (1024, 1024), speed)
        users, tp = _brute_force(method, 8, "h200", speed)
        if users == 0:
            assert layout is None
            continue
        assert layout is not None and (layout.users, layout.tp) == (users, tp)
        assert layout.tok_s_user >= speed and layout.replicas * layout.tp == 8


def test_no_layout_when_one_user_cannot_reach_the_speed():
    tgt, _ = PAIRS["qwen3-8b"].load()
    slow = Calibration("slow", step_overhead_s=0.01)  # every step costs 10 ms: at most 100 tok/s/user for AR
    assert best_layout(Method("ar"), tgt, 8, "b300", "fp8", "fp8", slow, (1024, 1024), 500.0) is None


def test_node_cli_reports_users_and_the_ratio_to_ar(capsys):
    rc = main(["plan", "--preset", "qwen3-8b", "--node", "8xb300", "--qformat", "nvfp4", "--min_tok_s_user", "500",
               "--eagle3_acceptance_length", "2.89", "--eagle3_steps", "7", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    # One committed calibration: one row (one acceptance length per method).
    assert rc == 0 and [r["label"] for r in out["rows"]] == ["trtllm; dflash tau 6.55, eagle3 tau 2.89"]
    for row in out["rows"]:
        lay = row["layouts"]
        assert set(lay) == {"ar", "dflash", "eagle3"}
        for name, ratio in row["users_vs_ar"].items():
            if lay["ar"] is None or lay[name] is None:
                assert ratio is None
            else:
                assert ratio == pytest.approx(lay[name]["users"] / lay["ar"]["users"])
                assert lay[name]["users"] == lay[name]["replicas"] * lay[name]["batch"]


@pytest.mark.parametrize("text", ["8", "8xa100", "0xb300", "b300x8"])
def test_bad_node_is_one_clear_error(text: str, capsys):
    with pytest.raises(DFlashTrtError, match="--node must look like 8xb300"):
        parse_node(text)
    assert main(["plan", "--preset", "qwen3-8b", "--node", text]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--node must look like 8xb300" in err


def test_docs_carry_the_current_node_table():
    from pathlib import Path

    from dflash_trt.analysis.harness_fits import calibration
    from dflash_trt.analysis.node import markdown_node, plan_node
    from dflash_trt.analysis.shapes import eagle3_like

    doc = (Path(__file__).resolve().parents[2] / "docs" / "performance.md").read_text()
    tgt, drafter = PAIRS["qwen3-8b"].load()
    methods = {
        "ar": [Method("ar")],
        "eagle3": [Method("eagle3", eagle3_like(tgt, 7), Acceptance.from_mean(2.89, 8))],
        "dflash": [Method("dflash", drafter, Acceptance.from_mean(6.55, 16))],
    }
    for node, precision in (("8xh100", "fp8"), ("8xh200", "fp8"), ("8xb200", "nvfp4"), ("8xb300", "nvfp4")):
        rows = plan_node(methods, tgt, node, precision, "fp8", calibration("trtllm"), (1024, 1024), 500.0)
        assert markdown_node(node, rows) in doc, f"regenerate the {node} rows of docs/performance.md §3.7"


def test_priced_collectives_make_wide_tensor_parallelism_cost_what_published_runs_show():
    """PR #16818's AR baseline on H200 gains 65 % from TP 1 to TP 8 at one user (211 -> 348 tok/s); the model
    fitted on its corners gives a gain of that size, where free collectives would give several times more."""
    from dflash_trt.analysis.harness_fits import calibration

    tgt, _ = PAIRS["qwen3-8b"].load()
    cal = calibration("sglang-v1")

    def ar(tp: int, cal: Calibration) -> float:
        dep = Deployment(get_gpu("h200"), "bf16", "bf16", tp, cal)
        return Method("ar").iteration(tgt, 1, 128 + 160, dep).tok_s_user()

    gain = ar(8, cal) / ar(1, cal) - 1
    assert 1 + gain == pytest.approx(348 / 211, rel=0.1)
    free = replace(cal, collective_slowdown=0.0)
    assert ar(8, free) / ar(1, free) - 1 > 2 * gain
