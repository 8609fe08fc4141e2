"""The one definition of `results.json` and of every per-point statistic it holds.

`results.json` is `{"format": ..., "provenance": {...}, "workload": {...}, "points": [point, ...]}` (strict
JSON: no Infinity or NaN), one point per (mode, concurrency or request rate); `provenance` is `bench.provenance`'s
record of backend, target, host, versions, git revision and start time. A point is a `BenchPoint` (what
`dflash-trt sweep`, the report and `plan --calibrate` read): its fields, in order, are the point's keys.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from dflash_trt.bench.driver import RequestRecord, RunTrace
from dflash_trt.decoding_modes import DECODING_MODES, DecodingMode
from dflash_trt.errors import DFlashTrtError
from dflash_trt.jsonfile import strict_json

FORMAT = "dflash-trt-bench/1"
RESULTS_FILE = "results.json"
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Stats:
    """Percentiles and mean over requests (`summary`)."""

    p50: float
    p90: float
    p99: float
    mean: float


@dataclass(frozen=True)
class RequestEntry:
    """One request of a point, in send order."""

    prompt_index: int
    input_len: int
    output_ids: list[int]
    decoding_iterations: int  # executor responses that carried tokens
    acceptance: list[int]  # tokens per generation iteration
    # Drafts each generation iteration verified (the draft-length schedule at work); None where the executor does
    # not report them (an engine or a server: their schedule is built into the engine).
    draft_lens: list[int] | None
    ttft_s: float | None
    latency_s: float | None
    response_times_s: list[float]  # arrival of each response after the send; a response's tokens arrive with it
    error: str | None


@dataclass(frozen=True)
class BenchPoint:
    """One point of results.json, one per (mode, concurrency or request rate); fields in the file's key order.

    TTFT = first token's arrival minus the request's send time; TPOT = (last token's arrival - first token's) /
    (output tokens - 1); per-user tok/s = 1 / TPOT, the speed a user watches tokens stream at (requests with one
    token have neither)."""

    mode: DecodingMode
    engine: str  # the name plotted
    concurrency: int | None  # closed loop; None for an open-loop point
    request_rate: float | None  # requests/s; None for a closed-loop point
    gpus: int  # 0: not per GPU (the CPU golden model; an OpenAI server run without --gpus)
    requests: int  # finished without error
    failed: int
    output_tokens: int  # of the finished requests
    duration_s: float  # first request sent to last response
    throughput_tok_s: float  # output_tokens / duration_s
    throughput_tok_s_per_gpu: float | None  # None without GPUs
    per_user_tok_s: Stats | None
    ttft_s: Stats | None
    tpot_s: Stats | None
    # Tokens per generation iteration (bonus token included; the context iteration, which yields the first token,
    # is not counted) over all iterations of all requests; 1.0 for AR.
    acceptance_length: float | None
    acceptance_histogram: list[int]  # element i: generation iterations that yielded i + 1 tokens (plan's format)
    max_in_flight: int
    mean_in_flight: float  # time-weighted between the first send and the last response
    in_flight_trace: list[list[float]]  # [seconds, requests in flight] after every send and finish
    per_request: list[RequestEntry]

    def to_json(self) -> dict[str, Any]:
        """The point as results.json holds it."""
        return asdict(self)

    def without_detail(self) -> dict[str, Any]:
        """The point without its per-request records and in-flight trace (what `bench --json` prints)."""
        return {k: v for k, v in self.to_json().items() if k not in ("per_request", "in_flight_trace")}


POINT_KEYS = tuple(f.name for f in fields(BenchPoint))


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default method)."""
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def summary(values: Sequence[float]) -> Stats | None:
    """{p50, p90, p99, mean} of the values; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    p50, p90, p99 = (percentile(ordered, q) for q in PERCENTILES)
    return Stats(p50, p90, p99, mean=sum(ordered) / len(ordered))


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


def _request_entry(record: RequestRecord) -> RequestEntry:
    first = record.response_s[0] - record.sent_s if record.response_s else None
    drafts = record.draft_lens[1:]
    known = [d for d in drafts if d is not None]
    return RequestEntry(
        prompt_index=record.prompt_index,
        input_len=record.input_len,
        output_ids=record.output_ids,
        decoding_iterations=len(record.chunks),
        acceptance=record.chunks[1:],
        draft_lens=known if len(known) == len(drafts) else None,
        ttft_s=first,
        latency_s=None if record.finished_s is None else record.finished_s - record.sent_s,
        response_times_s=[t - record.sent_s for t in record.response_s],
        error=record.error,
    )


def point_from_run(
    trace: RunTrace,
    *,
    mode: DecodingMode,
    engine: str,
    gpus: int = 1,
    concurrency: int | None = None,
    request_rate: float | None = None,
) -> BenchPoint:
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
    return BenchPoint(
        mode=mode,
        engine=engine,
        concurrency=concurrency,
        request_rate=request_rate,
        gpus=gpus,
        requests=len(ok),
        failed=len(trace.records) - len(ok),
        output_tokens=output_tokens,
        duration_s=duration,
        throughput_tok_s=throughput,
        throughput_tok_s_per_gpu=throughput / gpus if gpus else None,
        per_user_tok_s=summary([1.0 / t for t in tpots]),
        ttft_s=summary([r.response_s[0] - r.sent_s for r in ok]),
        tpot_s=summary(tpots),
        acceptance_length=sum(steps) / len(steps) if steps else None,
        acceptance_histogram=histogram,
        max_in_flight=max(n for _, n in trace.in_flight),
        mean_in_flight=_mean_in_flight(trace.in_flight, duration),
        in_flight_trace=[[t, n] for t, n in trace.in_flight],
        per_request=[_request_entry(r) for r in trace.records],
    )


def sweep_fields(point: BenchPoint) -> dict[str, Any]:
    """The Pareto analysis's view of a point: tok/s/GPU (the host's tok/s for a CPU run, `gpus` 0) and both
    tok/s/user definitions of `analysis.sweep`."""
    tpot = point.tpot_s
    concurrency = point.concurrency
    return {
        "gpus": point.gpus,
        "tok_s_gpu": point.throughput_tok_s_per_gpu if point.gpus else point.throughput_tok_s,
        "tok_s_user_tpot": 1.0 / tpot.mean if tpot and tpot.mean > 0 else None,
        "tok_s_user_share": point.throughput_tok_s / concurrency if concurrency else None,
    }


def write_results(
    path: str | Path, points: Sequence[dict[str, Any]], workload: dict[str, Any], provenance: dict[str, Any]
) -> None:
    """`points` as JSON objects: `BenchPoint.to_json()`, or a sweep's records, which extend them."""
    data = {"format": FORMAT, "provenance": provenance, "workload": workload, "points": list(points)}
    Path(path).write_text(strict_json(data) + "\n")


def read_results(path: str | Path) -> dict[str, Any]:
    """A results.json as written: valid JSON, this schema's `format`, a `points` list. The one reader of the file;
    what each user needs of the points it checks itself."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise DFlashTrtError(f"cannot read {path}: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DFlashTrtError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("points"), list):
        raise DFlashTrtError(f"{path} is not a dflash-trt bench results file ({FORMAT})")
    return data


def load_results(path: str | Path) -> list[dict[str, Any]]:
    """The points of a results.json, checked for the keys above."""
    data = read_results(path)
    for i, point in enumerate(data["points"]):
        missing = [k for k in POINT_KEYS if not isinstance(point, dict) or k not in point]
        if missing:
            raise DFlashTrtError(f"{path}: point {i} lacks {', '.join(missing)}")
    return data["points"]
