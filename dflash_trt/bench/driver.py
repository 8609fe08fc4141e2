"""The load generator: closed-loop concurrency or open-loop Poisson arrivals over any executor.

An executor (`dflash_trt.executors.contract`) takes requests and hands back responses in batches, on the event
loop's thread: one response per decoding iteration of one request, carrying the tokens that iteration produced.
The driver stamps each batch with its arrival time, so a request's record holds the time of every token, how many
tokens each iteration yielded (the acceptance source), how many drafts it verified (where the executor says) and the
number of iterations.

The driver does as little as possible per response (a list append and a counter), because at 512 users a GPU
produces tens of thousands of responses per second; `perf/bench_driver.py` measures what it sustains.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import Executor, Request, Response


@dataclass(slots=True)
class RequestRecord:
    """Everything the driver saw of one request; times are seconds since the run started."""

    request_id: int
    prompt_index: int
    input_len: int
    sent_s: float
    response_s: list[float] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    draft_lens: list[int | None] = field(default_factory=list)  # per chunk: the drafts its iteration verified
    output_ids: list[int] = field(default_factory=list)
    finished_s: float | None = None
    error: str | None = None


@dataclass
class RunTrace:
    """One measured run: every request's record and the in-flight count after every submit and finish."""

    records: list[RequestRecord]
    in_flight: list[tuple[float, int]]
    duration_s: float


class _Run:
    def __init__(self, executor: Executor, requests: Sequence[Request], prompt_indices: Sequence[int]):
        self.executor = executor
        self.requests = requests
        self.prompt_indices = prompt_indices
        self.records: list[RequestRecord] = []
        self.in_flight: list[tuple[float, int]] = []
        self.running = 0
        self.done = 0
        self.next_index = 0
        self.t0 = 0.0
        self.all_done = asyncio.Event()
        self.on_finish: Callable[[], None] = lambda: None
        self.on_done: Callable[[], object] = lambda: None

    def send_next(self) -> None:
        request = self.requests[self.next_index]
        self.next_index += 1
        now = time.perf_counter() - self.t0
        request_id = len(self.records)
        record = RequestRecord(
            request_id=request_id,
            prompt_index=self.prompt_indices[request_id],
            input_len=len(request.input_ids),
            sent_s=now,
        )
        self.records.append(record)
        self.running += 1
        self.in_flight.append((now, self.running))
        self.executor.submit(request_id, request)

    def deliver(self, batch: list[Response]) -> None:
        now = time.perf_counter() - self.t0
        records = self.records
        for response in batch:
            record = records[response.request_id]
            if record.finished_s is not None:
                continue
            tokens = response.tokens
            if tokens:
                record.response_s.append(now)
                record.chunks.append(len(tokens))
                record.draft_lens.append(response.draft_len)
                record.output_ids += tokens
            if response.final or response.error is not None:
                record.error = response.error
                record.finished_s = now
                self.running -= 1
                self.done += 1
                self.in_flight.append((now, self.running))
                self.on_done()
                self.on_finish()
        if self.done == len(self.requests):
            self.all_done.set()


async def run_load(
    executor: Executor,
    requests: Sequence[Request],
    *,
    prompt_indices: Sequence[int] | None = None,
    concurrency: int | None = None,
    request_rate: float | None = None,
    seed: int = 0,
    timeout_s: float | None = None,
    on_request_done: Callable[[], object] | None = None,
) -> RunTrace:
    """Send every request, either `concurrency` at a time (a user sends its next request when the previous one
    finishes) or at Poisson arrivals of `request_rate` per second, and wait for all of them to finish. Request i
    asks for prompt `prompt_indices[i]` of the workload (default i). `on_request_done` (a progress bar) hears each
    finished request, on the event loop's thread."""
    if (concurrency is None) == (request_rate is None):
        raise DFlashTrtError("give exactly one of concurrency and request_rate")
    if concurrency is not None and concurrency < 1:
        raise DFlashTrtError(f"concurrency must be >= 1, got {concurrency}")
    if request_rate is not None and not request_rate > 0:
        raise DFlashTrtError(f"request rate must be > 0, got {request_rate}")
    if not requests:
        raise DFlashTrtError("no requests to send")
    run = _Run(executor, requests, range(len(requests)) if prompt_indices is None else prompt_indices)
    run.on_done = on_request_done or (lambda: None)
    await executor.start(run.deliver)
    arrivals = None
    try:
        run.t0 = time.perf_counter()
        if concurrency is not None:

            def refill() -> None:
                if run.next_index < len(requests):
                    run.send_next()

            run.on_finish = refill
            for _ in range(min(concurrency, len(requests))):
                run.send_next()
        elif request_rate is not None:
            arrivals = asyncio.create_task(_poisson_arrivals(run, request_rate, seed))
        await asyncio.wait_for(run.all_done.wait(), timeout_s)
    except asyncio.TimeoutError:
        raise DFlashTrtError(
            f"the run did not finish within {timeout_s:g} s ({run.done} of {len(requests)} requests done)"
        ) from None
    finally:
        if arrivals is not None:
            arrivals.cancel()
        await executor.stop()
    duration = max(r.finished_s for r in run.records if r.finished_s is not None)
    return RunTrace(run.records, run.in_flight, duration)


async def _poisson_arrivals(run: _Run, rate: float, seed: int) -> None:
    rng = random.Random(seed)
    due = 0.0
    while run.next_index < len(run.requests):
        due += rng.expovariate(rate)
        delay = due - (time.perf_counter() - run.t0)
        if delay > 0:
            await asyncio.sleep(delay)
        run.send_next()
