"""Concurrency sweeps with `trtllm-bench --backend tensorrt ... throughput`, one JSON record per point.

The sweep only runs on GPU hosts, but everything around the benchmark process is plain Python and tested here:
the exact command line, resuming (a point with a successful record is never rerun), recording failures without
stopping, and turning trtllm-bench's `--report_json` file into the per-point record the analysis reads.

Report keys follow TensorRT-LLM 1.2.x `tensorrt_llm/bench/dataclasses/reporting.py::get_statistics_dict`:
`performance` (always), `streaming_metrics` (only with `--streaming`), `decoding_stats` (only for speculative
engines), `world_info`; percentile blocks carry p50/p90/p95/p99/minimum/maximum/average.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dflash_trt.errors import DFlashTrtError
from dflash_trt.perf.pareto import Point

ENGINE_KINDS = ("ar", "eagle3", "dflash")
PERCENTILE_KEYS = ("p50", "p90", "p95", "p99", "minimum", "maximum", "average")
# The x-axis definitions a record carries; the analysis names the one it plots.
USER_SPEED_METRICS = {
    "tpot": "tok/s/user = 1000 / mean TPOT (ms), per-request generation speed (needs --streaming)",
    "share": "tok/s/user = system output tok/s / concurrency",
}


@dataclass(frozen=True)
class EngineEntry:
    name: str
    kind: str
    engine_dir: str
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class SweepConfig:
    """One sweep: a fixed dataset and concurrency list, run against each engine."""

    model: str
    dataset: str
    concurrency: tuple[int, ...]
    engines: tuple[EngineEntry, ...]
    output_dir: str
    model_path: str | None = None
    num_requests: int | None = None
    warmup: int | None = None
    streaming: bool = True
    kv_cache_free_gpu_mem_fraction: float | None = None
    launcher: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = field(default_factory=tuple)


def _str_list(value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
        raise DFlashTrtError(f"sweep config: {key!r} must be a list of strings")
    return tuple(str(v) for v in value)


def parse_sweep_config(data: Any, base_dir: str | Path = ".") -> SweepConfig:
    """Validate a sweep config mapping; relative paths are taken relative to `base_dir` (the file's folder)."""
    if not isinstance(data, dict):
        raise DFlashTrtError("sweep config must be a mapping (YAML or JSON object)")
    base = Path(base_dir)
    known = {
        "model", "model_path", "dataset", "concurrency", "engines", "output_dir", "num_requests", "warmup",
        "streaming", "kv_cache_free_gpu_mem_fraction", "launcher", "extra_args",
    }
    unknown = sorted(set(data) - known)
    if unknown:
        raise DFlashTrtError(f"sweep config: unknown key(s) {', '.join(unknown)}")
    for key in ("model", "dataset", "engines", "concurrency"):
        if key not in data:
            raise DFlashTrtError(f"sweep config: missing required key {key!r}")
    conc = data["concurrency"]
    if (
        not isinstance(conc, list)
        or not conc
        or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in conc)
    ):
        raise DFlashTrtError("sweep config: 'concurrency' must be a non-empty list of positive integers")
    if len(set(conc)) != len(conc):
        raise DFlashTrtError("sweep config: 'concurrency' lists a value twice")
    engines_raw = data["engines"]
    if not isinstance(engines_raw, list) or not engines_raw:
        raise DFlashTrtError("sweep config: 'engines' must be a non-empty list")
    engines = []
    for i, e in enumerate(engines_raw):
        if not isinstance(e, dict) or not {"name", "kind", "engine_dir"} <= set(e):
            raise DFlashTrtError(f"sweep config: engine #{i} needs 'name', 'kind' and 'engine_dir'")
        if e["kind"] not in ENGINE_KINDS:
            raise DFlashTrtError(f"sweep config: engine {e['name']!r} kind must be one of {', '.join(ENGINE_KINDS)}")
        name = str(e["name"])
        if not name or "/" in name or name.startswith("."):
            raise DFlashTrtError(f"sweep config: engine name {name!r} must be a plain folder name")
        engines.append(
            EngineEntry(name, e["kind"], str(base / e["engine_dir"]), _str_list(e.get("extra_args"), "extra_args"))
        )
    if len({e.name for e in engines}) != len(engines):
        raise DFlashTrtError("sweep config: two engines share a name")
    if not any(e.kind == "ar" for e in engines):
        raise DFlashTrtError("sweep config: include one 'ar' engine; speedups are measured against it")
    return SweepConfig(
        model=str(data["model"]),
        model_path=str(base / data["model_path"]) if data.get("model_path") else None,
        dataset=str(base / data["dataset"]),
        concurrency=tuple(conc),
        engines=tuple(engines),
        output_dir=str(base / data.get("output_dir", "sweep_results")),
        num_requests=data.get("num_requests"),
        warmup=data.get("warmup"),
        streaming=bool(data.get("streaming", True)),
        kv_cache_free_gpu_mem_fraction=data.get("kv_cache_free_gpu_mem_fraction"),
        launcher=_str_list(data.get("launcher"), "launcher"),
        extra_args=_str_list(data.get("extra_args"), "extra_args"),
    )


