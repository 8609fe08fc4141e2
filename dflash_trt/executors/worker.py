"""One worker thread that steps a CPU stepper, shared by every in-process CPU executor and the CPU-served Triton model.

A stepper (the golden model's, the emulated engine's) takes requests, advances every running request by one
iteration per `step` and answers with that iteration's tokens; it is not thread-safe. The worker owns the thread
around it, as the GPU executor owns its own threads (torch releases the GIL inside its kernels): requests and
cancellations arrive from any thread and join between steps, and every step's responses go to `send` on the
worker's thread.

A request the stepper refuses, or whose admission raises, fails alone; a request the engine fails on fails alone too
(the emulated stepper isolates it: its response carries the error). When `step` itself raises, every request the
stepper held fails with the cause. Without `replace` the worker goes on with the same stepper (the Triton model);
with it, the stepper's state is unknown, so a fresh one takes over: the worker is broken (`health` says why) when
BROKEN_AFTER steppers in a row fail before any of their steps works, or a fresh one cannot be built; it then tries a
fresh stepper every RETRY_S, refusing requests at once while it has none, and is healthy again once a step works.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from dflash_trt.decoding_modes import DecodingMode
from dflash_trt.executors.contract import Deliver, Executor, Request, Response, failed, threadsafe_deliver

BROKEN_AFTER = 2  # stepper failures in a row (no step working in between) that mark the worker broken
RETRY_S = 5.0  # how long a worker without a stepper waits before building a fresh one


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


def executor_failure(exc: Exception) -> str:
    return f"the executor failed: {exc}"


class Worker:
    """Steps `stepper` in a thread of its own, named `name`, from construction until `stop`.

    `admitted` hears each request the stepper took; `gone` names, before each step, requests whose clients left
    (they are cancelled without a response); `failure` words the error of a step that raised; `replace` (when given)
    builds the stepper that takes over from one whose step raised."""

    def __init__(
        self,
        stepper: Stepper,
        send: Deliver,
        *,
        name: str,
        admitted: Callable[[int], None] = _no_admission_hook,
        gone: Callable[[], Iterable[int]] = _nobody_left,
        failure: Callable[[Exception], str] = executor_failure,
        replace: Callable[[], Stepper] | None = None,
    ):
        self.stepper: Stepper | None = stepper
        self.send = send
        self.admitted, self.gone, self.failure, self.replace = admitted, gone, failure, replace
        self._pending: list[tuple[int, Request]] = []
        self._cancelled: list[int] = []
        self._live: set[int] = set()  # requests the stepper holds, not yet finished or cancelled
        self._wake = threading.Condition()
        self._stopping: str | None = None  # the error every request still held gets on stop
        self._failures = 0  # stepper failures since the last step that worked
        self._broken: str | None = None  # why the worker is broken (None: healthy)
        self._cause = ""  # the last stepper failure, for what a worker without a stepper refuses
        self._refusing: str | None = None  # set while there is no stepper: new requests fail with it at once
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def health(self) -> str | None:
        """Why the worker cannot serve now, or None."""
        return self._broken

    def submit(self, request_id: int, request: Request) -> None:
        with self._wake:
            if self._refusing is not None:
                self.send([failed(request_id, self._refusing)])
                return
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
        while True:
            stepper = self.stepper
            if stepper is None:
                if self._stopped_within(RETRY_S):
                    return
                self.stepper = self._fresh()
                continue
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
            refused = [r for r in (self._admit(stepper, i, request) for i, request in pending) if r is not None]
            for request_id in [*cancelled, *self.gone()]:
                if request_id in self._live:
                    stepper.cancel(request_id)
                    self._live.discard(request_id)
            responses, broke = self._step(stepper)
            self._send(refused + responses)  # this round's answers and the failed step's, in one batch
            if broke is not None and self.replace is not None:
                self._take_over(stepper, broke)

    def _admit(self, stepper: Stepper, request_id: int, request: Request) -> Response | None:
        try:
            stepper.add(request_id, request)
        except Exception as exc:  # a refused (or malformed) request fails alone
            return failed(request_id, str(exc))
        self._live.add(request_id)
        self.admitted(request_id)
        return None

    def _step(self, stepper: Stepper) -> tuple[list[Response], str | None]:
        """One step's responses, and why it failed as a whole (None when it did not)."""
        if not stepper.has_work():
            return [], None
        try:
            responses = stepper.step()
        except Exception as exc:  # the step failed as a whole: the requests it held fail, never the worker
            reason = self.failure(exc)
            held, self._live = sorted(self._live), set()
            if self.replace is None:  # the same stepper goes on without them
                for request_id in held:
                    stepper.cancel(request_id)
            return [failed(request_id, reason) for request_id in held], reason
        if responses:
            self._failures, self._broken = 0, None
        self._live.difference_update(r.request_id for r in responses if r.final)
        return responses, None

    def _take_over(self, stepper: Stepper, reason: str) -> None:
        """A fresh stepper in place of one whose step failed with `reason` (its state is unknown)."""
        try:
            stepper.close()
        except Exception:  # a failed stepper may fail to close too; it is dropped either way
            pass
        self._failures += 1
        self._cause = reason
        if self._failures >= BROKEN_AFTER:
            self._broken = reason
        self.stepper = self._fresh()

    def _fresh(self) -> Stepper | None:
        """A new stepper from `replace`, or None (the worker broken, requests refused) when it cannot be built."""
        assert self.replace is not None
        try:
            stepper = self.replace()
        except Exception as exc:  # out of memory, ...: no stepper until a retry builds one
            with self._wake:
                self._broken = self._refusing = f"{self._cause}; no fresh executor: {exc}"
                late, self._pending = self._pending, []
            self._send([failed(request_id, self._refusing) for request_id, _ in late])
            return None
        with self._wake:
            self._refusing = None
        return stepper

    def _stopped_within(self, seconds: float) -> bool:
        """Wait up to `seconds` for `stop`; whether it came."""
        with self._wake:
            return self._wake.wait_for(lambda: self._stopping is not None, timeout=seconds)

    def _send(self, responses: list[Response]) -> None:
        if responses:
            self.send(responses)


class WorkerExecutor(Executor):
    """An executor over a fresh stepper (from `make_stepper`) per `start`, stepped by one `Worker`, which replaces a
    stepper whose step raised with another from `make_stepper`."""

    gpus = 0  # a CPU executor: its throughput is the host's, not a GPU's

    def __init__(self, make_stepper: Callable[[], Stepper], mode: DecodingMode):
        self.make_stepper = make_stepper
        self.mode = mode
        self.stepper: Stepper | None = None  # the running (or last run) stepper
        self._worker: Worker | None = None

    async def start(self, deliver: Deliver) -> None:
        self.stepper = self.make_stepper()
        self._worker = Worker(self.stepper, threadsafe_deliver(deliver), name="cpu-executor", replace=self._replacement)

    def _replacement(self) -> Stepper:
        self.stepper = self.make_stepper()
        return self.stepper

    def health(self) -> str | None:
        return None if self._worker is None else self._worker.health()

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
