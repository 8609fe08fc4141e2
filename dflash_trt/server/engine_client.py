"""The bridge between HTTP requests and one executor: admission, a bounded queue, per-request streams.

Every executor batches in flight (the TensorRT-LLM executor, Triton, the emulated engine), so requests from all
HTTP connections go to the one executor as they come; this module hands each request's per-iteration responses to
the coroutine serving it. At most `max_batch_size` requests are in the executor at once, so it never queues and a
cancelled waiting request costs it nothing; up to `max_queue` more wait here, and a request beyond that is refused
(the app answers 503). Executors deliver on the event loop's thread, so no lock is needed.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dflash_trt.executors.contract import Executor, Request, Response
from dflash_trt.server.metrics import Metrics


class QueueFull(Exception):
    """Every batch slot and queue place is taken."""


class ExecutorError(Exception):
    """The executor answered a request with an error."""


@dataclass(eq=False)
class _Stream:
    request: Request
    chunks: deque[Response] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    running: bool = False
    done: bool = False


class EngineClient:
    def __init__(self, executor: Executor, max_batch_size: int, max_queue: int, metrics: Metrics):
        self.executor = executor
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.metrics = metrics
        self.streams: dict[int, _Stream] = {}
        self.waiting: deque[int] = deque()
        self.running = 0
        self.ids = itertools.count()

    async def start(self) -> None:
        await self.executor.start(self._deliver)

    async def stop(self) -> None:
        await self.executor.stop()

    def open(self, request: Request) -> int:
        """Admit a request (to the executor, or to the queue) and return its id; QueueFull when there is no room."""
        if self.running >= self.max_batch_size and len(self.waiting) >= self.max_queue:
            raise QueueFull
        request_id = next(self.ids)
        self.streams[request_id] = _Stream(request)
        if self.running < self.max_batch_size:
            self._submit(request_id)
        else:
            self.waiting.append(request_id)
        self._gauge()
        return request_id

    async def responses(self, request_id: int) -> AsyncIterator[list[int]]:
        """The tokens of each iteration of `request_id` until its final one; ExecutorError on an executor error."""
        stream = self.streams[request_id]
        while True:
            await stream.ready.wait()
            stream.ready.clear()
            while stream.chunks:
                response = stream.chunks.popleft()
                if response.error is not None:
                    raise ExecutorError(response.error)
                yield response.tokens
                if response.final:
                    return

    def close(self, request_id: int) -> None:
        """Forget `request_id`: cancelled in the executor when it is still running there (a client went away,
        a stop string ended it), dropped from the queue when it waits."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return
        if stream.running and not stream.done:
            self.executor.cancel(request_id)
        if stream.running:
            self.running -= 1
            self._admit()
        else:
            self.waiting.remove(request_id)
        self._gauge()

    def _submit(self, request_id: int) -> None:
        stream = self.streams[request_id]
        stream.running = True
        self.running += 1
        self.executor.submit(request_id, stream.request)

    def _admit(self) -> None:
        while self.waiting and self.running < self.max_batch_size:
            self._submit(self.waiting.popleft())

    def _gauge(self) -> None:
        self.metrics.running.set(self.running)
        self.metrics.waiting.set(len(self.waiting))

    def _deliver(self, batch: list[Response]) -> None:
        streams = self.streams
        for response in batch:
            stream = streams.get(response.request_id)
            if stream is None or stream.done:
                continue  # cancelled: its last responses are dropped
            if response.final or response.error is not None:
                stream.done = True
            stream.chunks.append(response)
            stream.ready.set()
