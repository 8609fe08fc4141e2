"""`dflash-trt bench` end to end on the CPU backend: the documented interface, its outputs and its refusals."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
import transformers

from dflash_trt.bench import measure
from dflash_trt.bench.results import POINT_KEYS, load_results
from dflash_trt.cli import main
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.tiny.heldout import asset_dir, draft_dir, target_dir


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_cli") / "ckpt"
    convert_checkpoint(target_dir(), draft_dir(), path, dtype="float32")
    return path


@pytest.mark.slow
def test_synthetic_closed_and_open_loop_points_with_the_ar_baseline(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [
        "bench",
        "--checkpoint_dir",
        str(checkpoint),
        "--synthetic",
        "6,8,5",
        "--concurrency",
        "1,2",
        "--request_rate",
        "50",
        "--baseline",
        "ar",
        "--output_dir",
        str(out),
        "--json",
    ]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    points = load_results(out / "results.json")
    assert [(p["engine"], p["concurrency"], p["request_rate"]) for p in points] == [
        ("dflash", 1, None), ("dflash", 2, None), ("dflash", None, 50.0),
        ("ar", 1, None), ("ar", 2, None), ("ar", None, 50.0)]  # fmt: skip
    assert all(set(p) == set(POINT_KEYS) for p in points) and len(printed) == 6
    for p in points:
        # Synthetic requests ignore end tokens: exactly OSL tokens each, all five requests.
        assert p["requests"] == 5 and p["failed"] == 0 and p["output_tokens"] == 5 * 8
        assert all(len(r["output_ids"]) == 8 and r["input_len"] == 6 for r in p["per_request"])
        assert p["throughput_tok_s"] == pytest.approx(p["output_tokens"] / p["duration_s"])
    # Same prompts, same tokens: speculation changes how many iterations, never what is produced.
    dflash, ar = points[1], points[4]
    assert [r["output_ids"] for r in dflash["per_request"]] == [r["output_ids"] for r in ar["per_request"]]
    assert ar["acceptance_length"] == 1.0 and ar["acceptance_histogram"] == [35]
    workload = json.loads((out / "results.json").read_text())["workload"]
    assert workload == {"kind": "synthetic", "input_len": 6, "output_len": 8, "count": 5, "vocab_size": 128, "seed": 0}
    html = (out / "report.html").read_text()
    assert "Measured points" in html and "speedup over ar" in html
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # An existing output is never replaced unasked.
    assert main(argv) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--synthetic", "6,8"], "ISL,OSL,COUNT"),
        (["--synthetic", "6,8,2", "--concurrency", "0"], "--concurrency: must be a comma-separated list"),
        (["--synthetic", "6,8,2", "--request_rate", "x"], "--request_rate: must be a comma-separated list"),
        (["--input_file", "/nonexistent/p.jsonl"], "does not exist"),
        (["--synthetic", "6,8,2", "--chat_template_kwargs", "{}"], "applies to --input_file prompts"),
        (["--input_file", "/nonexistent/p.jsonl", "--chat_template_kwargs", "x"], "must be a JSON object"),
        (["--synthetic", "6,8,2", "--draft_len_schedule", "auto"], "auto is derived for a GPU"),
        (["--synthetic", "6,8,2", "--draft_len_schedule", "2:16"], "the engine verifies at most 15 "),
        (["--synthetic", "6,8,2", "--draft_len_schedule", "2:3,1:4"], "--draft_len_schedule: must be auto, none"),
    ],
)
def test_bad_input_is_one_clear_error(checkpoint, tmp_path, capsys, extra, message):
    argv = ["bench", "--checkpoint_dir", str(checkpoint), "--output_dir", str(tmp_path / "o"), *extra]
    if "--concurrency" not in extra and "--request_rate" not in extra:
        argv += ["--concurrency", "1"]
    try:
        code = main(argv)
    except SystemExit as exc:  # the parser refuses a bad flag value
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "o").exists()


def test_the_golden_model_drafts_by_load_and_results_record_each_iterations_drafts(checkpoint, tmp_path, capsys):
    """Under `3:2` a lone user verifies the full 15 drafts (fewer only where its budget leaves fewer), four users
    mostly 2; every generation iteration's count is in results.json, and the tokens are the unscheduled run's."""
    runs = {}
    for schedule in ("none", "3:2"):
        out = tmp_path / schedule.replace(":", "_")
        argv = ["bench", "--checkpoint_dir", str(checkpoint), "--synthetic", "6,24,8", "--concurrency", "1,4",
                "--draft_len_schedule", schedule, "--output_dir", str(out), "--json"]  # fmt: skip
        assert main(argv) == 0
        capsys.readouterr()
        runs[schedule] = {p["concurrency"]: p["per_request"] for p in load_results(out / "results.json")}
    for concurrency in (1, 4):
        assert [r["output_ids"] for r in runs["3:2"][concurrency]] == [r["output_ids"] for r in runs["none"][1]]
    for schedule, full in (("none", 15), ("3:2", 15)):
        for r in runs[schedule][1]:
            left = [24 - 1 - sum(r["acceptance"][:j]) for j in range(len(r["acceptance"]))]
            assert r["draft_lens"] == [min(full, n) for n in left]
    crowded = [d for r in runs["3:2"][4] for d in r["draft_lens"]]
    assert crowded.count(2) > len(crowded) / 2 and set(crowded) <= set(range(16))
    assert max(d for r in runs["none"][4] for d in r["draft_lens"]) == 15


def test_draft_trees_run_on_the_emulated_engine_and_results_record_nodes_per_iteration(checkpoint, tmp_path, capsys):
    """`--draft_tree 24` runs the tree engine's network under the emulated runtime: every generation iteration
    verifies 24 nodes (the tiny vocabulary holds far more continuations), results.json records each, and the greedy
    tokens are the chain's (the golden model's), as lossless trees must give."""
    runs = {}
    for tree in (None, 24):
        out = tmp_path / str(tree)
        argv = ["bench", "--checkpoint_dir", str(checkpoint), "--synthetic", "6,24,3", "--concurrency", "2",
                "--output_dir", str(out), "--json"]  # fmt: skip
        assert main(argv if tree is None else [*argv, "--draft_tree", str(tree)]) == 0
        capsys.readouterr()
        runs[tree] = load_results(out / "results.json")[0]["per_request"]
    assert [r["output_ids"] for r in runs[24]] == [r["output_ids"] for r in runs[None]]
    for r in runs[24]:
        assert r["draft_lens"] == [24] * len(r["acceptance"]) and len(r["acceptance"]) >= 1
    assert max(d for r in runs[None] for d in r["draft_lens"]) == 15
    argv = ["bench", "--checkpoint_dir", str(checkpoint), "--synthetic", "6,8,1", "--concurrency", "1",
            "--output_dir", str(tmp_path / "r")]  # fmt: skip
    assert main([*argv, "--draft_tree", "14"]) == 2
    assert "a tree holds at least the chain's 15 drafts" in capsys.readouterr().err
    assert main([*argv, "--draft_tree", "24", "--draft_len_schedule", "2:25"]) == 2
    assert "verifies 25 drafts per request but the engine verifies at most 24" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_draft_trees_schedule_is_recorded_per_iteration(checkpoint, tmp_path, capsys):
    """`--draft_tree 24 --draft_len_schedule 1:24,2:5` at two users: iterations with both requests in flight verify
    the chain of 5 drafts, those of a request alone the tree of 24 nodes; results.json records each iteration's
    count, no accepted length exceeds its verified drafts + 1, and the greedy tokens are still the chain engine's."""
    argv = ["bench", "--checkpoint_dir", str(checkpoint), "--synthetic", "6,24,3", "--concurrency", "2", "--json"]
    assert main([*argv, "--output_dir", str(tmp_path / "chain")]) == 0
    capsys.readouterr()
    chain = load_results(tmp_path / "chain" / "results.json")[0]["per_request"]
    assert (
        main([*argv, "--output_dir", str(tmp_path / "t"), "--draft_tree", "24", "--draft_len_schedule", "1:24,2:5"])
        == 0
    )
    capsys.readouterr()
    runs = load_results(tmp_path / "t" / "results.json")[0]["per_request"]
    assert [r["output_ids"] for r in runs] == [r["output_ids"] for r in chain]
    verified = [d for r in runs for d in r["draft_lens"]]
    assert set(verified) == {5, 24}
    for r in runs:
        assert all(a <= d + 1 for a, d in zip(r["acceptance"], r["draft_lens"], strict=True))


