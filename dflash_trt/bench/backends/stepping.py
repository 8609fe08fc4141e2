"""A backend over any step-wise CPU executor: the executor runs in a worker thread that hands each step's
responses to the event loop, as the GPU executor's own threads do (torch releases the GIL inside its kernels).

Both CPU executors (the golden model's and the emulated engine's) take requests, advance every running request by
one iteration per `step` and answer with that iteration's tokens; this module owns the thread around them.

A request the executor fails on fails alone (the emulated executor isolates it: its response carries the error).
When `step` itself raises, the executor's state is unknown: every request it held fails with the cause and a fresh
executor takes over. The backend is broken (`health` says why) when BROKEN_AFTER executors in a row fail before
any of their steps works, or a fresh one cannot be built; it keeps trying a fresh executor every RETRY_S and is
healthy again once a step works. Requests are refused at once only while there is no executor at all.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Protocol

from dflash_trt.bench.driver import Backend, BenchRequest, Deliver, Response, threadsafe_deliver
from dflash_trt.decoding_modes import DecodingMode
from dflash_trt.errors import DFlashTrtError

BROKEN_AFTER = 2  # executor failures in a row (no step working in between) that mark the backend broken
RETRY_S = 5.0  # how long a backend without an executor waits before building a fresh one


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
        self._failures = 0  # executor failures since the last step that worked
        self._broken: str | None = None  # why the backend is broken (None: healthy)
        self._cause = ""  # the last executor failure, for the requests a retry without an executor refuses
        self._refusing: str | None = None  # set while there is no executor: new requests fail with it at once
        self._send: Deliver | None = None
        self._live: set[int] = set()  # requests handed to the executor and not finished or cancelled

    def health(self) -> str | None:
        return self._broken

    async def start(self, deliver: Deliver) -> None:
        self._stopping = False
        self._failures, self._broken, self._refusing = 0, None, None
        self._live = set()
        send = self._send = threadsafe_deliver(deliver)
        executor = self.executor = self.make_executor()
        self._thread = threading.Thread(target=self._serve, args=(executor, send), name="cpu-executor", daemon=True)
        self._thread.start()

    def submit(self, request_id: int, request: BenchRequest) -> None:
        with self._wake:
            if self._refusing is not None and self._send is not None:
                self._send([Response(request_id, [], True, self._refusing)])
                return
            self._pending.append((request_id, request))
            self._wake.notify()

    def cancel(self, request_id: int) -> None:
        """Stop decoding `request_id` before its next step; it gets no further responses."""
        with self._wake:
            self._cancelled.append(request_id)
            self._wake.notify()

    def _serve(self, executor: SteppingExecutor | None, send: Deliver) -> None:
        while True:
            if executor is None:
                if self._stopped_within(RETRY_S):
                    return
                executor = self._fresh(send)
                continue
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
            except Exception as exc:  # the executor failed as a whole (its state is unknown): replace it
                executor = self._replace(executor, f"the executor failed: {exc}", failed, send)
                continue
            if responses:
                self._failures, self._broken = 0, None
            self._live.difference_update(r.request_id for r in responses if r.final)
            if failed or responses:
                send(failed + responses)

    def _replace(
        self, executor: SteppingExecutor, reason: str, failed: list[Response], send: Deliver
    ) -> SteppingExecutor | None:
        """End every request the failed executor held with `reason` (after the `failed` answers of this round),
        then a fresh executor (None: none for now)."""
        abandoned, self._live = sorted(self._live), set()
        send(failed + [Response(request_id, [], True, reason) for request_id in abandoned])
        try:
            executor.close()
        except Exception:  # a failed executor may fail to close too; it is dropped either way
            pass
        self._failures += 1
        self._cause = reason
        if self._failures >= BROKEN_AFTER:
            self._broken = reason
        return self._fresh(send)

    def _fresh(self, send: Deliver) -> SteppingExecutor | None:
        """A new executor, or None (the backend broken, requests refused) when it cannot be built."""
        try:
            executor = self.executor = self.make_executor()
        except Exception as exc:  # out of memory, ...: no executor until a retry builds one
            with self._wake:
                self._broken = self._refusing = f"{self._cause}; no fresh executor: {exc}"
                late, self._pending = self._pending, []
            send([Response(request_id, [], True, self._refusing) for request_id, _ in late])
            return None
        with self._wake:
            self._refusing = None
        return executor

    def _stopped_within(self, seconds: float) -> bool:
        """Wait up to `seconds` for `stop`; whether it came."""
        with self._wake:
            return self._wake.wait_for(lambda: self._stopping, timeout=seconds)

    async def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
