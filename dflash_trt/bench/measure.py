"""One benchmark point: warm up, run the load, turn the trace into a results point (for `bench` and `sweep`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from tqdm import tqdm

from dflash_trt.bench.driver import run_load
from dflash_trt.bench.results import BenchPoint, point_from_run
from dflash_trt.bench.targets import ExecutorFactory
from dflash_trt.bench.workload import Workload
from dflash_trt.executors.contract import FollowerRank

DEFAULT_OPEN_LOOP_BATCH = 16
# A point's progress bar appears once it has run this long: a refusal at start stays one line, a quick point quiet.
PROGRESS_DELAY_S = 1.0


def request_bar(total: int, description: str, enabled: bool = True) -> tqdm:
    """The bar of one point's requests (`measure_point`'s `on_request_done` is its `update`); drawn only on a
    terminal (tqdm's `disable=None`), so a log gets no carriage-return-joined lines."""
    return tqdm(
        total=total,
        desc=description,
        unit="req",
        leave=False,
        disable=None if enabled else True,
        delay=PROGRESS_DELAY_S,
    )


def measure_point(
    factory: ExecutorFactory,
    workload: Workload,
    engine: str,
    *,
    concurrency: int | None = None,
    request_rate: float | None = None,
    warmup: int = 0,
    seed: int = 0,
    timeout_s: float | None = None,
    max_in_flight: int | None = None,
    on_request_done: Callable[[], object] | None = None,
) -> BenchPoint:
    """Each point gets a fresh executor, so no point inherits another's queue or cache state. `on_request_done`
    hears each measured (not warm-up) request finish.

    On a follower MPI rank the warm-up's and the run's executors are still built (in step with rank 0), then
    `FollowerRank` is raised."""
    in_flight = concurrency or max_in_flight or DEFAULT_OPEN_LOOP_BATCH
    if warmup:
        with contextlib.suppress(FollowerRank):
            warm = workload.requests[:warmup]
            asyncio.run(run_load(factory(in_flight), warm, concurrency=in_flight, timeout_s=timeout_s))
    executor = factory(in_flight)
    trace = asyncio.run(
        run_load(
            executor,
            workload.requests,
            prompt_indices=workload.prompt_indices,
            concurrency=concurrency,
            request_rate=request_rate,
            seed=seed,
            timeout_s=timeout_s,
            on_request_done=on_request_done,
        )
    )
    return point_from_run(
        trace, mode=executor.mode, engine=engine, gpus=executor.gpus, concurrency=concurrency, request_rate=request_rate
    )
