"""`dflash-trt plan`: the fit/eval split, provenance, presets, capacity, calibration and bad input."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dflash_trt.analysis import evaluation, harness_fits, published, validation_report
from dflash_trt.analysis.gpus import get_gpu
from dflash_trt.analysis.harness_fits import calibration
from dflash_trt.analysis.model import Acceptance, Calibration, Deployment, Method, mean_context
from dflash_trt.analysis.published import PAIRS, POINTS, SOURCES, Unknown
from dflash_trt.bench.results import FORMAT
from dflash_trt.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def _plan(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(["plan", *argv])
    except SystemExit as exited:  # a flag its rule refuses stops the parser
        rc = exited.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _json(argv: list[str], capsys):
    rc, out, err = _plan([*argv, "--json"], capsys)
    assert rc == 0, err
    return json.loads(out)


def test_fit_rows_are_fixed_and_disjoint_from_the_validation():
    rows = evaluation.evaluate()
    fit = {r.point.id for r in rows if r.split == "fit"}
    named = {i for ids in published.FIT_ROWS.values() for i in ids}
    implied = {f"sglang16818-tp{tp}-c{c}-speedup" for tp in (1, 8) for c in (1, 32)}
    assert fit == named | implied
    assert all(r.split in ("eval", "duplicate") for r in rows if r.point.id not in fit)
    # Exactly identified fits reproduce their rows; overdetermined ones stay inside their band.
    by_id = {r.point.id: r for r in rows}
    for harness in ("sglang-v2", "vllm"):
        assert all(abs(by_id[i].error) < 1e-3 for i in published.FIT_ROWS[harness])
    assert all(by_id[i].within_band for i in fit)
    held_out = [r for r in rows if r.split == "eval" and r.error is not None]
    above = [r for r in held_out if r.regime == "speedup, concurrency > 1"]
    assert len(above) >= 20 and all(r.persistence is not None and r.k_tau is not None for r in above)
    assert any(r.point.metric == "ratio_at_interactivity" for r in rows if r.split == "eval")


def test_every_prediction_is_one_number_with_a_band():
    for r in evaluation.evaluate():
        if r.predicted is None:
            continue
        assert isinstance(r.predicted, float) and r.band is not None
        assert r.band >= evaluation.harness_fits.calibration(r.point.harness).error_band
    # A row whose source leaves the setting open widens its band by the candidates' spread.
    card = evaluation.predict(published.point("blog-gpt-oss-120b-dflash-speed-bench"), calibration("trtllm"))
    assert card[1] > 0.1


def test_persistence_carries_the_sources_own_concurrency_1_figure():
    rows = {r.point.id: r for r in evaluation.evaluate()}
    # The card's block-10 row: 1.8x at one user, so persistence says 1.8x at 8, 16 and 32 users.
    assert [rows[f"card-gpt-oss-120b-b10-c{c}"].persistence for c in (8, 16, 32)] == [1.8, 1.8, 1.8]
    assert rows["card-gpt-oss-120b-b10-c32"].persistence_error == pytest.approx(1.8 / 1.5 - 1)
    # For a throughput row each user keeps the single-user speed: 32 x 1161.88 tok/s.
    assert rows["sglang-v2-c32"].persistence == pytest.approx(32 * 1161.88)
    assert rows["card-gpt-oss-120b-b10-c1"].persistence is None  # it is the anchor itself
    # PR #16818: each TP width carries its own one-user speedup.
    assert rows["sglang16818-tp4-c16-speedup"].persistence == 2.55
    # The median |error| of persistence over every held-out speedup row above one user, by hand from the tables.
    tables = published.SGLANG_16818_SPEEDUP
    held = [(tp, i) for tp in tables for i in range(1, 6) if (tp, i) not in ((1, 5), (8, 5))]
    by_hand = [tables[tp][0] / tables[tp][i] - 1 for tp, i in held]
    by_hand += [1.3 / 1.2 - 1, 0.0, 1.3 / 1.2 - 1, 1.8 / 1.6 - 1, 1.8 / 1.6 - 1, 1.8 / 1.5 - 1]  # the card
    above = next(s for s in validation_report.summarize(evaluation.evaluate()) if s.group.endswith("all three predict"))
    assert above.persistence[0] == len(by_hand) == 24
    assert above.persistence[1] == pytest.approx(statistics.median(abs(e) for e in by_hand))


def test_the_16818_tables_give_three_rows_per_cell():
    tok_s = published.point("sglang16818-tp8-c1-dflash")
    speedup = published.point("sglang16818-tp8-c1-speedup")
    ar = published.point("sglang16818-tp8-c1-ar")
    assert (tok_s.published, speedup.published, tok_s.num_gpus, tok_s.gpu) == (810, 2.33, 8, "h200")
    assert ar.published == pytest.approx(810 / 2.33, abs=0.05) and evaluation.derived(ar)
    assert tok_s.tau.values == (6.33,) and ar.tau == 1.0


def test_duplicates_and_substituted_inputs_are_labelled():
    rows = {r.point.id: r for r in evaluation.evaluate()}
    humaneval = rows["zlab-qwen3-8b-dflash-humaneval"]
    assert humaneval.split == "duplicate" and evaluation.duplicate_of(humaneval.point) == "zlab-qwen3-8b-dflash-gsm8k"
    assert humaneval.predicted is None  # it counts in no summary
    assert rows["paper-qwen3-8b-dflash-gsm8k"].point.tau.kind == "assumed"
    assert evaluation.k_tau_by_construction(rows["zlab-qwen3-8b-dflash-math500"].point)
    assert not evaluation.k_tau_by_construction(rows["zlab-qwen3-8b-eagle3-math500"].point)


def test_one_committed_calibration_per_harness():
    v1, v2 = calibration("sglang-v1"), calibration("sglang-v2")
    # PR #16818's AR rows settle the split: AR pays the per-step overhead, speculation its own on top.
    assert v1.step_overhead_s > 0 and v1.spec_overhead_s > 0 and v1.collective_slowdown > 1
    # Spec v2 keeps spec v1's AR side (the same AR path) and fits its speculative side on PR #23000's rows.
    assert (v2.step_overhead_s, v2.sequence_overhead_s, v2.collective_slowdown) == (
        v1.step_overhead_s, v1.sequence_overhead_s, v1.collective_slowdown,
    )  # fmt: skip
    for p in map(published.point, ("sglang-v2-c1", "sglang-v2-c32")):
        assert evaluation.predict(p, v2)[0] == pytest.approx(p.published, rel=1e-3)
    # TensorRT-LLM is transferred whole, with the transfer's spread added to its band.
    trt = calibration("trtllm")
    assert trt.step_overhead_s == v2.step_overhead_s and trt.error_band > v2.error_band
    assert trt.allreduce_algorithm == "trtllm-auto" and v2.allreduce_algorithm == "custom"
    # Every band holds the measured drift between two versions of one harness: 17.7 %, 24.0 % and 29.1 %.
    drift = math.sqrt(((11405.85 / 9688.26 - 1) ** 2 + (15326.81 / 12360.49 - 1) ** 2 + (1161.88 / 900 - 1) ** 2) / 3)
    assert harness_fits.drift() == pytest.approx(drift)
    assert all(calibration(h).error_band >= drift for h in harness_fits.HARNESSES)


def test_baseline_k_is_each_harness_fit_speedups_over_tau():
    # The transformers harness's fit rows: 5.20x at tau 6.55 and 5.17x at tau 6.50; least relative squares.
    pairs = [(6.55, 5.20), (6.50, 5.17)]
    k = sum(t / s for t, s in pairs) / sum((t / s) ** 2 for t, s in pairs)
    assert evaluation.baseline_k("hf-transformers") == pytest.approx(k)
    gsm8k = next(r for r in evaluation.evaluate() if r.point.id == "zlab-qwen3-8b-eagle3-gsm8k")
    assert gsm8k.k_tau == pytest.approx(k * 2.89)


def test_leaving_a_source_out_refits_without_its_rows():
    without = harness_fits.calibration("vllm", frozenset({"modelopt-vllm"}))
    assert without.collective_slowdown == calibration("sglang-v1").collective_slowdown  # from its donor
    rows = {r.source: r for r in evaluation.leave_one_source_out()}
    assert set(rows) == {published.point(i).source for ids in published.FIT_ROWS.values() for i in ids}
    assert rows["modelopt-vllm"].rows == 22 and rows["modelopt-vllm"].median_without is not None


def test_published_values_are_kept_as_sourced_and_disagreements_kept():
    by_id = {p.id: p for p in POINTS}
    assert [by_id[f"paper-qwen3-8b-dflash-{d}"].published for d in ("gsm8k", "math500", "aime25", "mtbench")] == [
        5.15, 6.08, 5.62, 2.75,
    ]  # fmt: skip
    assert by_id["paper-qwen3-8b-dflash-mean7"].published == 4.86
    assert by_id["zlab-qwen3-8b-dflash-gsm8k"].published == 5.20  # the other table, kept beside it
    speed_bench = by_id["blog-gpt-oss-120b-dflash-speed-bench"]
    assert speed_bench.published == 2.3 and isinstance(speed_bench.concurrency, Unknown)
    band = by_id["blog-gpt-oss-120b-dflash-vs-ar-band"]
    assert (band.metric, band.published, band.bound) == ("ratio_at_interactivity", 15.0, ">")
    assert all(p.source in SOURCES for p in POINTS)
    text = json.dumps([vars(p) for p in POINTS], default=str) + json.dumps(SOURCES)
    assert "SPEED-Bench coding" in SOURCES["nvidia-blog"] and "NVFP4 " not in text.replace("NVFP4 format", "")
    assert [by_id[f"modelopt-tp{tp}-ar"].published for tp in (1, 8)] == [145.0, 377.0]


def test_validate_json_has_the_interface_keys(capsys):
    out = _json(["--validate"], capsys)
    rows = out["points"]
    keys = {"source", "metric", "published", "predicted", "band", "baselines", "split", "concurrency", "calibration"}
    assert len(rows) == len(POINTS) and all(keys <= set(r) for r in rows)
    assert all(set(r["baselines"]) == {"k_tau", "persistence"} for r in rows)
    assert {r["split"] for r in rows} == {"fit", "eval", "duplicate"}
    assert all(r["predicted"] is None or isinstance(r["predicted"], float) for r in rows)
    blog = next(r for r in rows if r["id"] == "blog-gpt-oss-120b-dflash-speed-bench")
    assert blog["concurrency"] is None and "fixed number of users" in blog["unknowns"]["concurrency"]["why"]
    groups = {s["group"] for s in out["summaries"]}
    assert {"sglang-16818: fit rows", "sglang-16818: validation rows", "all held out"} <= groups
    assert [g["goal"] for g in out["goals"]][0].startswith("above one user")
    assert {r["source"] for r in out["leave_one_source_out"]} >= {"sglang-16818", "modelopt-vllm"}


def test_docs_carry_the_current_evaluation_tables():
    doc = (ROOT / "docs" / "performance.md").read_text()
    assert validation_report.markdown_tables(evaluation.evaluate()) in doc, (
        "regenerate with `dflash-trt plan --validate`"
    )


def test_provenance_names_a_kind_and_source_for_every_constant(capsys):
    table = _json(["--provenance"], capsys)
    assert all(set(c) == {"value", "kind", "source"} and c["kind"] in ("datasheet", "measured", "assumed", "fitted")
               and c["source"] for c in table.values())  # fmt: skip
    assert table["calibration.sglang-v1.step_overhead_s"]["kind"] == "fitted"
    assert "sglang16818-tp8-c32-ar" in table["calibration.sglang-v1.collective_slowdown"]["source"]
    assert table["calibration.trtllm.spec_overhead_s"]["kind"] == "assumed"
    assert "drift" in table["calibration.trtllm.error_band"]["source"]
    assert table["calibration.compute_efficiency"]["kind"] == "assumed"
    assert table["gpu.h100.hbm_bandwidth"] == {"value": 3.35e12, "kind": "datasheet",
                                               "source": get_gpu("h100").source}  # fmt: skip
    oneshot = table["allreduce.oneshot_us.tp8"]
    assert oneshot["kind"] == "measured" and "#2904" in oneshot["source"]
    assert table["interconnect.nvlink5.link_bandwidth"]["value"] == 900e9
    # Memory is the device's report; B200's bandwidth the HGX per-GPU figure; B300 has no vendor document here.
    assert table["gpu.h100.hbm_bytes"]["value"] == 81559 * 2**20 and table["gpu.h100.hbm_bytes"]["kind"] == "measured"
    assert table["gpu.b200.hbm_bandwidth"]["value"] == 7.7e12
    assert all(table[f"gpu.b300.{f}"]["kind"] == "assumed" for f in ("hbm_bytes", "hbm_bandwidth", "nvfp4_flops"))
    assert "allocateKvCache.cpp" in table["capacity.step_headroom_tokens"]["source"]


def test_preset_without_acceptance_uses_the_published_tau_and_says_so(capsys):
    out = _json(["--preset", "qwen3-8b", "--gpu", "h100", "--qformat", "fp8", "--concurrency", "1,8"], capsys)
    assert "6.55" in out["notes"][0] and "z-lab README" in out["notes"][0]
    assert out["calibration"]["name"] == "trtllm" and out["calibration"]["source"].startswith("assumed equal to")
    assert out["error_band"] == pytest.approx(calibration("trtllm").error_band)
    tgt, drafter = PAIRS["qwen3-8b"].load()
    method = Method("dflash", drafter, Acceptance.from_mean(6.55, 16))
    dep = Deployment(get_gpu("h100"), "fp8", "bf16", 1, calibration("trtllm"))
    speed = method.iteration(tgt, 8, mean_context(1024, 1024), dep).tok_s_user()
    point = out["curves"]["dflash"][1]
    assert (point["concurrency"], point["batch"], point["fits"]) == (8, 8, True)
    assert point["tok_s_user"] == pytest.approx([speed, speed])


def test_acceptance_is_declared_at_the_draft_length_it_was_measured_at(capsys):
    base = ["--preset", "qwen3-8b", "--gpu", "h100", "--qformat", "fp8", "--concurrency", "1"]
    # 5.0 measured with 7 drafts, planned with 7: the block-8 distribution itself.
    out = _json([*base, "--acceptance_length", "5", "--acceptance_draft_len", "7", "--max_draft_len", "7"], capsys)
    assert "measured with 7 drafts per step; at --max_draft_len 7: mean 5.00" in out["notes"][0]
    # Planned with 15 drafts, the measured per-position rate continues: more tokens per step, not fewer.
    out = _json([*base, "--acceptance_length", "5", "--acceptance_draft_len", "7", "--max_draft_len", "15"], capsys)
    want = Acceptance.from_mean(5.0, 8).resized(16).mean()
    assert f"mean {want:.2f}" in out["notes"][0] and want > 5.0
    # Without --acceptance_draft_len the mean is the full block's, cut for a shorter draft.
    out = _json([*base, "--acceptance_length", "5", "--max_draft_len", "7"], capsys)
    assert f"mean {Acceptance.from_mean(5.0, 16).resized(8).mean():.2f}" in out["notes"][0]
    rc, _, err = _plan([*base, "--acceptance_draft_len", "7"], capsys)
    assert rc == 2 and "give both" in err


def test_plan_config_prints_the_capacity(capsys):
    rc, out, err = _plan(["--config", str(ROOT / "build_configs/h100-fp8/qwen3-8b.yaml")], capsys)
    assert rc == 0 and err == ""
    assert "366 at 1024/1024 tokens, 92 at max_seq_len 8192" in out
    rc, out, err = _plan(["--config", str(ROOT / "build_configs/h100-fp8/qwen3-8b.yaml"), "--isl", "4096",
                          "--osl", "4096"], capsys)  # fmt: skip
    assert rc == 0 and err.startswith("warning: ") and "max_batch_size 128 cannot be held" in err


def _bench_results(path: Path, step: float, spec: float) -> Path:
    """A results.json in the bench schema whose numbers the model produces with these overheads."""
    tgt, drafter = PAIRS["qwen3-8b"].load()
    dep = Deployment(get_gpu("h200"), "fp8", "bf16", 1, Calibration(step_overhead_s=step, spec_overhead_s=spec))
    ctx, points = mean_context(1024, 1024), []
    for mode, tau in (("ar", 1.0), ("dflash", 5.0), ("dflash", 3.0)):
        method = Method("ar") if mode == "ar" else Method("dflash", drafter, Acceptance.from_mean(tau, 16))
        for c in (1, 4, 16):
            it = method.iteration(tgt, c, ctx, dep)
            tpot = it.seconds / it.tokens_per_seq
            points.append({
                "mode": mode, "concurrency": c, "requests": 8, "output_tokens": 8192, "duration_s": 1.0,
                "throughput_tok_s": c / tpot, "per_user_tok_s": {"p50": 1 / tpot, "p90": 1 / tpot, "p99": 1 / tpot},
                "ttft_s": {"p50": 0.1, "p90": 0.1, "p99": 0.1}, "tpot_s": {"p50": tpot, "p90": tpot, "p99": tpot},
                "acceptance_length": tau, "per_request": [],
            })  # fmt: skip
    path.write_text(json.dumps({"format": FORMAT, "points": points}))
    return path


def test_calibrate_recovers_the_overheads_of_a_results_file(tmp_path: Path, capsys):
    results = _bench_results(tmp_path / "results.json", step=1.5e-3, spec=0.4e-3)
    out = _json(["--preset", "qwen3-8b", "--gpu", "h200", "--qformat", "fp8", "--calibrate", str(results)], capsys)
    assert out["calibration"]["step_overhead_s"] == pytest.approx(1.5e-3, rel=1e-3)
    assert out["calibration"]["spec_overhead_s"] == pytest.approx(0.4e-3, rel=1e-2)
    assert str(results) in out["calibration"]["source"]
    assert len(out["residuals"]) == 9 and all(abs(r["error"]) < 1e-3 for r in out["residuals"])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "is not valid JSON"),
        ('{"points": [{"mode": "ar", "concurrency": 1}]}', "is not a dflash-trt bench results file"),
        ('{"format": "dflash-trt-bench/1", "points": []}', "non-empty 'points' list"),
        ('{"format": "dflash-trt-bench/1", "points": [{"mode": "eagle", "concurrency": 1}]}', "mode must be 'dflash'"),
        ('{"format": "dflash-trt-bench/1", "points": [{"mode": "ar", "concurrency": 0}]}', "concurrency must be"),
        (
            '{"format": "dflash-trt-bench/1", "points": [{"mode": "ar", "concurrency": 1, "tpot_s": {"p50": "x"}, '
            '"throughput_tok_s": 1}]}',
            r"tpot_s.p50 must be a positive number",
        ),
        (
            '{"format": "dflash-trt-bench/1", "points": [{"mode": "dflash", "concurrency": 1, "tpot_s": {"p50": 0.01}, '
            '"throughput_tok_s": 100, "acceptance_length": 40}]}',
            "exceeds the drafter's block 16",
        ),
    ],
)
def test_calibrate_refuses_bad_results(tmp_path: Path, content: str, message: str, capsys):
    path = tmp_path / "results.json"
    path.write_text(content)
    rc, out, err = _plan(["--preset", "qwen3-8b", "--calibrate", str(path)], capsys)
    assert rc == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "qwen3-8b", "--tp_size", "3"], "target: 32 attention heads cannot be split over tp_size 3"),
        (["--preset", "qwen3-8b", "--tp_size", "0"], r"argument --tp_size: must be an integer in \[1, 1024\]"),
        (["--preset", "qwen3-8b", "--tp_size", "-2"], r"argument --tp_size: must be an integer in \[1, 1024\]"),
        (["--preset", "qwen3-8b", "--isl", "0"], "argument --isl: must be an integer in"),
        (["--preset", "qwen3-8b", "--osl", "-5"], "argument --osl: must be an integer in"),
        (
            ["--config", str(ROOT / "build_configs/h100-fp8/qwen3-8b.yaml"), "--isl", "-1"],
            "argument --isl: must be an integer in",
        ),
        (["--preset", "qwen3-8b", "--concurrency", "0,4"], "argument --concurrency: must be a comma-separated list"),
        (["--preset", "qwen3-8b", "--levels", "nan"], "argument --levels: must be a comma-separated list"),
        (["--preset", "qwen3-8b", "--acceptance_length", "nan"], r"argument --acceptance_length: must be a finite"),
        (["--preset", "qwen3-8b", "--acceptance_length", "20"], r"must lie in \[1, 16\]"),
        (["--preset", "qwen3-8b", "--eagle3_acceptance_length", "2", "--eagle3_steps", "0"], "--eagle3_steps"),
        (["--preset", "qwen3-8b", "--max_draft_len", "16"], "--max_draft_len"),
        (["--preset", "qwen3-8b", "--gpu", "h100", "--qformat", "nvfp4"], "NVFP4"),
        (["--preset", "llama-3.1-8b"], "no acceptance length is published for this pair"),
        (["--acceptance_length", "5"], "--model_dir"),
        (["--config", "missing.yaml"], "does not exist"),
    ],
)
def test_bad_values_are_one_clear_error(argv: list[str], message: str, capsys):
    rc, out, err = _plan(argv, capsys)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("dflash-trt plan: error: ")
    assert __import__("re").search(message, err), err


@pytest.mark.slow
def test_a_closed_pipe_is_one_clear_error():
    # Far more output than a pipe buffers, read by a consumer that stops after one byte.
    script = (f"{sys.executable} -m dflash_trt.cli plan --preset qwen3-8b --json "
              f"--levels 100 --concurrency {','.join(str(c) for c in range(1, 1000))} | head -c 1 >/dev/null; "
              "exit ${PIPESTATUS[0]}")  # fmt: skip
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "dflash-trt plan: error: standard output was closed before the output was written (broken pipe)"
    ]


def test_published_shapes_have_drafters_for_every_shipped_profile():
    from dflash_trt.pipeline.profiles import load_profile

    for path in sorted((ROOT / "build_configs").glob("*/*.yaml")):
        profile = load_profile(path)
        assert published.pair_for_models(profile.model.target, profile.model.draft) is not None, path


def test_docs_state_the_current_fitted_constants():
    doc = (ROOT / "docs" / "performance.md").read_text()
    assert validation_report.markdown_calibrations() in doc, "regenerate with `dflash-trt plan --validate`"
    assert f"| {evaluation.baseline_k('hf-transformers'):.3f} | fitted |" in doc


def test_calibrate_with_dflash_points_only_fits_the_step_overhead(tmp_path: Path, capsys):
    results = _bench_results(tmp_path / "results.json", step=2e-3, spec=0.0)
    data = json.loads(results.read_text())
    data["points"] = [p for p in data["points"] if p["mode"] == "dflash"]
    results.write_text(json.dumps(data))
    out = _json(["--preset", "qwen3-8b", "--gpu", "h200", "--qformat", "fp8", "--calibrate", str(results)], capsys)
    assert out["calibration"]["step_overhead_s"] == pytest.approx(2e-3, rel=1e-3)
    assert out["calibration"]["spec_overhead_s"] == 0.0
    assert out["calibration"]["source"].startswith("step_overhead_s, token_overhead_s fitted on the 6 closed-loop")
    rc, text, _ = _plan(["--preset", "qwen3-8b", "--gpu", "h200", "--qformat", "fp8", "--calibrate", str(results)],
                        capsys)  # fmt: skip
    assert rc == 0 and text.splitlines()[0].startswith("calibration: step_overhead_s 0.002000")


def _stamped(path: Path, gpus: list[str], lengths=(1024, 1024)) -> Path:
    """The synthetic results with the provenance object and per-request records a bench run writes."""
    _bench_results(path, step=1.5e-3, spec=0.4e-3)
    data = json.loads(path.read_text())
    data["provenance"] = {"backend": "trtllm", "target": "Qwen/Qwen3-8B", "host": {"cpu": "Xeon 8480", "gpus": gpus},
                          "versions": {"tensorrt_llm": "1.2.0"}, "git_revision": None,
                          "started": "2026-01-01T00:00:00Z"}  # fmt: skip
    for p in data["points"]:
        p["per_request"] = [{"input_len": lengths[0], "output_ids": [1] * lengths[1]}] * 2
    path.write_text(json.dumps(data))
    return path


def test_calibration_file_is_stamped_and_applies_only_to_its_hardware(tmp_path: Path, capsys):
    results = _stamped(tmp_path / "results.json", ["NVIDIA H200", "NVIDIA H200"])
    cal_file = tmp_path / "cal.json"
    base = ["--preset", "qwen3-8b", "--gpu", "h200", "--qformat", "fp8"]
    out = _json([*base, "--calibrate", str(results), "--output", str(cal_file)], capsys)
    stamp = out["stamp"]
    assert (stamp["hardware"], stamp["backend"], stamp["gpu"], stamp["isl"], stamp["osl"]) == (
        "h200", "trtllm", "h200", 1024, 1024)  # fmt: skip
    written = json.loads(cal_file.read_text())
    assert written["stamp"] == stamp and written["calibration"]["step_overhead_s"] == pytest.approx(1.5e-3, rel=1e-3)
    # Used on the same hardware, the curve is the one the fitted overheads give.
    curve = _json([*base, "--calibration", str(cal_file), "--concurrency", "4"], capsys)
    tgt, drafter = PAIRS["qwen3-8b"].load()
    dep = Deployment(get_gpu("h200"), "fp8", "bf16", 1, Calibration(step_overhead_s=1.5e-3, spec_overhead_s=0.4e-3))
    it = Method("dflash", drafter, Acceptance.from_mean(6.55, 16)).iteration(tgt, 4, mean_context(1024, 1024), dep)
    lo, hi = curve["curves"]["dflash"][0]["tok_s_user"]
    assert lo == hi == pytest.approx(it.tok_s_user(), rel=1e-3)
    # Anywhere else it is refused in one line.
    rc, text, err = _plan(["--preset", "qwen3-8b", "--gpu", "h100", "--qformat", "fp8", "--calibration",
                           str(cal_file)], capsys)  # fmt: skip
    assert rc == 2 and text == "" and len(err.strip().splitlines()) == 1
    assert "was fitted on h200 (trtllm backend); it does not apply to --gpu h100" in err
    # The file is not overwritten unasked.
    rc, _, err = _plan([*base, "--calibrate", str(results), "--output", str(cal_file)], capsys)
    assert rc == 2 and "exists: pass --overwrite" in err
    assert _plan([*base, "--calibrate", str(results), "--output", str(cal_file), "--overwrite"], capsys)[0] == 0


def test_calibration_refuses_foreign_or_unstamped_results(tmp_path: Path, capsys):
    base = ["--preset", "qwen3-8b", "--gpu", "h200", "--qformat", "fp8", "--calibrate"]
    h100 = _stamped(tmp_path / "h100.json", ["NVIDIA H100 80GB HBM3"])
    rc, _, err = _plan([*base, str(h100)], capsys)
    assert rc == 2 and "ran on h100, not on --gpu h200" in err
    unstamped = _bench_results(tmp_path / "old.json", step=1e-3, spec=0.0)
    rc, _, err = _plan([*base, str(unstamped), "--output", str(tmp_path / "cal.json")], capsys)
    assert rc == 2 and "has no 'provenance' object" in err and not (tmp_path / "cal.json").exists()
    # A CPU run is stamped as such and applies to no GPU.
    cpu = _stamped(tmp_path / "cpu.json", [])
    _json([*base, str(cpu), "--output", str(tmp_path / "cpu-cal.json")], capsys)
    rc, _, err = _plan(["--preset", "qwen3-8b", "--gpu", "h200", "--calibration", str(tmp_path / "cpu-cal.json")],
                       capsys)  # fmt: skip
    assert rc == 2 and "was fitted on cpu: Xeon 8480" in err
    # The lengths the results ran at are used; contradicting flags are refused.
    short = _stamped(tmp_path / "short.json", ["NVIDIA H200"], lengths=(100, 50))
    assert _json([*base, str(short)], capsys)["stamp"] is not None
    rc, _, err = _plan([*base, str(short), "--isl", "1024"], capsys)
    assert rc == 2 and "ran at 100/50 tokens but --isl/--osl say 1024/50" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "cannot read calibration"),
        ('{"format": "other"}', "is not a calibration file"),
        ('{"format": "dflash-trt-calibration/1"}', "fit it again from its results"),
        ('{"format": "dflash-trt-calibration/2", "calibration": {}, "stamp": {}}', "needs a 'calibration' object"),
    ],
)
def test_bad_calibration_files_are_one_clear_error(tmp_path: Path, content: str, message: str, capsys):
    path = tmp_path / "cal.json"
    path.write_text(content)
    rc, out, err = _plan(["--preset", "qwen3-8b", "--calibration", str(path)], capsys)
    assert rc == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


def test_bad_calibration_values_are_refused(tmp_path: Path, capsys):
    results = _stamped(tmp_path / "results.json", ["NVIDIA H200"])
    cal_file = tmp_path / "cal.json"
    _json(["--preset", "qwen3-8b", "--gpu", "h200", "--qformat", "fp8", "--calibrate", str(results), "--output",
           str(cal_file)], capsys)  # fmt: skip
    data = json.loads(cal_file.read_text())
    data["calibration"]["step_overhead_s"] = float("nan")
    cal_file.write_text(json.dumps(data))
    rc, _, err = _plan(["--preset", "qwen3-8b", "--gpu", "h200", "--calibration", str(cal_file)], capsys)
    assert rc == 2 and "calibration.step_overhead_s must be a finite number >= 0" in err


def test_workload_and_temperature_pick_the_published_acceptance_lengths(capsys):
    # The README: GSM8K 6.55 at T=0 and 6.04 at T=1; chat (MT-Bench, Alpaca) 4.25 and 3.16 at T=0.
    assert published.workload_taus("qwen3-8b", "gsm8k", 1.0) == {"gsm8k": 6.04}
    assert published.workload_taus("qwen3-8b", "chat", None) == {"mtbench": 4.25, "alpaca": 3.16}
    out = _json(["--preset", "qwen3-8b", "--gpu", "b200", "--workload", "chat", "--concurrency", "1",
                 "--calibration", "sglang-v1"], capsys)  # fmt: skip
    assert "mtbench 4.25, alpaca 3.16; range 3.16-4.25" in out["notes"][0]
    tgt, drafter = PAIRS["qwen3-8b"].load()
    speeds = [
        Method("dflash", drafter, Acceptance.from_mean(tau, 16)).iteration(tgt, 1, mean_context(1024, 1024),
                                                                           Deployment(get_gpu("b200"), calibration=cal))
        .tok_s_user()
        for tau in (3.16, 4.25) for cal in (calibration("sglang-v1"),)
    ]  # fmt: skip
    assert out["curves"]["dflash"][0]["tok_s_user"] == pytest.approx([min(speeds), max(speeds)])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "poetry"], "no published acceptance length for workload 'poetry'"),
        (["--temperature", "0.5"], "at temperature 0.5"),
    ],
)
def test_unpublished_workloads_are_refused(argv: list[str], message: str, capsys):
    rc, out, err = _plan(["--preset", "qwen3-8b", *argv], capsys)
    assert rc == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


def test_plan_labels_its_header_and_explains_every_speedup(capsys):
    assert main(["plan", "--preset", "qwen3-8b", "--gpu", "h100", "--qformat", "fp8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("GPU h100 (--gpu), TP 1, fp8 weights (--qformat), 16-bit KV cache;")
    # One row per interactivity level and overhead reading: "[reading] at X tok/s/user: dflash ..."
    rows = [line for line in lines if line.split("] ", 1)[-1].startswith("at ") and "tok/s/user:" in line]
    assert rows and "equal interactivity" in lines[lines.index(rows[0]) - 1]
    for row in rows:
        ratio = float(row.split("dflash ", 1)[1].split("x", 1)[0])
        assert " vs ar c=" in row  # both concurrencies named
        assert ("extreme because" in row) == (ratio >= 10.0)
    assert any("extreme because" in row for row in rows)


def test_plan_header_names_the_flags_defaults(capsys):
    defaults = build_parser(["plan"]).parse_args(["plan", "--preset", "qwen3-8b"])
    assert main(["plan", "--preset", "qwen3-8b"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith(f"GPU {defaults.gpu} (--gpu), TP {defaults.tp_size}, 16-bit weights (--qformat)")
    assert defaults.qformat == "none"


def test_no_row_is_predicted_where_its_batch_does_not_fit():
    # gpt-oss-120b in bf16 (234 GB of weights) on one H100, or Qwen3-8B with 4096 users on one H100: no number.
    too_big = replace(published.point("card-gpt-oss-120b-b10-c1"), id="unit-oom", gpu="h100", precision="bf16")
    assert evaluation.predict(too_big, calibration("sglang-v2")) == (None, 0.0)
    crowded = replace(published.point("sglang16818-tp1-c32-dflash"), id="unit-crowded", concurrency=4096)
    assert evaluation.predict(crowded, calibration("sglang-v1"))[0] is None
    assert evaluation.predict(published.point("sglang16818-tp1-c32-dflash"), calibration("sglang-v1"))[0]
