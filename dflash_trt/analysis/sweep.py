"""Concurrency sweeps, one JSON record per (engine, concurrency) point, measured by our load generator.

Every engine of a sweep is driven by `dflash_trt.bench` (TensorRT-LLM executor, Triton server or the CPU golden
model) on the same prompts, so AR, EAGLE and DFlash points are comparable. Everything around the measurement is
plain Python and tested here: resuming (a point with a successful record is never rerun), recording failures
without stopping, and the per-point record the analysis reads.

`trtllm-bench --backend tensorrt` stays available for AR engines only (`runner: trtllm-bench`), as a cross-check
with NVIDIA's tool: in 1.2.x it copies the engine's speculative decoding mode into a runtime map holding only
NONE and MEDUSA, never imports our model class, passes no chain choices and never loads our plugin library, so it
cannot run DFlash (or EAGLE) engines. Its report keys follow TensorRT-LLM 1.2.x
`tensorrt_llm/bench/dataclasses/reporting.py::get_statistics_dict`: `performance`, `streaming_metrics` (with
`--streaming`), `decoding_stats` (speculative engines), `world_info`; percentile blocks carry
p50/p90/p95/p99/minimum/maximum/average.
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

from dflash_trt.analysis.pareto import Point
from dflash_trt.bench.measure import measure_point, request_bar
from dflash_trt.bench.results import RESULTS_FILE, sweep_fields, write_results
from dflash_trt.bench.targets import (
    Target,
    check_target,
    describe,
    executor_factory,
    max_positions,
    provenance,
    vocab_size,
)
from dflash_trt.bench.workload import Workload, file_workload, parse_synthetic, synthetic_workload
from dflash_trt.decoding_modes import AR, DECODING_MODES, DecodingMode
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import FollowerRank
from dflash_trt.inputs import (
    CONCURRENCIES,
    CONCURRENCY,
    END_ID,
    GPUS,
    MEMORY_FRACTION,
    POSITIVE_INT,
    REQUESTS,
    SEED,
    TIMEOUT_S,
    URL,
    WARMUP,
    FloatRange,
    check_bool,
    check_text,
)
from dflash_trt.jsonfile import read_json_object, strict_json
from dflash_trt.yamlfile import safe_load_unique

RUNNERS = ("driver", "trtllm-bench")
PERCENTILE_KEYS = ("p50", "p90", "p95", "p99", "minimum", "maximum", "average")
# The x-axis definitions a record carries; the analysis names the one it plots.
USER_SPEED_METRICS = {
    "tpot": "tok/s/user = 1 / mean TPOT, per-request generation speed while tokens stream",
    "share": "tok/s/user = system output tok/s / concurrency",
}
TRTLLM_BENCH_DATASET = "trtllm_bench_dataset.jsonl"


@dataclass(frozen=True)
class EngineEntry:
    name: str
    mode: DecodingMode  # the config's `kind` key
    target: Target
    runner: str = "driver"
    extra_args: tuple[str, ...] = ()

    @property
    def engine_dir(self) -> str | None:
        return self.target.engine_dir


@dataclass(frozen=True)
class SweepConfig:
    """One sweep: a fixed prompt set and concurrency list, run against each engine."""

    concurrency: tuple[int, ...]
    engines: tuple[EngineEntry, ...]
    output_dir: str
    dataset: str | None = None
    synthetic: str | None = None
    max_new_tokens: int = 1024
    tokenizer_dir: str | None = None
    num_requests: int | None = None
    warmup: int | None = None
    max_batch_size: int | None = None
    kv_cache_free_gpu_mem_fraction: float | None = None
    seed: int = 0
    timeout_s: float | None = None
    # trtllm-bench runner only
    model: str | None = None
    model_path: str | None = None
    streaming: bool = True
    launcher: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = field(default_factory=tuple)


def _str_list(value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
        raise DFlashTrtError(f"sweep config: {key!r} must be a list of strings")
    return tuple(str(v) for v in value)


POINT_STATUSES = ("ok", "failed")
THROUGHPUT = FloatRange(0.0, 1e12)


def _field(data: dict, key: str, rule: Callable[[Any, str], Any], where: str = "sweep config") -> Any:
    """`data[key]` checked by one of the shared input rules (None when absent)."""
    value = data.get(key)
    return None if value is None else rule(value, f"{where}: {key!r}")


def _engine_entry(i: int, e: Any, base: Path) -> EngineEntry:
    where_keys = ("engine_dir", "checkpoint_dir", "triton_url")
    known = {
        "name",
        "kind",
        "runner",
        "extra_args",
        "plugin_library",
        "eagle_choices",
        "triton_model",
        "gpus",
        "end_id",
        *where_keys,
    }
    if not isinstance(e, dict) or not {"name", "kind"} <= set(e):
        raise DFlashTrtError(f"sweep config: engine #{i} needs 'name' and 'kind'")
    name = check_text(e["name"], f"sweep config: engine #{i} 'name'")
    where = f"sweep config: engine {name!r}"
    for key in ("engine_dir", "checkpoint_dir", "plugin_library", "triton_model"):
        _field(e, key, check_text, where)
    unknown = sorted(set(e) - known)
    if unknown:
        raise DFlashTrtError(f"sweep config: engine {name!r} has unknown key(s) {', '.join(unknown)}")
    if not name or "/" in name or name.startswith("."):
        raise DFlashTrtError(f"sweep config: engine name {name!r} must be a plain folder name")
    if e["kind"] not in DECODING_MODES:
        raise DFlashTrtError(f"sweep config: engine {name!r} kind must be one of {', '.join(DECODING_MODES)}")
    if sum(1 for k in where_keys if e.get(k)) != 1:
        raise DFlashTrtError(f"sweep config: engine {name!r} needs exactly one of {', '.join(where_keys)}")
    runner = e.get("runner", "driver")
    if runner not in RUNNERS:
        raise DFlashTrtError(f"sweep config: engine {name!r} runner must be one of {', '.join(RUNNERS)}")
    if runner == "trtllm-bench" and (e["kind"] != AR or not e.get("engine_dir")):
        raise DFlashTrtError(
            f"sweep config: engine {name!r}: runner trtllm-bench works only for AR engines (engine_dir, kind ar); "
            "1.2.x trtllm-bench cannot run EAGLE-mode engines"
        )
    choices = e.get("eagle_choices")
    if choices is not None and (
        not isinstance(choices, list)
        or not all(isinstance(c, list) and all(isinstance(x, int) for x in c) for c in choices)
    ):
        raise DFlashTrtError(f"sweep config: engine {name!r} eagle_choices must be a list of integer lists")
    try:
        target = Target(
            mode=e["kind"],
            engine_dir=str(base / e["engine_dir"]) if e.get("engine_dir") else None,
            checkpoint_dir=str(base / e["checkpoint_dir"]) if e.get("checkpoint_dir") else None,
            triton_url=_field(e, "triton_url", URL.check, where),
            plugin_library=str(base / e["plugin_library"]) if e.get("plugin_library") else None,
            eagle_choices=None if choices is None else tuple(tuple(c) for c in choices),
            triton_model=str(e.get("triton_model", "tensorrt_llm")),
            gpus=_field(e, "gpus", GPUS.check, where),
            end_id=_field(e, "end_id", END_ID.check, where),
        )
    except DFlashTrtError as exc:
        raise DFlashTrtError(f"sweep config: engine {name!r}: {exc}") from None
    return EngineEntry(name, target.mode, target, runner, _str_list(e.get("extra_args"), "extra_args"))


def parse_sweep_config(data: Any, base_dir: str | Path = ".") -> SweepConfig:
    """Validate a sweep config mapping; relative paths are taken relative to `base_dir` (the file's folder)."""
    if not isinstance(data, dict):
        raise DFlashTrtError("sweep config must be a mapping (YAML or JSON object)")
    base = Path(base_dir)
    known = {
        "dataset", "synthetic", "max_new_tokens", "tokenizer_dir", "concurrency", "engines", "output_dir",
        "num_requests", "warmup", "max_batch_size", "kv_cache_free_gpu_mem_fraction", "seed", "timeout_s",
        "model", "model_path", "streaming", "launcher", "extra_args",
    }  # fmt: skip
    unknown = sorted(set(data) - known)
    if unknown:
        raise DFlashTrtError(f"sweep config: unknown key(s) {', '.join(unknown)}")
    for key in ("engines", "concurrency"):
        if key not in data:
            raise DFlashTrtError(f"sweep config: missing required key {key!r}")
    if bool(data.get("dataset")) == bool(data.get("synthetic")):
        raise DFlashTrtError(
            "sweep config: give exactly one of 'dataset' (jsonl prompts) and 'synthetic' (ISL,OSL,COUNT)"
        )
    if data.get("synthetic"):
        parse_synthetic(str(data["synthetic"]))
    conc = CONCURRENCIES.check(data["concurrency"], "sweep config: 'concurrency'")
    for key in ("dataset", "synthetic", "tokenizer_dir", "output_dir", "model", "model_path"):
        _field(data, key, check_text)
    engines_raw = data["engines"]
    if not isinstance(engines_raw, list) or not engines_raw:
        raise DFlashTrtError("sweep config: 'engines' must be a non-empty list")
    engines = [_engine_entry(i, e, base) for i, e in enumerate(engines_raw)]
    if len({e.name for e in engines}) != len(engines):
        raise DFlashTrtError("sweep config: two engines share a name")
    if not any(e.mode == AR for e in engines):
        raise DFlashTrtError("sweep config: include one 'ar' engine; speedups are measured against it")
    if any(e.runner == "trtllm-bench" for e in engines) and not data.get("model"):
        raise DFlashTrtError("sweep config: runner trtllm-bench needs 'model' (its --model tokenizer name)")
    return SweepConfig(
        concurrency=tuple(conc),
        engines=tuple(engines),
        output_dir=str(base / data.get("output_dir", "sweep_results")),
        dataset=str(base / data["dataset"]) if data.get("dataset") else None,
        synthetic=str(data["synthetic"]) if data.get("synthetic") else None,
        max_new_tokens=_field(data, "max_new_tokens", POSITIVE_INT.check) or 1024,
        tokenizer_dir=str(base / data["tokenizer_dir"]) if data.get("tokenizer_dir") else None,
        num_requests=_field(data, "num_requests", REQUESTS.check),
        warmup=_field(data, "warmup", WARMUP.check),
        max_batch_size=_field(data, "max_batch_size", CONCURRENCY.check),
        kv_cache_free_gpu_mem_fraction=_field(data, "kv_cache_free_gpu_mem_fraction", MEMORY_FRACTION.check),
        seed=_field(data, "seed", SEED.check) or 0,
        timeout_s=_field(data, "timeout_s", TIMEOUT_S.check),
        model=str(data["model"]) if data.get("model") else None,
        model_path=str(base / data["model_path"]) if data.get("model_path") else None,
        streaming=check_bool(data.get("streaming", True), "sweep config: 'streaming'"),
        launcher=_str_list(data.get("launcher"), "launcher"),
        extra_args=_str_list(data.get("extra_args"), "extra_args"),
    )


def load_sweep_config(path: str | Path) -> SweepConfig:
    path = Path(path)
    try:
        data = safe_load_unique(path.read_text(encoding="utf-8"))
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
    """The exact trtllm-bench invocation for one AR point (TensorRT-LLM 1.2.x `throughput` options)."""
    cmd = [*cfg.launcher, "trtllm-bench", "--model", str(cfg.model)]
    if cfg.model_path:
        cmd += ["--model_path", cfg.model_path]
    cmd += [
        "throughput",
        "--backend", "tensorrt",
        "--engine_dir", str(engine.engine_dir),
        "--dataset", str(Path(cfg.output_dir) / TRTLLM_BENCH_DATASET),
        "--concurrency", str(concurrency),
        "--report_json", str(report_json),
    ]  # fmt: skip
    if cfg.num_requests is not None:
        cmd += ["--num_requests", str(cfg.num_requests)]
    if cfg.warmup is not None:
        cmd += ["--warmup", str(cfg.warmup)]
    if cfg.kv_cache_free_gpu_mem_fraction is not None:
        cmd += ["--kv_cache_free_gpu_mem_fraction", str(cfg.kv_cache_free_gpu_mem_fraction)]
    if cfg.streaming:
        cmd.append("--streaming")
    return cmd + [*cfg.extra_args, *engine.extra_args]


def sweep_workload(cfg: SweepConfig) -> Workload:
    """The one prompt set every engine of the sweep gets."""
    limits = [n for n in (max_positions(e.target) for e in cfg.engines) if n]
    positions = min(limits) if limits else None
    if cfg.synthetic:
        vocabs = {v for v in (vocab_size(e.target) for e in cfg.engines) if v}
        if not vocabs:
            raise DFlashTrtError(
                "sweep config: synthetic prompts need an engine or checkpoint to take the vocabulary size from"
            )
        workload = synthetic_workload(parse_synthetic(cfg.synthetic), min(vocabs), cfg.seed, positions)
    else:
        from dflash_trt.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.tokenizer_dir) if cfg.tokenizer_dir else None
        workload = file_workload(str(cfg.dataset), cfg.max_new_tokens, tokenizer, max_positions=positions)
    return workload if cfg.num_requests is None else workload.resized(cfg.num_requests)