def load_sweep_config(path: str | Path) -> SweepConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise DFlashTrtError(f"cannot read sweep config {path}: {exc.strerror}") from exc
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise DFlashTrtError(f"sweep config {path} is not valid YAML: {exc}") from exc
    except RecursionError:
        raise DFlashTrtError(f"sweep config {path} is nested too deeply") from None
    return parse_sweep_config(data, path.parent)


def point_dir(cfg: SweepConfig, engine: EngineEntry, concurrency: int) -> Path:
    return Path(cfg.output_dir) / engine.name / f"c{concurrency:05d}"


def bench_command(cfg: SweepConfig, engine: EngineEntry, concurrency: int, report_json: Path) -> list[str]:
    """The exact trtllm-bench invocation for one point (TensorRT-LLM 1.2.x `throughput` options)."""
    cmd = [*cfg.launcher, "trtllm-bench", "--model", cfg.model]
    if cfg.model_path:
        cmd += ["--model_path", cfg.model_path]
    cmd += [
        "throughput",
        "--backend", "tensorrt",
        "--engine_dir", engine.engine_dir,
        "--dataset", cfg.dataset,
        "--concurrency", str(concurrency),
        "--report_json", str(report_json),
    ]
    if cfg.num_requests is not None:
        cmd += ["--num_requests", str(cfg.num_requests)]
    if cfg.warmup is not None:
        cmd += ["--warmup", str(cfg.warmup)]
    if cfg.kv_cache_free_gpu_mem_fraction is not None:
        cmd += ["--kv_cache_free_gpu_mem_fraction", str(cfg.kv_cache_free_gpu_mem_fraction)]
    if cfg.streaming:
        cmd.append("--streaming")
    return cmd + [*cfg.extra_args, *engine.extra_args]


def _section(report: dict, key: str, source: str) -> dict:
    value = report.get(key)
    if not isinstance(value, dict):
        raise DFlashTrtError(f"{source}: trtllm-bench report has no {key!r} section")
    return value


def _number(section: dict, key: str, where: str) -> float:
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DFlashTrtError(f"{where}: {key!r} is missing or not a number")
    return float(value)


def _percentiles(section: dict, key: str, where: str) -> dict[str, float] | None:
    value = section.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise DFlashTrtError(f"{where}: {key!r} must be a percentile object")
    return {k: _number(value, k, f"{where}.{key}") for k in PERCENTILE_KEYS if k in value}


def record_from_report(report: Any, engine: str, kind: str, concurrency: int, source: str = "report") -> dict:
    """The per-point record: both tok/s/user definitions, tok/s/GPU, latencies, acceptance."""
    if not isinstance(report, dict):
        raise DFlashTrtError(f"{source}: trtllm-bench report must be a JSON object")
    perf = _section(report, "performance", source)
    world = _section(report, "world_info", source)
    where = f"{source}: performance"
    output_tok_s = _number(perf, "system_output_throughput_tok_s", where)
    per_gpu = _number(perf, "output_throughput_per_gpu_tok_s", where)
    world_size = int(_number(world, "world_size", f"{source}: world_info"))
    streaming = report.get("streaming_metrics")
    tpot = ttft = None
    tok_s_user_tpot = None
    if streaming is not None:
        if not isinstance(streaming, dict):
            raise DFlashTrtError(f"{source}: 'streaming_metrics' must be an object")
        swhere = f"{source}: streaming_metrics"
        avg_tpot_ms = _number(streaming, "avg_tpot_ms", swhere)
        if avg_tpot_ms <= 0:
            raise DFlashTrtError(f"{swhere}: 'avg_tpot_ms' must be positive, got {avg_tpot_ms}")
        tok_s_user_tpot = 1000.0 / avg_tpot_ms
        tpot = _percentiles(streaming, "tpot_percentiles", swhere)
        ttft = _percentiles(streaming, "ttft_percentiles", swhere)
    decoding = report.get("decoding_stats")
    acceptance = draft_rate = None
    mean_al = 1.0
    if kind != "ar":
        if not isinstance(decoding, dict):
            raise DFlashTrtError(
                f"{source}: a {kind} engine's report must have 'decoding_stats' (was the engine built with "
                "--speculative_decoding_mode?)"
            )
        dwhere = f"{source}: decoding_stats"
        acceptance = _percentiles(decoding, "acceptance_length_percentiles", dwhere)
        draft_rate = _percentiles(decoding, "draft_acceptance_rate_percentiles", dwhere)
        if not acceptance or "average" not in acceptance:
            raise DFlashTrtError(f"{dwhere}: 'acceptance_length_percentiles' with an 'average' is required")
        mean_al = acceptance["average"]
    return {
        "engine": engine,
        "kind": kind,
        "concurrency": concurrency,
        "status": "ok",
        "gpus": world_size,
        "output_tok_s": output_tok_s,
        "tok_s_gpu": per_gpu,
        "tok_s_user_tpot": tok_s_user_tpot,
        "tok_s_user_share": output_tok_s / concurrency,
        "reported_output_throughput_per_user_tok_s": perf.get("output_throughput_per_user_tok_s"),
        "request_throughput_req_s": perf.get("request_throughput_req_s"),
        "request_latency_ms": _percentiles(perf, "request_latency_percentiles_ms", where),
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "acceptance_length": mean_al,
        "acceptance_length_percentiles": acceptance,
        "draft_acceptance_rate_percentiles": draft_rate,
        # trtllm-bench reports acceptance per request only; per-position rates come from the golden model.
        "per_position_acceptance": None,
    }


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