def test_unreachable_triton_server_is_one_clear_error(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2]}\n')
    argv = [
        "bench",
        "--triton_url",
        "127.0.0.1:1",
        "--input_file",
        str(prompts),
        "--concurrency",
        "1",
        "--output_dir",
        str(tmp_path / "o"),
    ]
    assert main(argv) == 2
    assert "cannot reach a Triton server at 127.0.0.1:1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main([*argv, "--draft_len_schedule", "2:3"]) == 2
    assert "an engine's is built into it" in capsys.readouterr().err


def _cpu_model_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def test_results_say_where_they_came_from_and_label_a_cpu_run_as_such(checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(measure, "PROGRESS_DELAY_S", 0.0)  # the bar shows at once, not after a second
    started = datetime.now(timezone.utc).replace(microsecond=0)
    out = tmp_path / "out"
    argv = ["bench", "--checkpoint_dir", str(checkpoint), "--input_file", str(asset_dir() / "heldout.jsonl"),
            "--num_requests", "2", "--max_new_tokens", "8", "--concurrency", "1", "--baseline", "ar",
            "--output_dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning" not in err  # real prompts: nothing to warn about
    assert "%|" not in err and "\r" not in err  # stderr is no terminal here: no progress bar in a log
    data = json.loads((out / "results.json").read_text())
    provenance = data["provenance"]
    assert provenance["backend"] == "golden" and provenance["target"] == str(checkpoint.resolve())
    assert provenance["host"]["cpu"] == _cpu_model_name()
    if shutil.which("nvidia-smi") is None:
        assert provenance["host"]["gpus"] == []
    assert provenance["versions"]["torch"] == torch.__version__
    assert provenance["versions"]["transformers"] == transformers.__version__
    repo = Path(__file__).resolve().parents[2]
    if (repo / ".git").exists():
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
        assert provenance["git_revision"] == head.stdout.strip()
    assert started <= datetime.fromisoformat(provenance["started"]) <= datetime.now(timezone.utc)
    for point in data["points"]:  # the CPU golden model: no GPU to divide by
        assert point["gpus"] == 0 and point["throughput_tok_s_per_gpu"] is None
    html = (out / "report.html").read_text()
    assert "per GPU" not in html and "tok/s/GPU" not in html and "output tok/s (whole server or CPU host)" in html
    assert "golden backend" in html and _cpu_model_name() in html
    assert (
        "2 requests from heldout.jsonl (200 prompts), up to 8 new tokens" in html and provenance["started"][:10] in html
    )
    # The table shows the plotted statistic: tok/s/user = 1 / mean TPOT.
    for point in data["points"]:
        assert f"<td>{1.0 / point['tpot_s']['mean']:.1f}</td>" in html


def test_a_points_progress_bar_is_drawn_on_a_terminal_only(capsys, monkeypatch):
    monkeypatch.setattr(measure, "PROGRESS_DELAY_S", 0.0)
    for terminal in (False, True):
        monkeypatch.setattr(sys.stderr, "isatty", lambda terminal=terminal: terminal)
        bar = measure.request_bar(2, "dflash c=1")
        bar.update()
        bar.close()
        assert ("dflash c=1:   0%|" in capsys.readouterr().err) == terminal


def test_synthetic_prompts_warn_that_they_understate_speculation(checkpoint, tmp_path, capsys):
    common = ["--checkpoint_dir", str(checkpoint), "--synthetic", "4,4,1", "--concurrency", "1"]
    assert main(["bench", *common, "--output_dir", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "warning: synthetic prompts are random token ids" in err and "build_configs/calibration.jsonl" in err
    assert (Path(__file__).resolve().parents[2] / "build_configs" / "calibration.jsonl").is_file()
