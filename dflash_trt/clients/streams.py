"""Executors that stream each request in its own asyncio task (the Triton gRPC / HTTP and OpenAI clients).

Cancelling a request cancels its task, which closes its stream or connection: the servers cancel a request whose
client went away. Stopping cancels every task still running and waits for them. A task that fails in a way its
`_stream` did not foresee still answers its request (a final error response), so no request waits for ever.
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod

from dflash_trt.executors.contract import Deliver, Executor, Request, failed


class StreamPerRequest(Executor):
    """Keeps `tasks` (request id -> the task streaming it); subclasses implement `_stream` and set `deliver` when
    they start."""

    def __init__(self) -> None:
        self.tasks: dict[int, asyncio.Task] = {}
        self.deliver: Deliver = lambda batch: None

    @abstractmethod
    async def _stream(self, request_id: int, request: Request) -> None:
        """Send one request and deliver its responses until the final one."""

    async def _answered(self, request_id: int, request: Request) -> None:
        try:
            await self._stream(request_id, request)
        except Exception as exc:  # whatever went wrong, the request gets its final answer
            self.deliver([failed(request_id, f"the request failed: {type(exc).__name__}: {exc}")])

    def submit(self, request_id: int, request: Request) -> None:
        if request.stop_words:  # only the CPU-served tensorrt_llm model reads them; no client here sends them
            self.deliver([failed(request_id, "stop words (token ids) are not sent to a server; stop at end ids")])
            return
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