Runner = Callable[[Sequence[str], Path], int]


def subprocess_runner(cmd: Sequence[str], log_path: Path) -> int:
    """Run one benchmark process with stdout+stderr in `log_path`; a missing executable is a failed point."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        try:
            return subprocess.run(list(cmd), stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        except OSError as exc:
            log.write(f"cannot start {cmd[0]}: {exc}\n")
            return 127


def _log_tail(log_path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_point(cfg: SweepConfig, engine: EngineEntry, concurrency: int, runner: Runner) -> dict:
    """Run (or resume) one point; returns its record, successful or failed, and leaves it in point.json."""
    pdir = point_dir(cfg, engine, concurrency)
    record_path = pdir / "point.json"
    if record_path.exists():
        try:
            previous = json.loads(record_path.read_text())
        except (OSError, json.JSONDecodeError):
            previous = None
        if isinstance(previous, dict) and previous.get("status") == "ok":
            return previous
    report_path = pdir / "report.json"
    if report_path.exists():
        report_path.unlink()
    cmd = bench_command(cfg, engine, concurrency, report_path)
    log_path = pdir / "bench.log"
    rc = runner(cmd, log_path)
    base = {"engine": engine.name, "kind": engine.kind, "concurrency": concurrency, "command": shlex.join(cmd)}
    try:
        if rc != 0:
            raise DFlashTrtError(f"trtllm-bench exited with status {rc}")
        if not report_path.exists():
            raise DFlashTrtError("trtllm-bench finished but wrote no report")
        try:
            report = json.loads(report_path.read_text())
        except json.JSONDecodeError as exc:
            raise DFlashTrtError(f"report.json is not valid JSON: {exc}") from exc
        record = base | record_from_report(report, engine.name, engine.kind, concurrency, str(report_path))
    except DFlashTrtError as exc:
        record = base | {"status": "failed", "returncode": rc, "error": str(exc), "log_tail": _log_tail(log_path)}
    write_json_atomic(record_path, record)
    return record


def run_sweep(cfg: SweepConfig, runner: Runner = subprocess_runner, progress: Callable[[dict], None] | None = None):
    """Every (engine, concurrency) point in order; failed points are recorded and the sweep goes on."""
    records = []
    for engine in cfg.engines:
        for c in cfg.concurrency:
            record = run_point(cfg, engine, c, runner)
            records.append(record)
            if progress is not None:
                progress(record)
    return records


def load_records(output_dir: str | Path) -> list[dict]:
    """All point records under a sweep folder (successful and failed)."""
    root = Path(output_dir)
    if not root.is_dir():
        raise DFlashTrtError(f"sweep results folder {root} does not exist")
    records = []
    for path in sorted(root.glob("*/c*/point.json")):
        try:
            records.append(json.loads(path.read_text()))
        except json.JSONDecodeError as exc:
            raise DFlashTrtError(f"{path} is not valid JSON: {exc}") from exc
    return records


def points_from_records(records: Sequence[dict], user_metric: str = "tpot") -> list[Point]:
    """Analysis points from successful records, using the named tok/s/user definition on the x axis."""
    if user_metric not in USER_SPEED_METRICS:
        raise DFlashTrtError(f"unknown tok/s/user metric {user_metric!r} (known: {', '.join(USER_SPEED_METRICS)})")
    key = f"tok_s_user_{user_metric}"
    points = []
    for r in records:
        if r.get("status") != "ok":
            continue
        x = r.get(key)
        if x is None:
            raise DFlashTrtError(
                f"{r['engine']} at concurrency {r['concurrency']} has no {key} (tpot needs --streaming runs); "
                "use the 'share' metric instead"
            )
        points.append(Point(r["engine"], int(r["concurrency"]), float(x), float(r["tok_s_gpu"])))
    return points
