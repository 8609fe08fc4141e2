"""One worker thread that steps a CPU stepper, shared by every in-process CPU executor and the CPU-served Triton model.

A stepper (the golden model's, the emulated engine's) takes requests, advances every running request by one
iteration per `step` and answers with that iteration's tokens; it is not thread-safe. The worker owns the thread
around it, as the GPU executor owns its own threads (torch releases the GIL inside its kernels): requests and
cancellations arrive from any thread and join between steps, and every step's responses go to `send` on the
worker's thread. A request the stepper refuses, or whose admission raises, fails alone; a step that raises fails
the requests it held and the worker goes on with the next ones.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from dflash_trt.decoding_modes import DecodingMode
from dflash_trt.executors.contract import Deliver, Executor, Request, Response, failed, threadsafe_deliver


class Stepper(Protocol):
    def add(self, request_id: int, request: Request) -> object:
        """Queue a request (DFlashTrtError: refused, naming why)."""

    def cancel(self, request_id: int) -> None: ...

    def step(self) -> list[Response]: ...

    def has_work(self) -> bool: ...

    def close(self) -> None: ...


def _no_admission_hook(request_id: int) -> None:
    return None


def _nobody_left() -> Iterable[int]:
    return ()


class Worker:
    """Steps `stepper` in a thread of its own, named `name`, from construction until `stop`.

    `admitted` hears each request the stepper took; `gone` names, before each step, requests whose clients left
    (they are cancelled without a response)."""

    def __init__(
        self,
        stepper: Stepper,
        send: Deliver,
        *,
        name: str,
        admitted: Callable[[int], None] = _no_admission_hook,
        gone: Callable[[], Iterable[int]] = _nobody_left,
    ):
        self.stepper = stepper
        self.send = send
        self.admitted = admitted
        self.gone = gone
        self._pending: list[tuple[int, Request]] = []
        self._cancelled: list[int] = []
        self._live: set[int] = set()  # requests the stepper holds, not yet finished or cancelled
        self._wake = threading.Condition()
        self._stopping: str | None = None  # the error every request still held gets on stop
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, request_id: int, request: Request) -> None:
        with self._wake:
            self._pending.append((request_id, request))
            self._wake.notify()

    def cancel(self, request_id: int) -> None:
        """Stop decoding `request_id` before the next step; it gets no further responses."""
        with self._wake:
            self._cancelled.append(request_id)
            self._wake.notify()

    def stop(self, reason: str) -> None:
        """Answer every request still queued or running with `reason`, close the stepper and end the thread."""
        with self._wake:
            self._stopping = reason
            self._wake.notify()
        self._thread.join()

    def _serve(self) -> None:
        stepper = self.stepper
        while True:
            with self._wake:
                while not (self._stopping or self._pending or self._cancelled or stepper.has_work()):
                    self._wake.wait()
                pending, self._pending = self._pending, []
                cancelled, self._cancelled = self._cancelled, []
                stopping = self._stopping
            if stopping is not None:
                held = sorted(self._live) + [request_id for request_id, _ in pending]
                self._send([failed(request_id, stopping) for request_id in held])
                stepper.close()
                return
            refused = [self._admit(request_id, request) for request_id, request in pending]
            for request_id in [*cancelled, *self.gone()]:
                if request_id in self._live:
                    stepper.cancel(request_id)
                    self._live.discard(request_id)
            self._send([r for r in refused if r is not None] + self._step())

    def _admit(self, request_id: int, request: Request) -> Response | None:
        try:
            self.stepper.add(request_id, request)
        except Exception as exc:  # a refused (or malformed) request fails alone
            return failed(request_id, str(exc))
        self._live.add(request_id)
        self.admitted(request_id)
        return None

    def _step(self) -> list[Response]:
        if not self.stepper.has_work():
            return []
        try:
            responses = self.stepper.step()
        except Exception as exc:  # a failed step fails the requests it held, never the worker
            reason = f"the executor failed: {type(exc).__name__}: {exc}"
            held, self._live = sorted(self._live), set()
            for request_id in held:
                self.stepper.cancel(request_id)
            return [failed(request_id, reason) for request_id in held]
        self._live.difference_update(r.request_id for r in responses if r.final)
        return responses

    def _send(self, responses: list[Response]) -> None:
        if responses:
            self.send(responses)


class WorkerExecutor(Executor):
    """An executor over a fresh stepper (from `make_stepper`) per `start`, stepped by one `Worker`."""

    gpus = 0  # a CPU executor: its throughput is the host's, not a GPU's

    def __init__(self, make_stepper: Callable[[], Stepper], mode: DecodingMode):
        self.make_stepper = make_stepper
        self.mode = mode
        self.stepper: Stepper | None = None  # the running (or last run) stepper
        self._worker: Worker | None = None

    async def start(self, deliver: Deliver) -> None:
        self.stepper = self.make_stepper()
        self._worker = Worker(self.stepper, threadsafe_deliver(deliver), name="cpu-executor")

    def submit(self, request_id: int, request: Request) -> None:
        assert self._worker is not None, "submit before start"
        self._worker.submit(request_id, request)

    def cancel(self, request_id: int) -> None:
        if self._worker is not None:
            self._worker.cancel(request_id)

    async def stop(self) -> None:
        if self._worker is not None:
            await asyncio.to_thread(self._worker.stop, "the executor stopped")
            self._worker = None
