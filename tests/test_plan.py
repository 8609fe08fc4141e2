"""`dflash-trt plan`: the fit/eval split, provenance, presets, capacity, calibration and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt.cli import build_parser, main
from dflash_trt.perf import evaluation, published
from dflash_trt.perf.gpus import get_gpu
from dflash_trt.perf.model import Acceptance, Calibration, Deployment, Method, mean_context
from dflash_trt.perf.published import PAIRS, POINTS, SOURCES, Unknown

ROOT = Path(__file__).resolve().parents[1]


def _plan(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _json(argv: list[str], capsys):
    rc, out, err = _plan([*argv, "--json"], capsys)
    assert rc == 0, err
    return json.loads(out)


def test_fit_set_is_fixed_and_disjoint_from_the_evaluation():
    rows = evaluation.evaluate()
    fit = [r for r in rows if r.split == "fit"]
    assert {r.point.id for r in fit} == evaluation.fit_set_ids() == {
        "zlab-qwen3-8b-dflash-gsm8k", "zlab-qwen3-8b-dflash-humaneval", "sglang-v1-c1", "sglang-v2-c1",
    }  # fmt: skip
    assert all(abs(r.error) < 1e-3 for r in fit)
    held_out = [r for r in rows if r.split == "eval" and r.error is not None]
    # Held-out points above concurrency 1 and in throughput-at-interactivity form exist, each next to k * tau.
    above = [r for r in held_out if r.regime == "concurrency > 1"]
    assert len(above) >= 6 and all(r.point.concurrency > 1 for r in above)
    assert any(r.point.metric == "ratio_at_interactivity" for r in rows if r.split == "eval")
    assert all(r.baseline_predicted is not None for r in above if r.point.metric == "speedup")


def test_baseline_k_is_the_fit_rows_speedup_over_tau():
    # Both fit speedup rows publish 5.20x at tau 6.55, so least relative squares gives k = 5.20 / 6.55.
    assert evaluation.baseline_k() == pytest.approx(5.20 / 6.55)
    gsm8k = next(r for r in evaluation.evaluate() if r.point.id == "zlab-qwen3-4b-dflash-gsm8k")
    assert gsm8k.baseline_predicted == pytest.approx(5.20 / 6.55 * 6.50)


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


def test_validate_json_has_the_interface_keys(capsys):
    rows = _json(["--validate"], capsys)
    keys = {"source", "metric", "published", "predicted", "baseline_predicted", "split", "concurrency"}
    assert len(rows) == len(POINTS) and all(keys <= set(r) for r in rows)
    assert {r["split"] for r in rows} == {"fit", "eval"}
    blog = next(r for r in rows if r["id"] == "blog-gpt-oss-120b-dflash-speed-bench")
    assert blog["concurrency"] is None and "fixed number of users" in blog["unknowns"]["concurrency"]


def test_docs_carry_the_current_evaluation_tables():
    doc = (ROOT / "docs" / "performance.md").read_text()
    assert evaluation.markdown_tables(evaluation.evaluate()) in doc, "regenerate with `dflash-trt plan --validate`"


def test_provenance_names_a_kind_and_source_for_every_constant(capsys):
    table = _json(["--provenance"], capsys)
    assert all(set(c) == {"value", "kind", "source"} and c["kind"] in ("datasheet", "measured", "assumed", "fitted")
               and c["source"] for c in table.values())  # fmt: skip
    assert table["calibration.sglang-v2.step_overhead_s"]["kind"] == "fitted"
    assert "sglang-v2-c1" in table["calibration.sglang-v2.step_overhead_s"]["source"]
    assert table["calibration.trtllm.step_overhead_s"]["kind"] == "assumed"
    assert table["calibration.compute_efficiency"]["kind"] == "assumed"
    assert table["gpu.h100.hbm_bandwidth"] == {"value": 3.35e12, "kind": "datasheet",
                                               "source": get_gpu("h100").source}  # fmt: skip


def test_preset_without_acceptance_uses_the_published_tau_and_says_so(capsys):
    out = _json(["--preset", "qwen3-8b", "--gpu", "h100", "--qformat", "fp8", "--concurrency", "1,8"], capsys)
    assert "6.55" in out["notes"][0] and "z-lab README" in out["notes"][0]
    assert out["calibration"]["source"].startswith("assumed equal to the sglang-v2 fit")
    dep = Deployment(get_gpu("h100"), "fp8", "bf16", 1, evaluation.calibration("trtllm"))
    tgt, drafter = PAIRS["qwen3-8b"].load()
    it = Method("dflash", drafter, Acceptance.from_mean(6.55, 16)).iteration(tgt, 8, mean_context(1024, 1024), dep)
    assert out["curves"]["dflash"][1]["tok_s_user"] == pytest.approx(it.tok_s_user())


def test_plan_config_prints_the_capacity(capsys):
    rc, out, err = _plan(["--config", str(ROOT / "build_configs/h100-fp8/qwen3-8b.yaml")], capsys)
    assert rc == 0 and err == ""
    assert "338 at 1024/1024 tokens, 85 at max_seq_len 8192" in out
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
    path.write_text(json.dumps({"points": points}))
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
        ("not json", "cannot read bench results"),
        ('{"points": []}', "non-empty 'points' list"),
        ('{"points": [{"mode": "eagle", "concurrency": 1}]}', "mode must be 'dflash' or 'ar'"),
        ('{"points": [{"mode": "ar", "concurrency": 0}]}', "concurrency must be a positive integer"),
        (
            '{"points": [{"mode": "ar", "concurrency": 1, "tpot_s": {"p50": "x"}, "throughput_tok_s": 1}]}',
            r"tpot_s.p50 must be a positive number",
        ),
        (
            '{"points": [{"mode": "dflash", "concurrency": 1, "tpot_s": {"p50": 0.01}, "throughput_tok_s": 100,'
            ' "acceptance_length": 40}]}',
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
        (["--preset", "qwen3-8b", "--tp_size", "3"], "tp_size 3 does not divide the target's 32 attention heads"),
        (["--preset", "qwen3-8b", "--tp_size", "0"], "--tp_size must be a positive integer"),
        (["--preset", "qwen3-8b", "--tp_size", "-2"], "--tp_size must be a positive integer"),
        (["--preset", "qwen3-8b", "--isl", "0"], "--isl and --osl must be positive"),
        (["--preset", "qwen3-8b", "--osl", "-5"], "--isl and --osl must be positive"),
        (["--config", str(ROOT / "build_configs/h100-fp8/qwen3-8b.yaml"), "--isl", "-1"], "must be positive"),
        (["--preset", "qwen3-8b", "--concurrency", "0,4"], "--concurrency must list positive integers"),
        (["--preset", "qwen3-8b", "--levels", "nan"], "--levels must list positive finite numbers"),
        (["--preset", "qwen3-8b", "--acceptance_length", "nan"], r"must lie in \[1, 16\]"),
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
    from dflash_trt.profiles import load_profile

    for path in sorted((ROOT / "build_configs").glob("*/*.yaml")):
        profile = load_profile(path)
        assert published.pair_for_models(profile.model.target, profile.model.draft) is not None, path


def test_docs_state_the_current_fitted_constants():
    doc = (ROOT / "docs" / "performance.md").read_text()
    spec = evaluation.calibration("hf-transformers").spec_overhead_s
    v2, v1 = (evaluation.calibration(h).step_overhead_s for h in ("sglang-v2", "sglang-v1"))
    assert f"| {1e3 * spec:.3f} ms | fitted |" in doc
    assert f"| {1e3 * v2:.2f} ms / {1e3 * v1:.2f} ms | fitted |" in doc
    assert f"| {1e3 * evaluation.calibration('trtllm').step_overhead_s:.2f} ms | assumed |" in doc
    assert f"| {evaluation.baseline_k():.3f} | fitted |" in doc


def test_calibrate_with_dflash_points_only_fits_the_step_overhead(tmp_path: Path, capsys):
    results = _bench_results(tmp_path / "results.json", step=2e-3, spec=0.0)
    data = json.loads(results.read_text())
    data["points"] = [p for p in data["points"] if p["mode"] == "dflash"]
    results.write_text(json.dumps(data))
    out = _json(["--preset", "qwen3-8b", "--gpu", "h200", "--qformat", "fp8", "--calibrate", str(results)], capsys)
    assert out["calibration"]["step_overhead_s"] == pytest.approx(2e-3, rel=1e-3)
    assert out["calibration"]["spec_overhead_s"] == 0.0 and "on the DFlash points" in out["calibration"]["source"]
    rc, text, _ = _plan(["--preset", "qwen3-8b", "--gpu", "h200", "--qformat", "fp8", "--calibrate", str(results)],
                        capsys)  # fmt: skip
    assert rc == 0 and text.splitlines()[0].startswith("calibration: step_overhead_s 0.002000")


def test_plan_labels_its_header_and_explains_every_speedup(capsys):
    assert main(["plan", "--preset", "qwen3-8b", "--gpu", "h100", "--qformat", "fp8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("GPU h100 (--gpu), TP 1, fp8 weights (--qformat), 16-bit KV cache;")
    rows = [line for line in lines if line.startswith("at ") and "tok/s/user:" in line]
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
