"""The load generator's own overhead: executor responses per second it sustains, on one core.

An instant executor answers every in-flight request once per "iteration" (4 tokens per response, like a DFlash step)
and starts the next iteration as soon as the driver has taken the last one, so the only work left is the driver's.
512 users in a closed loop, 64 responses per request. Rates are per CPU-second of this process (pinned to one
core), so other work on the machine does not distort them. Two ratios (`make bench` protocol):

- `driver_vs_bare_loop`: the driver's responses/s over the same event loop delivering the same batches to a
  callback that only counts them (how much of the loop's capacity the driver's bookkeeping costs);
- `driver_vs_512_users_at_10ms`: the driver's responses/s over what a GPU serving 512 users at one iteration per
  10 ms asks for (51,200 responses/s). Above 1, the driver is never what limits such a GPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from dflash_trt.bench.driver import run_load
from dflash_trt.executors.contract import Executor, Request, Response

USERS = 512
RESPONSES_PER_REQUEST = 64
REQUESTS = USERS * 4
TOKENS = [1, 2, 3, 4]
NEEDED = USERS / 0.010


class InstantExecutor(Executor):
    def __init__(self):
        self.active: dict[int, int] = {}
        self.scheduled = False

    async def start(self, deliver):
        self.deliver = deliver
        self.loop = asyncio.get_running_loop()

    def _schedule(self):
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._iteration)

    def submit(self, request_id, request):
        self.active[request_id] = RESPONSES_PER_REQUEST
        self._schedule()

    def _iteration(self):
        self.scheduled = False
        batch = []
        for request_id, left in list(self.active.items()):
            final = left == 1
            batch.append(Response(request_id=request_id, tokens=TOKENS, final=final))
            if final:
                del self.active[request_id]
            else:
                self.active[request_id] = left - 1
        self.deliver(batch)
        if self.active:
            self._schedule()

    def cancel(self, request_id):
        self.active.pop(request_id, None)

    async def stop(self):
        pass


def driver_rate() -> float:
    requests = [
        Request(input_ids=[1, 2, 3], max_new_tokens=RESPONSES_PER_REQUEST * len(TOKENS)) for _ in range(REQUESTS)
    ]
    started = time.process_time()
    trace = asyncio.run(run_load(InstantExecutor(), requests, concurrency=USERS))
    elapsed = time.process_time() - started
    responses = sum(len(r.chunks) for r in trace.records)
    assert responses == REQUESTS * RESPONSES_PER_REQUEST
    return responses / elapsed


def bare_rate() -> float:
    """The same batches from the same executor, delivered to a callback that only counts and refills."""

    async def main() -> float:
        executor = InstantExecutor()
        done = asyncio.Event()
        state = {"responses": 0, "sent": 0, "finished": 0}

        def deliver(batch):
            state["responses"] += len(batch)
            for response in batch:
                if response.final:
                    state["finished"] += 1
                    if state["sent"] < REQUESTS:
                        executor.submit(state["sent"], None)
                        state["sent"] += 1
            if state["finished"] == REQUESTS:
                done.set()

        await executor.start(deliver)
        started = time.process_time()
        for _ in range(USERS):
            executor.submit(state["sent"], None)
            state["sent"] += 1
        await done.wait()
        return state["responses"] / (time.process_time() - started)

    return asyncio.run(main())


def main() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    driver = max(driver_rate() for _ in range(3))
    bare = max(bare_rate() for _ in range(3))
    print(
        json.dumps(
            {
                "name": "driver",
                "ratios": {"driver_vs_bare_loop": driver / bare, "driver_vs_512_users_at_10ms": driver / NEEDED},
                "details": {
                    "driver_responses_per_s": round(driver),
                    "bare_loop_responses_per_s": round(bare),
                    "needed_responses_per_s": NEEDED,
                    "users": USERS,
                    "cores": 1,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
