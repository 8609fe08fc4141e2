"""The load generator and the results schema, against a scripted executor whose every response is known.

The executor answers each request with a fixed split of its tokens, one chunk per "iteration" every `step_s`,
so in-flight counts, timings and acceptance statistics can be computed by hand and compared.
"""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from dflash_trt.bench.driver import run_load
from dflash_trt.bench.provenance import collect
from dflash_trt.bench.results import (
    POINT_KEYS,
    load_results,
    point_from_run,
    summary,
    sweep_fields,
    write_results,
)
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import Executor, Request, Response, failed


class ScriptedExecutor(Executor):
    """Request k gets chunks `splits[k % len(splits)]`, one per `step_s`; the prompt [99] fails."""

    def __init__(self, splits, step_s=0.002):
        self.splits = splits
        self.step_s = step_s
        self.tasks = []

    async def start(self, deliver):
        self.deliver = deliver

    def submit(self, request_id, request):
        self.tasks.append(asyncio.get_running_loop().create_task(self._serve(request_id, request)))

    async def _serve(self, request_id, request):
        if request.input_ids == [99]:
            self.deliver([failed(request_id, "prompt too long")])
            return
        chunks = self.splits[request_id % len(self.splits)]
        token = 0
        for i, n in enumerate(chunks):
            await asyncio.sleep(self.step_s)
            tokens = list(range(token, token + n))
            self.deliver([Response(request_id=request_id, tokens=tokens, final=i == len(chunks) - 1)])
            token += n

    def cancel(self, request_id):
        raise AssertionError("the driver never cancels")

    async def stop(self):
        await asyncio.gather(*self.tasks)


def _requests(n, prompt_len=4):
    return [Request(input_ids=[1] * prompt_len, max_new_tokens=16) for _ in range(n)]


def test_closed_loop_holds_exactly_n_in_flight_and_records_every_response():
    splits = [[1, 3, 2, 4], [1, 1, 1], [1, 5]]
    trace = asyncio.run(run_load(ScriptedExecutor(splits), _requests(9), concurrency=3))
    counts = [n for _, n in trace.in_flight]
    assert max(counts) == 3
    # Until the last requests drain, every finish is followed at once by the next send: back to 3.
    sends = [i for i in range(1, len(counts)) if counts[i] > counts[i - 1]]
    assert [counts[i] for i in sends][2:] == [3] * (len(sends) - 2)
    assert len(trace.records) == 9
    for record in trace.records:
        chunks = splits[record.request_id % 3]
        assert record.chunks == chunks and record.output_ids == list(range(sum(chunks)))
        assert len(record.response_s) == len(chunks) and record.finished_s == record.response_s[-1]
        assert record.response_s == sorted(record.response_s) and record.sent_s <= record.response_s[0]


def test_progress_hears_every_finished_request_once():
    finished = []
    trace = asyncio.run(
        run_load(
            ScriptedExecutor([[1, 3, 2, 4], [1, 1, 1], [1, 5]]),
            _requests(5),
            concurrency=2,
            on_request_done=lambda: finished.append(1),
        )
    )
    assert len(finished) == 5 == len(trace.records)
    cpu = point_from_run(trace, mode="dflash", engine="dflash", gpus=0, concurrency=2)
    assert cpu.gpus == 0 and cpu.throughput_tok_s_per_gpu is None  # no GPU to divide by


def test_point_statistics_match_hand_computed_values():
    splits = [[1, 3, 2, 4], [1, 1, 1], [1, 5]]
    trace = asyncio.run(run_load(ScriptedExecutor(splits), _requests(6), concurrency=2))
    point = point_from_run(trace, mode="dflash", engine="dflash", gpus=2, concurrency=2)
    # results.json's point keys, in the order the file has always had them.
    assert list(point.to_json()) == list(POINT_KEYS) == [
        "mode", "engine", "concurrency", "request_rate", "gpus", "requests", "failed", "output_tokens", "duration_s",
        "throughput_tok_s", "throughput_tok_s_per_gpu", "per_user_tok_s", "ttft_s", "tpot_s", "acceptance_length",
        "acceptance_histogram", "max_in_flight", "mean_in_flight", "in_flight_trace", "per_request",
    ]  # fmt: skip
    assert list(point.to_json()["tpot_s"]) == ["p50", "p90", "p99", "mean"]
    tokens = sum(len(r.output_ids) for r in trace.records)
    assert point.output_tokens == tokens == 2 * (10 + 3 + 6)
    assert point.duration_s == max(r.finished_s for r in trace.records)
    assert point.throughput_tok_s == pytest.approx(tokens / point.duration_s)
    assert point.throughput_tok_s_per_gpu == pytest.approx(point.throughput_tok_s / 2)
    # Generation iterations (context chunk excluded): 3,2,4 | 1,1 | 5, twice.
    steps = [3, 2, 4, 1, 1, 5] * 2
    assert point.acceptance_length == pytest.approx(sum(steps) / len(steps))
    assert point.acceptance_histogram == [4, 2, 2, 2, 2]
    ttfts = [r.response_s[0] - r.sent_s for r in trace.records]
    assert point.ttft_s.p90 == pytest.approx(np.percentile(ttfts, 90))
    tpots = [(r.response_s[-1] - r.response_s[0]) / (len(r.output_ids) - 1) for r in trace.records]
    assert point.tpot_s.p50 == pytest.approx(np.percentile(tpots, 50))
    assert point.per_user_tok_s.p99 == pytest.approx(np.percentile([1 / t for t in tpots], 99))
    assert point.max_in_flight == 2 and 1.0 < point.mean_in_flight <= 2.0
    entry = point.per_request[1]
    assert entry.acceptance == [1, 1] and entry.decoding_iterations == 3 and entry.output_ids == [0, 1, 2]
    assert entry.draft_lens is None  # the scripted executor, like an engine, does not say how many it verified
    fields = sweep_fields(point)
    assert fields["tok_s_user_tpot"] == pytest.approx(1 / point.tpot_s.mean)
    assert fields["tok_s_user_share"] == pytest.approx(point.throughput_tok_s / 2)