def write_trtllm_bench_dataset(path: Path, workload: Workload) -> None:
    """The same prompts in trtllm-bench's dataset format (`task_id`, `input_ids`, `output_tokens`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps({"task_id": i, "input_ids": r.input_ids, "output_tokens": r.max_new_tokens}) + "\n"
            for i, r in enumerate(workload.requests)
        )
    )


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


def record_from_report(report: Any, engine: str, mode: str, concurrency: int, source: str = "report") -> dict:
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
    if mode != AR:
        if not isinstance(decoding, dict):
            raise DFlashTrtError(
                f"{source}: a {mode} engine's report must have 'decoding_stats' (was the engine built with "
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
        "kind": mode,
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
        f.write(strict_json(data, indent=2, sort_keys=True) + "\n")
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


def _previous_ok(record_path: Path) -> dict | None:
    if not record_path.exists():
        return None
    try:
        previous = json.loads(record_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return previous if isinstance(previous, dict) and previous.get("status") == "ok" else None


def _trtllm_bench_point(cfg: SweepConfig, engine: EngineEntry, concurrency: int, runner: Runner) -> dict:
    pdir = point_dir(cfg, engine, concurrency)
    report_path = pdir / "report.json"
    if report_path.exists():
        report_path.unlink()
    cmd = bench_command(cfg, engine, concurrency, report_path)
    log_path = pdir / "bench.log"
    rc = runner(cmd, log_path)
    base = {"engine": engine.name, "kind": engine.mode, "concurrency": concurrency, "command": shlex.join(cmd)}
    try:
        if rc != 0:
            raise DFlashTrtError(f"trtllm-bench exited with status {rc}")
        if not report_path.exists():
            raise DFlashTrtError("trtllm-bench finished but wrote no report")
        try:
            report = json.loads(report_path.read_text())
        except json.JSONDecodeError as exc:
            raise DFlashTrtError(f"report.json is not valid JSON: {exc}") from exc
        return base | record_from_report(report, engine.name, engine.mode, concurrency, str(report_path))
    except DFlashTrtError as exc:
        return base | {"status": "failed", "returncode": rc, "error": str(exc), "log_tail": _log_tail(log_path)}


def _driver_point(
    cfg: SweepConfig, engine: EngineEntry, concurrency: int, workload: Workload, show_progress: bool = False
) -> dict:
    base = {"engine": engine.name, "kind": engine.mode, "concurrency": concurrency, "target": describe(engine.target)}
    bar = request_bar(len(workload.requests), f"{engine.name} c={concurrency}", show_progress)
    try:
        factory = executor_factory(engine.target, workload, cfg.max_batch_size, cfg.kv_cache_free_gpu_mem_fraction)
        point = measure_point(
            factory,
            workload,
            engine.name,
            concurrency=concurrency,
            warmup=cfg.warmup or 0,
            seed=cfg.seed,
            timeout_s=cfg.timeout_s,
            on_request_done=bar.update,
        )
    except FollowerRank:
        raise
    except Exception as exc:  # a failed point is recorded and the sweep goes on, whatever the executor raised
        return base | {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    finally:
        bar.close()
    if not point.requests:
        errors = {r.error for r in point.per_request if r.error}
        return base | {"status": "failed", "error": "no request finished: " + "; ".join(sorted(errors))}
    return base | point.to_json() | sweep_fields(point) | {"status": "ok"}


def run_point(
    cfg: SweepConfig,
    engine: EngineEntry,
    concurrency: int,
    runner: Runner,
    workload: Workload | None = None,
    show_progress: bool = False,
) -> tuple[dict, bool]:
    """Run (or resume) one point; returns its record, successful or failed, left in point.json, and whether it
    was reused from an earlier run of the same point instead of measured now."""
    record_path = point_dir(cfg, engine, concurrency) / "point.json"
    previous = _previous_ok(record_path)
    if previous is not None:
        return previous, True
    if engine.runner == "trtllm-bench":
        record = _trtllm_bench_point(cfg, engine, concurrency, runner)
    else:
        record = _driver_point(cfg, engine, concurrency, workload or sweep_workload(cfg), show_progress)
    write_json_atomic(record_path, record)
    return record, False


def run_sweep(
    cfg: SweepConfig,
    runner: Runner = subprocess_runner,
    progress: Callable[[dict, bool], None] | None = None,
    show_progress: bool = False,
):
    """Every (engine, concurrency) point in order; failed points are recorded and the sweep goes on. The driver's
    points are also collected in `<output_dir>/results.json` (the `dflash-trt bench` schema). `progress` hears
    each point's record and whether it was reused from an earlier run; `show_progress` draws a bar of each point's
    requests."""
    for engine in cfg.engines:
        check_target(engine.target)
    workload = sweep_workload(cfg)
    if any(e.runner == "trtllm-bench" for e in cfg.engines):
        write_trtllm_bench_dataset(Path(cfg.output_dir) / TRTLLM_BENCH_DATASET, workload)
    origin = provenance(cfg.engines[0].target)
    records, follower = [], False
    for engine in cfg.engines:
        for c in cfg.concurrency:
            try:
                record, reused = run_point(cfg, engine, c, runner, workload, show_progress)
            except FollowerRank:
                follower = True
                continue
            records.append(record)
            if progress is not None:
                progress(record, reused)
    if follower:
        raise FollowerRank()  # rank 0 records and analyses the points
    driver_points = [r for r in records if r.get("status") == "ok" and "per_request" in r]
    write_results(Path(cfg.output_dir) / RESULTS_FILE, driver_points, workload.description, origin)
    return records


def load_records(output_dir: str | Path) -> list[dict]:
    """All point records under a sweep folder (successful and failed)."""
    root = Path(output_dir)
    if not root.is_dir():
        raise DFlashTrtError(f"sweep results folder {root} does not exist")
    records = []
    for path in sorted(root.glob("*/c*/point.json")):
        records.append(check_point_record(read_json_object(path, f"{path} disappeared"), str(path)))
    return records


def check_point_record(record: dict, where: str) -> dict:
    """A point record as the analysis reads it: every field it uses present and of its type (a hand-edited or
    truncated point.json is refused in one line, not met as a KeyError in the middle of the report)."""
    check_text(record.get("engine"), f"{where}: 'engine'")
    if record.get("kind") not in DECODING_MODES:
        raise DFlashTrtError(
            f"{where}: 'kind' must be one of {', '.join(DECODING_MODES)}, got {record.get('kind')!r:.40}"
        )
    CONCURRENCY.check(record.get("concurrency"), f"{where}: 'concurrency'")
    if record.get("status") not in POINT_STATUSES:
        raise DFlashTrtError(f"{where}: 'status' must be one of {', '.join(POINT_STATUSES)}")
    if record["status"] == "ok":
        THROUGHPUT.check(record.get("tok_s_gpu"), f"{where}: 'tok_s_gpu'")
        for key in (f"tok_s_user_{metric}" for metric in USER_SPEED_METRICS):
            _field(record, key, THROUGHPUT.check, where)
    return record


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
