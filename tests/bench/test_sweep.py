"""Sweep orchestration: config checks, resuming and failure recording, the AR-only trtllm-bench runner and its
report parsing, and a real sweep of the embedded pair's checkpoint through the load generator (no GPU needed)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from dflash_trt.analysis.sweep import (
    bench_command,
    load_records,
    load_sweep_config,
    parse_sweep_config,
    point_dir,
    points_from_records,
    record_from_report,
    run_sweep,
)
from dflash_trt.commands import sweep as sweep_command
from dflash_trt.errors import DFlashTrtError

FIXTURES = Path(__file__).parents[1] / "data" / "trtllm_bench"


def main(argv: list[str]) -> int:
    """The `sweep` subcommand alone, parsed and run as dflash_trt.cli does it."""
    parser = argparse.ArgumentParser()
    sweep_command.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def _ar_engine(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(
        json.dumps(
            {
                "pretrained_config": {"vocab_size": 64, "mapping": {"world_size": 1}},
                "build_config": {"max_batch_size": 8},
            }
        )
    )
    return root


def _config(tmp_path: Path, **overrides) -> dict:
    """Two AR engines measured by trtllm-bench (the runner a fake process can stand in for)."""
    for name in ("ar", "ar_fp8"):
        _ar_engine(tmp_path / "engines" / name)
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "prompts.jsonl").write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5]}\n')
    data = {
        "model": "Qwen/Qwen3-8B",
        "model_path": "ckpt/Qwen3-8B",
        "dataset": "data/prompts.jsonl",
        "max_new_tokens": 32,
        "concurrency": [1, 4],
        "num_requests": 64,
        "warmup": 2,
        "output_dir": "out",
        "engines": [
            {"name": "ar", "kind": "ar", "engine_dir": "engines/ar", "runner": "trtllm-bench"},
            {"name": "ar_fp8", "kind": "ar", "engine_dir": "engines/ar_fp8", "runner": "trtllm-bench"},
        ],
    }
    data.update(overrides)
    return data


def test_bench_command_is_the_exact_trtllm_bench_invocation(tmp_path):
    cfg = parse_sweep_config(_config(tmp_path, launcher=["mpirun", "-n", "8"]), tmp_path)
    report = tmp_path / "r.json"
    cmd = bench_command(cfg, cfg.engines[1], 4, report)
    assert cmd == [
        "mpirun", "-n", "8",
        "trtllm-bench", "--model", "Qwen/Qwen3-8B", "--model_path", str(tmp_path / "ckpt/Qwen3-8B"),
        "throughput", "--backend", "tensorrt", "--engine_dir", str(tmp_path / "engines/ar_fp8"),
        "--dataset", str(tmp_path / "out" / "trtllm_bench_dataset.jsonl"), "--concurrency", "4",
        "--report_json", str(report), "--num_requests", "64", "--warmup", "2", "--streaming",
    ]  # fmt: skip


def test_record_carries_both_user_speed_definitions_and_acceptance():
    rec = record_from_report(_fixture("dflash_c4_streaming.json"), "dflash", "dflash", 4)
    assert rec["tok_s_user_tpot"] == pytest.approx(1000.0 / 2.5)
    assert rec["tok_s_user_share"] == pytest.approx(12800.0 / 4)
    assert rec["tok_s_gpu"] == 1600.0 and rec["gpus"] == 8
    assert rec["acceptance_length"] == 6.4
    assert rec["tpot_ms"]["p99"] == 3.9 and rec["ttft_ms"]["p50"] == 11.5
    assert rec["draft_acceptance_rate_percentiles"]["average"] == 0.36
    ar = record_from_report(_fixture("ar_c4_streaming.json"), "ar", "ar", 4)
    assert ar["acceptance_length"] == 1.0 and ar["acceptance_length_percentiles"] is None
    assert ar["tok_s_user_tpot"] == pytest.approx(100.0)


def test_report_without_streaming_has_no_tpot_speed():
    rec = record_from_report(_fixture("dflash_c8_no_streaming.json"), "dflash", "dflash", 8)
    assert rec["tok_s_user_tpot"] is None and rec["tok_s_user_share"] == 2500.0
    with pytest.raises(DFlashTrtError, match="share"):
        points_from_records([rec], "tpot")
    assert points_from_records([rec], "share")[0].tok_s_user == 2500.0


@pytest.mark.parametrize(
    ("name", "kind", "message"),
    [
        ("missing_performance.json", "ar", "no 'performance' section"),
        ("bad_throughput_type.json", "ar", "system_output_throughput_tok_s"),
        ("dflash_missing_decoding_stats.json", "dflash", "decoding_stats"),
    ],
)
def test_malformed_reports_give_clear_errors(name, kind, message):
    with pytest.raises(DFlashTrtError, match=message):
        record_from_report(_fixture(name), "e", kind, 4, name)


class FakeBench:
    """Stands in for the benchmark process: copies a recorded report to --report_json, or fails."""

    def __init__(self, fail: set[tuple[str, int]] = frozenset()):
        self.fail = fail
        self.calls: list[list[str]] = []

    def __call__(self, cmd, log_path: Path) -> int:
        self.calls.append(list(cmd))
        engine = Path(cmd[cmd.index("--engine_dir") + 1]).name
        conc = int(cmd[cmd.index("--concurrency") + 1])
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(f"running {engine} c{conc}\nCUDA error: out of memory\n")
        if (engine, conc) in self.fail:
            return 1
        shutil.copy(FIXTURES / "ar_c4_streaming.json", cmd[cmd.index("--report_json") + 1])
        return 0


def test_failed_point_is_recorded_and_sweep_resumes(tmp_path):
    cfg = parse_sweep_config(_config(tmp_path), tmp_path)
    bench = FakeBench(fail={("ar_fp8", 4)})
    records = run_sweep(cfg, bench)
    assert [(r["engine"], r["concurrency"], r["status"]) for r in records] == [
        ("ar", 1, "ok"), ("ar", 4, "ok"), ("ar_fp8", 1, "ok"), ("ar_fp8", 4, "failed"),
    ]  # fmt: skip
    failed = json.loads((point_dir(cfg, cfg.engines[1], 4) / "point.json").read_text())
    assert failed["returncode"] == 1 and "out of memory" in failed["log_tail"]
    assert "--concurrency 4" in failed["command"]
    # trtllm-bench got the sweep's prompts in its own dataset format.
    dataset = (Path(cfg.output_dir) / "trtllm_bench_dataset.jsonl").read_text().splitlines()
    assert json.loads(dataset[1]) == {"task_id": 1, "input_ids": [4, 5], "output_tokens": 32}
    # Second run: only the failed point is run again.
    bench2 = FakeBench()
    records = run_sweep(cfg, bench2)
    assert len(bench2.calls) == 1 and "ar_fp8" in bench2.calls[0][bench2.calls[0].index("--engine_dir") + 1]
    assert all(r["status"] == "ok" for r in records)
    assert len(load_records(cfg.output_dir)) == 4


def test_missing_report_after_success_is_a_failed_point(tmp_path):
    cfg = parse_sweep_config(_config(tmp_path, concurrency=[2]), tmp_path)
    records = run_sweep(cfg, lambda cmd, log: 0)
    assert all(r["status"] == "failed" and "no report" in r["error"] for r in records)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"concurrency": [0, 2]},
            r"'concurrency' must be a non-empty list of distinct values, each an integer in \[1, ",
        ),
        ({"concurrency": [2, 2]}, "distinct values"),
        ({"engines": [{"name": "d", "kind": "medusa", "engine_dir": "x"}]}, "kind"),
        ({"engines": [{"name": "d", "kind": "dflash", "engine_dir": "x"}]}, "'ar' engine"),
        (
            {"engines": [{"name": "d", "kind": "dflash", "engine_dir": "x", "runner": "trtllm-bench"}]},
            "only for AR engines",
        ),
        ({"engines": [{"name": "a", "kind": "ar", "engine_dir": "x", "checkpoint_dir": "y"}]}, "exactly one of"),
        ({"engines": [{"name": "a", "kind": "ar", "engine_dir": "x", "bogus": 1}]}, "unknown key"),
        ({"synthetic": "8,8,4"}, "exactly one of 'dataset'"),
        ({"dataset": None, "synthetic": "8,8"}, "ISL,OSL,COUNT"),
        ({"model": None}, "needs 'model'"),
        ({"bogus": 1}, "unknown key"),
    ],
)
def test_bad_sweep_configs_are_refused(tmp_path, change, message):
    with pytest.raises(DFlashTrtError, match=message):
        parse_sweep_config(_config(tmp_path, **change), tmp_path)


def test_cli_dry_run_prints_commands_and_analyze_writes_report(tmp_path, capsys):
    cfg_path = tmp_path / "sweep.yaml"
    cfg_path.write_text(json.dumps(_config(tmp_path)))
    assert main(["sweep", "--config", str(cfg_path), "--dry_run"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 4 and all("trtllm-bench" in line for line in out)
    cfg = load_sweep_config(cfg_path)
    run_sweep(cfg, FakeBench())
    assert main(["sweep", "--config", str(cfg_path), "--analyze_only", "--levels", "100", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["user_metric"] == "tpot"
    assert (Path(cfg.output_dir) / "report.html").exists()
    with pytest.raises(DFlashTrtError, match="cannot read sweep config"):
        main(["sweep", "--config", str(tmp_path / "missing.yaml")])


@pytest.mark.slow
def test_cpu_sweep_of_the_embedded_pair_through_the_load_generator(tmp_path, capsys):
    """DFlash and the target alone from one converted checkpoint, measured by the driver: records, results.json,
    the Pareto report and PNG; a second run resumes without measuring again."""
    from dflash_trt.bench.results import load_results
    from dflash_trt.conversion.convert import convert_checkpoint
    from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir

    convert_checkpoint(target_dir(), draft_dir(), tmp_path / "ckpt", dtype="float32")
    prompts = [{"text": p.text} for p in load_heldout(limit=4)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    config = {
        "dataset": "prompts.jsonl", "tokenizer_dir": "ckpt", "max_new_tokens": 32, "concurrency": [1, 2],
        "output_dir": "sweep",
        "engines": [{"name": "dflash", "kind": "dflash", "checkpoint_dir": "ckpt"},
                    {"name": "ar", "kind": "ar", "checkpoint_dir": "ckpt"}],
    }  # fmt: skip
    cfg_path = tmp_path / "sweep.yaml"
    cfg_path.write_text(json.dumps(config))
    assert main(["sweep", "--config", str(cfg_path), "--json"]) == 0
    first = capsys.readouterr()
    summary = json.loads(first.out)
    assert first.err.count(": ok") == 4 and "skipped" not in first.err and "warning" not in first.err
    records = load_records(tmp_path / "sweep")
    assert sorted((r["engine"], r["concurrency"], r["status"]) for r in records) == [
        ("ar", 1, "ok"),
        ("ar", 2, "ok"),
        ("dflash", 1, "ok"),
        ("dflash", 2, "ok"),
    ]
    by_key = {(r["engine"], r["concurrency"]): r for r in records}
    assert by_key["dflash", 1]["acceptance_length"] > 2.0 and by_key["ar", 1]["acceptance_length"] == 1.0
    # The same prompts, so the same tokens: speculation is lossless under the sweep's in-flight batching.
    assert [r["output_ids"] for r in by_key["dflash", 2]["per_request"]] == [
        r["output_ids"] for r in by_key["ar", 2]["per_request"]
    ]
    assert len(load_results(tmp_path / "sweep" / "results.json")) == 4
    assert summary["baseline"] == "ar" and summary["png_written"]
    assert (tmp_path / "sweep" / "pareto.png").stat().st_size > 0
    before = (tmp_path / "sweep" / "dflash" / "c00001" / "point.json").stat().st_mtime_ns
    assert main(["sweep", "--config", str(cfg_path), "--json"]) == 0
    assert (tmp_path / "sweep" / "dflash" / "c00001" / "point.json").stat().st_mtime_ns == before
    rerun = capsys.readouterr().err.splitlines()
    assert rerun == [f"{e} c={c}: skipped (measured by an earlier run; delete its point.json to measure again)"
                     for e in ("dflash", "ar") for c in (1, 2)]  # fmt: skip
    provenance = json.loads((tmp_path / "sweep" / "results.json").read_text())["provenance"]
    assert provenance["backend"] == "golden" and provenance["target"] == str((tmp_path / "ckpt").resolve())
    assert main(["sweep", "--config", str(cfg_path), "--analyze_only"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "speedup = output tok/s (whole server or CPU host) over ar at equal tok/s/user" in printed[1]
    assert all(line.startswith("at ") for line in printed[2 : 2 + len(summary["speedup_vs_ar"])])
    report = (tmp_path / "sweep" / "report.html").read_text()
    assert "Where these numbers come from" in report and provenance["started"] in report


def _bench_all():
    import importlib.util

    path = Path(__file__).parents[2] / "perf" / "bench_all.py"
    spec = importlib.util.spec_from_file_location("bench_all", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_all_runs_each_script_and_tabulates_ratios(tmp_path):
    bench_all = _bench_all()
    (tmp_path / "bench_decode.py").write_text(
        'print("warming up")\nprint(\'{"name": "decode", "ratios": {"spec_tok_s_vs_ar_tok_s": 2.5}}\')\n'
    )
    (tmp_path / "bench_convert.py").write_text("import sys\nprint('boom')\nsys.exit(3)\n")
    (tmp_path / "bench_zzz.py").write_text('print(\'{"name": "z", "ratios": {"x": "fast"}}\')\n')
    (tmp_path / "bench_all.py").write_text("raise SystemExit('the driver must not run itself')\n")
    scripts = bench_all.find_benchmarks(tmp_path)
    assert [s.name for s in scripts] == ["bench_convert.py", "bench_decode.py", "bench_zzz.py"]
    results = [bench_all.run_benchmark(s, 60, tmp_path) for s in scripts]
    assert results[0]["ok"] is False and results[0]["error"] == "exit status 3" and "boom" in results[0]["output"]
    assert results[1] == {
        "script": "bench_decode.py", "ok": True, "name": "decode", "ratios": {"spec_tok_s_vs_ar_tok_s": 2.5},
    }  # fmt: skip
    assert results[2]["ok"] is False and "not a finite number" in results[2]["error"]
    table = bench_all.format_table(results).splitlines()
    assert table[0].split() == ["benchmark", "metric", "ratio"]
    assert table[3].split() == ["decode", "spec_tok_s_vs_ar_tok_s", "2.500"]


@pytest.mark.parametrize(
    ("stdout", "message"),
    [("", "printed nothing"), ("done\n", "not JSON"), ('{"name": "a", "ratios": {}}', "non-empty")],
)
def test_bench_protocol_violations_are_named(stdout, message):
    with pytest.raises(ValueError, match=message):
        _bench_all().parse_result(stdout)
