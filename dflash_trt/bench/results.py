"""The one definition of `results.json` and of every per-point statistic it holds.

`results.json` is `{"format": ..., "provenance": {...}, "workload": {...}, "points": [point, ...]}` (strict
JSON: no Infinity or NaN), one point per (mode, concurrency or request rate); `provenance` is `bench.provenance`'s
record of backend, target, host, versions, git revision and start time. A point's keys (what `dflash-trt sweep`,
the report and `plan --calibrate` read):

- `mode` ("dflash", "ar" or "eagle3"), `engine` (the name plotted), `concurrency` (closed loop; null for an
  open-loop point) and `request_rate` (requests/s; null for a closed-loop point), `gpus` (0 for the CPU golden
  model).
- `requests` (finished without error), `failed`, `output_tokens` (of the finished requests), `duration_s` (first
  request sent to last response), `throughput_tok_s` = output_tokens / duration_s, `throughput_tok_s_per_gpu`
  (null without GPUs).
- `per_user_tok_s`, `ttft_s`, `tpot_s`: {p50, p90, p99, mean} over requests. TTFT = first token's arrival minus
  the request's send time; TPOT = (last token's arrival - first token's) / (output tokens - 1); per-user tok/s =
  1 / TPOT, the speed a user watches tokens stream at (requests with one token have neither).
- `acceptance_length`: tokens per generation iteration (bonus token included; the context iteration, which yields
  the first token, is not counted), over all iterations of all requests; 1.0 for AR. `acceptance_histogram`:
  element i = generation iterations that yielded i + 1 tokens (the format `plan --acceptance_json` reads).
- `max_in_flight`, `mean_in_flight` (time-weighted between the first send and the last response) and
  `in_flight_trace` ([seconds, requests in flight] after every send and finish): the concurrency really held.
- `per_request`: one object per request in send order: `prompt_index`, `input_len`, `output_ids`,
  `decoding_iterations` (executor responses that carried tokens), `acceptance` (tokens per generation iteration),
  `ttft_s`, `latency_s`, `response_times_s` (arrival of each response after the send; every token of a response
  arrives with it), `error`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_trt.bench.driver import RequestRecord, RunTrace
from dflash_trt.decoding_modes import DECODING_MODES
from dflash_trt.errors import DFlashTrtError
from dflash_trt.jsonfile import strict_json

FORMAT = "dflash-trt-bench/1"
RESULTS_FILE = "results.json"
PERCENTILES = (50, 90, 99)
POINT_KEYS = (
    "mode", "engine", "concurrency", "request_rate", "gpus", "requests", "failed", "output_tokens", "duration_s",
    "throughput_tok_s", "throughput_tok_s_per_gpu", "per_user_tok_s", "ttft_s", "tpot_s", "acceptance_length",
    "acceptance_histogram", "max_in_flight", "mean_in_flight", "in_flight_trace", "per_request",
)  # fmt: skip


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default method)."""
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def summary(values: Sequence[float]) -> dict[str, float] | None:
    """{p50, p90, p99, mean} of the values; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    out = {f"p{q}": percentile(ordered, q) for q in PERCENTILES}
    out["mean"] = sum(ordered) / len(ordered)
    return out


def request_tpot(record: RequestRecord) -> float | None:
    tokens = len(record.output_ids)
    if tokens < 2 or record.response_s[-1] <= record.response_s[0]:
        return None
    return (record.response_s[-1] - record.response_s[0]) / (tokens - 1)


def _mean_in_flight(trace: Sequence[tuple[float, int]], end: float) -> float:
    area = 0.0
    for (t, n), (t_next, _) in zip(trace, [*trace[1:], (end, 0)], strict=True):
        area += n * (t_next - t)
    start = trace[0][0]
    return area / (end - start) if end > start else float(trace[0][1])


def _request_entry(record: RequestRecord) -> dict[str, Any]:
    first = record.response_s[0] - record.sent_s if record.response_s else None
    return {
        "prompt_index": record.prompt_index,
        "input_len": record.input_len,
        "output_ids": record.output_ids,
        "decoding_iterations": len(record.chunks),
        "acceptance": record.chunks[1:],
        "ttft_s": first,
        "latency_s": None if record.finished_s is None else record.finished_s - record.sent_s,
        "response_times_s": [t - record.sent_s for t in record.response_s],
        "error": record.error,
    }


def point_from_run(
    trace: RunTrace,
    *,
    mode: str,
    engine: str,
    gpus: int = 1,
    concurrency: int | None = None,
    request_rate: float | None = None,
) -> dict[str, Any]:
    """The results point of one measured run."""
    if mode not in DECODING_MODES:
        raise DFlashTrtError(f"unknown mode {mode!r} (known: {', '.join(DECODING_MODES)})")
    ok = [r for r in trace.records if r.error is None and r.output_ids]
    output_tokens = sum(len(r.output_ids) for r in ok)
    tpots = [t for t in map(request_tpot, ok) if t is not None]
    steps = [n for r in ok for n in r.chunks[1:]]
    histogram = [0] * max(steps, default=0)
    for n in steps:
        histogram[n - 1] += 1
    duration = trace.duration_s
    throughput = output_tokens / duration if duration > 0 else 0.0
    return {
        "mode": mode,
        "engine": engine,
        "concurrency": concurrency,
        "request_rate": request_rate,
        "gpus": gpus,
        "requests": len(ok),
        "failed": len(trace.records) - len(ok),
        "output_tokens": output_tokens,
        "duration_s": duration,
        "throughput_tok_s": throughput,
        "throughput_tok_s_per_gpu": throughput / gpus if gpus else None,
        "per_user_tok_s": summary([1.0 / t for t in tpots]),
        "ttft_s": summary([r.response_s[0] - r.sent_s for r in ok]),
        "tpot_s": summary(tpots),
        "acceptance_length": sum(steps) / len(steps) if steps else None,
        "acceptance_histogram": histogram,
        "max_in_flight": max(n for _, n in trace.in_flight),
        "mean_in_flight": _mean_in_flight(trace.in_flight, duration),
        "in_flight_trace": [[t, n] for t, n in trace.in_flight],
        "per_request": [_request_entry(r) for r in trace.records],
    }


def sweep_fields(point: dict[str, Any]) -> dict[str, Any]:
    """The Pareto analysis's view of a point: tok/s/GPU (the host's tok/s for a CPU run, `gpus` 0) and both
    tok/s/user definitions of `analysis.sweep`."""
    tpot = point["tpot_s"]
    concurrency = point["concurrency"]
    return {
        "gpus": point["gpus"],
        "tok_s_gpu": point["throughput_tok_s_per_gpu"] if point["gpus"] else point["throughput_tok_s"],
        "tok_s_user_tpot": 1.0 / tpot["mean"] if tpot and tpot["mean"] > 0 else None,
        "tok_s_user_share": point["throughput_tok_s"] / concurrency if concurrency else None,
    }


def write_results(
    path: str | Path, points: Sequence[dict[str, Any]], workload: dict[str, Any], provenance: dict[str, Any]
) -> None:
    data = {"format": FORMAT, "provenance": provenance, "workload": workload, "points": list(points)}
    Path(path).write_text(strict_json(data) + "\n")


def load_results(path: str | Path) -> list[dict[str, Any]]:
    """The points of a results.json, checked for the keys above."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise DFlashTrtError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise DFlashTrtError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("points"), list):
        raise DFlashTrtError(f"{path} is not a dflash-trt bench results file ({FORMAT})")
    for i, point in enumerate(data["points"]):
        missing = [k for k in POINT_KEYS if not isinstance(point, dict) or k not in point]
        if missing:
            raise DFlashTrtError(f"{path}: point {i} lacks {', '.join(missing)}")
    return data["points"]
