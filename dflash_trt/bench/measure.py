"""One benchmark point: warm up, run the load, turn the trace into a results point (for `bench` and `sweep`)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from dflash_trt.bench.driver import FollowerRank, run_load
from dflash_trt.bench.results import point_from_run
from dflash_trt.bench.targets import BackendFactory
from dflash_trt.bench.workload import Workload

DEFAULT_OPEN_LOOP_BATCH = 16


def measure_point(
    factory: BackendFactory,
    workload: Workload,
    engine: str,
    *,
    concurrency: int | None = None,
    request_rate: float | None = None,
    warmup: int = 0,
    seed: int = 0,
    timeout_s: float | None = None,
    max_in_flight: int | None = None,
) -> dict[str, Any]:
    """Each point gets a fresh backend, so no point inherits another's queue or cache state.

    On a follower MPI rank the warm-up's and the run's executors are still built (in step with rank 0), then
    `FollowerRank` is raised."""
    in_flight = concurrency or max_in_flight or DEFAULT_OPEN_LOOP_BATCH
    if warmup:
        with contextlib.suppress(FollowerRank):
            asyncio.run(
                run_load(factory(in_flight), workload.requests[:warmup], concurrency=in_flight, timeout_s=timeout_s)
            )
    backend = factory(in_flight)
    trace = asyncio.run(
        run_load(
            backend,
            workload.requests,
            concurrency=concurrency,
            request_rate=request_rate,
            seed=seed,
            timeout_s=timeout_s,
        )
    )
    return point_from_run(
        trace, mode=backend.mode, engine=engine, gpus=backend.gpus, concurrency=concurrency, request_rate=request_rate
    )
