"""The executor contract: one request record, one response record, and the interface every executor implements.

An executor takes requests (`submit`) and hands back responses in batches (`deliver`), always on the event loop's
thread: one response per decoding iteration of one request, carrying the tokens that iteration produced, the last
one marked final (or carrying an error). Executors that run their own threads (TensorRT-LLM's executor, the CPU
steppers' worker) hand batches over with `threadsafe_deliver`.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from dflash_trt.decoding_modes import DFLASH, DecodingMode
from dflash_trt.sampling_rules import GREEDY, Sampling


@dataclass(frozen=True, kw_only=True)
class Request:
    """One generation request as every executor takes it: the prompt's token ids, the output budget, how it samples
    (normalised at the edge it came through), and stop sequences of its own (token ids, kept in the output) on top of
    the executor's stop tokens."""

    input_ids: list[int]
    max_new_tokens: int
    sampling: Sampling = GREEDY
    stop_words: tuple[tuple[int, ...], ...] = ()


@dataclass(slots=True, kw_only=True)
class Response:
    """The tokens one decoding iteration produced for request `request_id`; `final` ends the request, and so does
    an `error`. `draft_len`: the drafts that iteration verified, where the executor sees them (the CPU steppers;
    None for a prefill iteration and for executors behind a runtime or a server, which do not report it)."""

    request_id: int
    tokens: list[int]
    final: bool = False
    error: str | None = None
    draft_len: int | None = None


Deliver = Callable[[list[Response]], None]


def failed(request_id: int, error: str) -> Response:
    """The final response of a request that failed with `error`."""
    return Response(request_id=request_id, tokens=[], final=True, error=error)


class FollowerRank(Exception):
    """Raised by `Executor.start` on an MPI rank that serves a multi-GPU engine for rank 0 and sends nothing itself.

    Such a rank still walks through every point (each point's executor is built on all ranks together) and
    writes nothing."""


class Executor(ABC):
    """What the load generator and the server need from an executor. `mode` is its decoding mode; `gpus` divides
    throughput (0 for a CPU executor, whose throughput is the host's)."""

    mode: DecodingMode = DFLASH
    gpus: int = 1

    @abstractmethod
    async def start(self, deliver: Deliver) -> None:
        """Get ready to serve; from now on every response goes to `deliver`, called on the event loop's thread."""

    @abstractmethod
    def submit(self, request_id: int, request: Request) -> None:
        """Send one request without waiting for it (called on the event loop's thread)."""

    @abstractmethod
    def cancel(self, request_id: int) -> None:
        """Stop serving `request_id` (a client went away); responses that still arrive for it may be ignored."""

    @abstractmethod
    async def stop(self) -> None:
        """Release what `start` acquired; requests still running may be dropped."""

    def health(self) -> str | None:
        """Why the executor cannot serve now (its engine is broken), or None when it can."""
        return None


def threadsafe_deliver(deliver: Deliver) -> Deliver:
    """A `deliver` that executor threads may call: it schedules the real one on the running loop."""
    loop = asyncio.get_running_loop()

    def from_thread(batch: list[Response]) -> None:
        loop.call_soon_threadsafe(deliver, batch)

    return from_thread
