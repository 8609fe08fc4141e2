"""Backends that stream each request in its own asyncio task (the Triton gRPC / HTTP and OpenAI clients).

Cancelling a request cancels its task, which closes its stream or connection: the servers cancel a request whose
client went away. Stopping cancels every task still running and waits for them. A task that fails in a way its
`_stream` did not foresee still answers its request (a final error response), so no request waits for ever.
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod

from dflash_trt.bench.driver import Backend, BenchRequest, Deliver, Response


class StreamPerRequest(Backend):
    """Keeps `tasks` (request id -> the task streaming it); subclasses implement `_stream` and set `deliver`."""

    deliver: Deliver

    def __init__(self) -> None:
        self.tasks: dict[int, asyncio.Task] = {}

    @abstractmethod
    async def _stream(self, request_id: int, request: BenchRequest) -> None:
        """Send one request and deliver its responses until the final one."""

    async def _answered(self, request_id: int, request: BenchRequest) -> None:
        try:
            await self._stream(request_id, request)
        except Exception as exc:  # whatever went wrong, the request gets its final answer
            self.deliver([Response(request_id, [], True, f"the request failed: {type(exc).__name__}: {exc}")])

    def submit(self, request_id: int, request: BenchRequest) -> None:
        task = asyncio.get_running_loop().create_task(self._answered(request_id, request))
        self.tasks[request_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(request_id, None))

    def cancel(self, request_id: int) -> None:
        task = self.tasks.get(request_id)
        if task is not None:
            task.cancel()

    async def _cancel_all(self) -> None:
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
