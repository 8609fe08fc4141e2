"""`dflash-trt sweep`: a concurrency sweep of every engine with our load generator, then frontiers and speedups."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from dflash_trt.analysis.report import analyze_records
from dflash_trt.analysis.sweep import (
    USER_SPEED_METRICS,
    bench_command,
    load_records,
    load_sweep_config,
    point_dir,
    run_sweep,
    write_json_atomic,
)
from dflash_trt.bench.results import RESULTS_FILE
from dflash_trt.bench.targets import describe
from dflash_trt.bench.workload import SYNTHETIC_WARNING
from dflash_trt.checkpoint.atomic import check_output_apart
from dflash_trt.commands.bench import provenance_table
from dflash_trt.decoding_modes import AR
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import FollowerRank
from dflash_trt.inputs import SPEED_LEVELS
from dflash_trt.jsonfile import read_json_object, strict_json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sweep",
        help="concurrency sweep with the dflash-trt load generator, Pareto frontiers and speedup tables",
        description="Measure every engine x concurrency in --config with the load generator of `dflash-trt bench` "
        "(TensorRT-LLM executor, Triton or the CPU golden model; points that already have a successful record are "
        "skipped), then write results.json, report.html, pareto.png and summary.json.",
    )
    p.add_argument("--config", required=True, help="sweep YAML: prompts, concurrency list, engines")
    p.add_argument("--dry_run", action="store_true", help="print every point (and trtllm-bench commands) and exit")
    p.add_argument("--analyze_only", action="store_true", help="skip running; analyze the recorded points")
    p.add_argument(
        "--user_metric",
        choices=sorted(USER_SPEED_METRICS),
        default="tpot",
        help="x axis: 'tpot' = 1 / mean TPOT (default), 'share' = output tok/s / concurrency",
    )
    p.add_argument(
        "--levels", type=SPEED_LEVELS, help="comma-separated tok/s/user values for the speedup table (default: AR's)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = load_sweep_config(args.config)
    if args.dry_run:
        for engine in cfg.engines:
            for c in cfg.concurrency:
                if engine.runner == "trtllm-bench":
                    print(shlex.join(bench_command(cfg, engine, c, point_dir(cfg, engine, c) / "report.json")))
                else:
                    where = ", ".join(f"{k}={v}" for k, v in describe(engine.target).items())
                    print(f"{engine.name} c={c}: dflash-trt load generator on {where}")
        return 0
    check_output_apart(
        cfg.output_dir,
        {
            "--config": args.config,
            "the dataset": cfg.dataset,
            "the model_path": cfg.model_path,
            "the tokenizer_dir": cfg.tokenizer_dir,
            **{f"engine {e.name}": e.target.engine_dir or e.target.checkpoint_dir for e in cfg.engines},
        },
    )
    if Path(cfg.output_dir).exists() and not Path(cfg.output_dir).is_dir():
        raise DFlashTrtError(f"output_dir {cfg.output_dir}: Not a directory (a file is in the way)")
    if args.analyze_only:
        records = load_records(cfg.output_dir)
    else:

        def progress(record: dict, reused: bool) -> None:
            status = record["status"] if record["status"] == "ok" else f"FAILED: {record.get('error')}"
            if reused:
                status = "skipped (measured by an earlier run; delete its point.json to measure again)"
            print(f"{record['engine']} c={record['concurrency']}: {status}", file=sys.stderr)

        if cfg.synthetic and any(e.mode != AR for e in cfg.engines):
            print(SYNTHETIC_WARNING, file=sys.stderr)
        try:
            records = run_sweep(cfg, progress=progress, show_progress=not args.json)
        except FollowerRank:
            return 0  # a multi-GPU engine's other rank: rank 0 writes the report
    results = Path(cfg.output_dir) / RESULTS_FILE
    origin = read_json_object(results, "").get("provenance") if results.is_file() else None
    tables = [provenance_table(origin)] if origin else []
    summary = analyze_records(records, args.user_metric, args.levels, cfg.output_dir, tables)
    write_json_atomic(Path(cfg.output_dir) / "summary.json", summary)
    if args.json:
        print(strict_json(summary, indent=2))
    else:
        print(f"x axis: {summary['x_axis']}")
        if summary["speedup_vs_ar"]:
            what = f"{summary['y_axis']} over {summary['baseline']} at equal tok/s/user"
            print(f"speedup = {what} (each at its own concurrency):")
        for row in summary["speedup_vs_ar"]:
            cells = ", ".join(
                f"{name} {'-' if s is None else f'{s:.2f}x'}" for name, s in sorted(row["speedup"].items())
            )
            print(f"at {row['tok_s_user']:.1f} tok/s/user: {cells}")
        for name, c in sorted(summary["crossover_concurrency_vs_ar"].items()):
            print(f"{name}: crossover {'none in range' if c is None else f'{c:.1f}'}")
        print(f"report: {Path(cfg.output_dir) / 'report.html'}")
    return 0
