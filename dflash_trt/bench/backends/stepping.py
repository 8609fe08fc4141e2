"""A backend over any step-wise CPU executor: the executor runs in a worker thread that hands each step's
responses to the event loop, as the GPU executor's own threads do (torch releases the GIL inside its kernels).

Both CPU executors (the golden model's and the emulated engine's) take requests, advance every running request by
one iteration per `step` and answer with that iteration's tokens; this module owns the thread around them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Protocol

from dflash_trt.bench.driver import Backend, BenchRequest, Deliver, Response, threadsafe_deliver
from dflash_trt.decoding_modes import DecodingMode
from dflash_trt.errors import DFlashTrtError


class SteppingExecutor(Protocol):
    def add(self, request_id: int, request: BenchRequest) -> None: ...

    def cancel(self, request_id: int) -> None: ...

    def step(self) -> list[Response]: ...

    def has_work(self) -> bool: ...

    def close(self) -> None: ...


class SteppingBackend(Backend):
    """Serves a fresh executor (from `make_executor`) per `start`, in one worker thread."""

    gpus = 0  # a CPU executor: its throughput is the host's, not a GPU's

    def __init__(self, make_executor: Callable[[], SteppingExecutor], mode: DecodingMode):
        self.make_executor = make_executor
        self.mode = mode
        self.executor: SteppingExecutor | None = None  # the running (or last run) executor
        self._pending: list[tuple[int, BenchRequest]] = []
        self._cancelled: list[int] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._broken: str | None = None  # why the executor thread stopped; later requests fail with it at once
        self._send: Deliver | None = None
        self._live: set[int] = set()  # requests handed to the executor and not finished or cancelled

    async def start(self, deliver: Deliver) -> None:
        executor = self.executor = self.make_executor()
        self._stopping = False
        self._broken = None
        self._live = set()
        send = self._send = threadsafe_deliver(deliver)
        self._thread = threading.Thread(target=self._serve, args=(executor, send), name="cpu-executor", daemon=True)
        self._thread.start()

    def submit(self, request_id: int, request: BenchRequest) -> None:
        with self._wake:
            if self._broken is not None and self._send is not None:
                self._send([Response(request_id, [], True, self._broken)])
                return
            self._pending.append((request_id, request))
            self._wake.notify()

    def cancel(self, request_id: int) -> None:
        """Stop decoding `request_id` before its next step; it gets no further responses."""
        with self._wake:
            self._cancelled.append(request_id)
            self._wake.notify()

    def _serve(self, executor: SteppingExecutor, send: Deliver) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._pending or self._cancelled or executor.has_work()):
                    self._wake.wait()
                if self._stopping:
                    executor.close()
                    return
                pending, self._pending = self._pending, []
                cancelled, self._cancelled = self._cancelled, []
            failed = []
            for request_id, request in pending:
                try:
                    executor.add(request_id, request)
                except DFlashTrtError as exc:
                    failed.append(Response(request_id, [], True, str(exc)))
                else:
                    self._live.add(request_id)
            for request_id in cancelled:
                executor.cancel(request_id)
                self._live.discard(request_id)
            try:
                responses = executor.step() if executor.has_work() else []
            except Exception as exc:  # the model failed (out of memory, ...): end every request, never hang the run
                with self._wake:
                    self._broken = reason = f"the executor failed: {exc}"
                    late = [request_id for request_id, _ in self._pending]
                    self._pending = []
                abandoned = sorted(self._live) + late
                self._live = set()
                send(failed + [Response(request_id, [], True, reason) for request_id in abandoned])
                executor.close()
                return
            self._live.difference_update(r.request_id for r in responses if r.final)
            if failed or responses:
                send(failed + responses)

    async def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