def test_failed_requests_are_counted_not_measured():
    requests = _requests(3) + [Request(input_ids=[99], max_new_tokens=4)]
    trace = asyncio.run(run_load(ScriptedExecutor([[2, 2]]), requests, concurrency=4))
    point = point_from_run(trace, mode="ar", engine="ar", concurrency=4)
    assert point.requests == 3 and point.failed == 1 and point.output_tokens == 12
    assert point.per_request[3].error == "prompt too long"


def test_open_loop_sends_at_poisson_times_independent_of_finishes():
    trace = asyncio.run(run_load(ScriptedExecutor([[1] * 20], step_s=0.01), _requests(12), request_rate=200.0, seed=3))
    sends = [r.sent_s for r in trace.records]
    # Each request runs 0.2 s while arrivals come every ~5 ms: many overlap, unlike a closed loop of 1.
    assert max(n for _, n in trace.in_flight) >= 6
    gaps = np.diff(sends)
    assert np.all(gaps >= 0) and 0.001 < gaps.mean() < 0.05


def test_bad_load_settings_are_refused():
    with pytest.raises(DFlashTrtError, match="exactly one"):
        asyncio.run(run_load(ScriptedExecutor([[1]]), _requests(1), concurrency=1, request_rate=1.0))
    with pytest.raises(DFlashTrtError, match="no requests"):
        asyncio.run(run_load(ScriptedExecutor([[1]]), [], concurrency=1))


def test_a_run_that_never_finishes_times_out_with_a_clear_error():
    with pytest.raises(DFlashTrtError, match="did not finish within"):
        asyncio.run(run_load(ScriptedExecutor([[1] * 10], step_s=0.05), _requests(1), concurrency=1, timeout_s=0.1))


def test_summary_and_results_file_round_trip(tmp_path):
    assert summary([]) is None
    values = [3.0, 1.0, 2.0, 10.0]
    s = summary(values)
    assert s is not None
    assert (s.p50, s.p90, s.p99, s.mean) == pytest.approx([*np.percentile(values, [50, 90, 99]), 4.0])
    trace = asyncio.run(run_load(ScriptedExecutor([[1, 2]]), _requests(2), concurrency=1))
    point = point_from_run(trace, mode="dflash", engine="dflash", concurrency=1)
    origin = collect("golden", "ckpt")
    write_results(tmp_path / "results.json", [point.to_json()], {"kind": "test", "limit": math.inf}, origin)
    assert load_results(tmp_path / "results.json") == json.loads(json.dumps([point.to_json()]))
    # Strict JSON: a parser that rejects Infinity / NaN reads it; an unbounded number is written as null.
    strict = json.loads((tmp_path / "results.json").read_text(), parse_constant=_refuse_constant)
    assert strict["workload"]["limit"] is None and strict["provenance"] == origin
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"format": "dflash-trt-bench/1", "points": [{"mode": "ar"}]}))
    with pytest.raises(DFlashTrtError, match="lacks"):
        load_results(broken)


def _refuse_constant(name: str):
    raise ValueError(f"not strict JSON: {name}")


def test_report_without_an_ar_baseline_has_the_plot_and_the_points(tmp_path):
    from dflash_trt.commands.bench import write_outputs

    points = [
        point_from_run(
            asyncio.run(run_load(ScriptedExecutor([[1, 3, 2]]), _requests(4), concurrency=c)),
            mode="dflash",
            engine="dflash",
            concurrency=c,
        )
        for c in (1, 2)
    ]
    summary = write_outputs(tmp_path / "out", points, {"kind": "test"}, collect("golden", "ckpt"), overwrite=False)
    assert summary["baseline"] is None and summary["speedup_vs_ar"] == []
    assert [p["concurrency"] for p in summary["frontiers"]["dflash"]] != []
    html = (tmp_path / "out" / "report.html").read_text()
    assert "Measured points" in html and "<svg" in html
    assert len(load_results(tmp_path / "out" / "results.json")) == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind
