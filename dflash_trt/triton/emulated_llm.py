"""The `tensorrt_llm` model of a CPU-served repository: the tensorrtllm backend's request contract over the
emulated engine (`dflash_trt.emulation`), so clients, ensembles and the BLS written for a GPU server run unchanged
on a CPU, and the whole serving stack can be tested in a real Triton server.

The contract is the one the repository's `tensorrt_llm/config.pbtxt` declares (the same tensors, dtypes and dims for
both kinds of repository) with the C++ backend's request defaults, as read in tensorrtllm_backend's
`inflight_batcher_llm` sources (not run): an absent `temperature` samples at 1.0, an absent `random_seed` is 0, an
absent `end_id` never ends a request early, `streaming` answers once per decoding iteration with that iteration's
new tokens, otherwise one response carries all of them; output ids exclude the prompt. One worker thread steps the
executor, in-flight batching up to the engine's `max_batch_size`; a request whose client went away is cancelled
before the next step, freeing its slot. The Triton `model.py` only moves numpy arrays between Triton and `Server`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.executor import EmulatedExecutor, Request
from dflash_trt.errors import DFlashTrtError
from dflash_trt.triton import processing as P

# The C++ backend's defaults for a request that does not send the input (executor SamplingConfig / Request).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_SEED = 0
INPUT_NAMES = (
    P.LLM_INPUT_IDS,
    P.LLM_INPUT_LENGTHS,
    P.LLM_REQUEST_OUTPUT_LEN,
    P.LLM_END_ID,
    P.LLM_PAD_ID,
    P.LLM_STOP_WORDS,
    P.LLM_BAD_WORDS,
    P.LLM_TEMPERATURE,
    P.LLM_RANDOM_SEED,
    P.LLM_STREAMING,
    P.LLM_STOP,
    P.LLM_RETURN_PERF_METRICS,
)


class ResponseSink(Protocol):
    """Where one request's responses go (a Triton response sender in the server, a list in the tests)."""

    def send(self, outputs: dict[str, np.ndarray], error: str | None, final: bool) -> None: ...

    def cancelled(self) -> bool: ...


@dataclass(frozen=True)
class LlmRequest:
    """One request as the tensorrtllm backend reads it."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float
    seed: int
    stop_words: tuple[tuple[int, ...], ...]
    streaming: bool
    perf_metrics: bool


def _scalar(inputs: dict[str, np.ndarray], name: str):
    value = inputs.get(name)
    if value is None:
        return None
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1:
        raise ValueError(f"{name} must hold one value per request, got {flat.size}")
    return flat[0].item()


def _integers(inputs: dict[str, np.ndarray], name: str) -> np.ndarray:
    array = np.asarray(inputs[name])
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must be an integer tensor, got {array.dtype}")
    return array


def _integer_scalar(inputs: dict[str, np.ndarray], name: str) -> int:
    return int(_scalar({name: _integers(inputs, name)}, name))


def decode_word_list(array: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """TensorRT-LLM's [1, 2, L] word list (ids back to back; end offsets padded with -1) as token-id tuples."""
    rows = np.asarray(array).reshape(2, -1)
    words, start = [], 0
    for end in rows[1].tolist():
        if end < 0:
            break
        if end <= start or end > rows.shape[1]:
            raise ValueError(f"word list offsets must increase within the list, got {rows[1].tolist()}")
        words.append(tuple(int(t) for t in rows[0, start:end]))
        start = end
    return tuple(words)


def parse_request(inputs: dict[str, np.ndarray]) -> LlmRequest:
    """The tensorrtllm backend's reading of one request; ValueError with the client's message when malformed."""
    for name in (P.LLM_INPUT_IDS, P.LLM_INPUT_LENGTHS, P.LLM_REQUEST_OUTPUT_LEN):
        if inputs.get(name) is None:
            raise ValueError(f"input {name} is required")
    ids = _integers(inputs, P.LLM_INPUT_IDS).reshape(-1).tolist()
    length = _integer_scalar(inputs, P.LLM_INPUT_LENGTHS)
    if not 1 <= length <= len(ids):
        raise ValueError(f"input_lengths {length} must be in 1..{len(ids)} (the input_ids sent)")
    max_new = int(
        _scalar({P.LLM_REQUEST_OUTPUT_LEN: _integers(inputs, P.LLM_REQUEST_OUTPUT_LEN)}, "request_output_len")
    )
    if max_new < 1:
        raise ValueError(f"request_output_len must be >= 1, got {max_new}")
    if _scalar(inputs, P.LLM_STOP):
        raise ValueError(
            "stop refused: the CPU-served tensorrt_llm cancels a request when its client closes the stream"
        )
    temperature = _scalar(inputs, P.LLM_TEMPERATURE)
    seed = _scalar(inputs, P.LLM_RANDOM_SEED)
    end_id = _scalar(inputs, P.LLM_END_ID)
    stop_words = decode_word_list(inputs[P.LLM_STOP_WORDS]) if inputs.get(P.LLM_STOP_WORDS) is not None else ()
    if inputs.get(P.LLM_BAD_WORDS) is not None and decode_word_list(inputs[P.LLM_BAD_WORDS]):
        raise ValueError("bad_words_list refused: the DFlash engine's in-graph verification cannot ban tokens")
    return LlmRequest(
        prompt=[int(t) for t in ids[:length]],
        max_new_tokens=max_new,
        temperature=DEFAULT_TEMPERATURE if temperature is None else float(temperature),
        seed=DEFAULT_SEED if seed is None else int(seed),
        stop_words=((int(end_id),), *stop_words) if end_id is not None and end_id >= 0 else stop_words,
        streaming=bool(_scalar(inputs, P.LLM_STREAMING) or False),
        perf_metrics=bool(_scalar(inputs, P.LLM_RETURN_PERF_METRICS) or False),
    )


@dataclass
class _InFlight:
    index: int
    request: LlmRequest
    sink: ResponseSink
    arrival_ns: int
    decoding: Request | None = None  # the executor's request once admitted
    scheduled_ns: int = 0
    first_token_ns: int = 0
    tokens: list[int] = field(default_factory=list)


def _send_quietly(sink: ResponseSink, error: str) -> None:
    """A final error response; a client that already left cannot be told, and must not stop the worker."""
    try:
        sink.send({}, error, True)
    except Exception:  # the python backend raises when the response sender's client is gone
        pass


def _tensor(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


class Server:
    """The executor behind the tensorrtllm contract, stepped by one worker thread."""

    def __init__(self, executor: EmulatedExecutor, clock: Callable[[], int] = time.time_ns):
        self.executor = executor
        self.clock = clock
        self._ids = itertools.count()
        self._pending: list[_InFlight] = []
        self._running: dict[int, _InFlight] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="emulated-tensorrt_llm", daemon=True)
        self._thread.start()

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> Server:
        """From the string parameters the CPU repository's tensorrt_llm/config.pbtxt gives the model."""
        engine = EmulatedEngine(
            params["checkpoint_dir"],
            max_batch_size=int(params["max_batch_size"]),
            tokens_per_block=int(params["tokens_per_block"]),
        )
        return cls(EmulatedExecutor(engine, int(params["max_seq_len"])))

    def submit(self, inputs: dict[str, np.ndarray], sink: ResponseSink) -> None:
        """Queue one request; a malformed one is answered at once with an error as its final response."""
        try:
            request = parse_request(inputs)
        except ValueError as exc:
            sink.send({}, str(exc), True)
            return
        flight = _InFlight(next(self._ids), request, sink, self.clock())
        with self._wake:
            self._pending.append(flight)
            self._wake.notify()

    def stop(self) -> None:
        """Stop stepping, answer what is still running with an error, and give the KV pool back."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._pending or self.executor.has_work()):
                    self._wake.wait()
                pending, self._pending = self._pending, []
                stopping = self._stopping
            if stopping:
                for flight in [*pending, *self._running.values()]:
                    _send_quietly(flight.sink, "the tensorrt_llm model is unloading")
                self.executor.close()
                return
            for flight in pending:
                self._admit(flight)
            for flight in [f for f in self._running.values() if f.sink.cancelled()]:
                self.executor.cancel(flight.index)
                del self._running[flight.index]
            try:
                outputs = self.executor.step() if self.executor.has_work() else []
            except Exception as exc:  # a failed step fails the requests it held, never the server
                self._fail_running(f"the emulated engine failed: {type(exc).__name__}: {exc}")
                continue
            for out in outputs:
                if out.error is not None:  # the engine failed on this request alone: it ends, the others go on
                    _send_quietly(self._running.pop(out.index).sink, out.error)
                else:
                    self._respond(self._running[out.index], out.tokens, out.finished)

    def _fail_running(self, message: str) -> None:
        for flight in list(self._running.values()):
            self.executor.cancel(flight.index)
            del self._running[flight.index]
            _send_quietly(flight.sink, message)

    def _admit(self, flight: _InFlight) -> None:
        r = flight.request
        flight.decoding = Request(flight.index, r.prompt, r.max_new_tokens, r.temperature, r.seed, r.stop_words)
        try:
            self.executor.add(flight.decoding)
        except DFlashTrtError as exc:
            _send_quietly(flight.sink, str(exc))
            return
        flight.scheduled_ns = self.clock()
        self._running[flight.index] = flight

    def _respond(self, flight: _InFlight, tokens: list[int], finished: bool) -> None:
        now = self.clock()
        flight.first_token_ns = flight.first_token_ns or now
        flight.tokens.extend(tokens)
        if finished:
            del self._running[flight.index]
        elif not flight.request.streaming:
            return
        sent = tokens if flight.request.streaming else flight.tokens
        outputs = {
            P.LLM_OUTPUT_IDS: np.array([[sent]], dtype=np.int32),
            P.LLM_SEQUENCE_LENGTH: np.array([[len(sent)]], dtype=np.int32),
        }
        if flight.request.perf_metrics:
            outputs.update(self._perf_metrics(flight, now))
        try:
            flight.sink.send(outputs, None, finished)
        except Exception:  # the client went away between the check and the send: free its slot
            if not finished:
                self.executor.cancel(flight.index)
                del self._running[flight.index]

    def _perf_metrics(self, flight: _InFlight, now: int) -> dict[str, np.ndarray]:
        """The backend's perf outputs; KV blocks are those the request's tokens (and one draft block) occupy."""
        decoding = flight.decoding
        assert decoding is not None
        engine = self.executor.engine
        steps = len(decoding.acceptance)
        drafted, accepted = steps * engine.k, sum(decoding.acceptance) - steps
        tokens = len(decoding.prompt) + len(decoding.output) + engine.block
        blocks = -(-tokens // engine.tokens_per_block)
        return {
            "kv_cache_alloc_new_blocks": _tensor(blocks, np.int32),
            "kv_cache_reused_blocks": _tensor(0, np.int32),
            "kv_cache_alloc_total_blocks": _tensor(blocks, np.int32),
            "arrival_time_ns": _tensor(flight.arrival_ns, np.int64),
            "first_scheduled_time_ns": _tensor(flight.scheduled_ns, np.int64),
            "first_token_time_ns": _tensor(flight.first_token_ns, np.int64),
            "last_token_time_ns": _tensor(now, np.int64),
            "acceptance_rate": _tensor(accepted / drafted if drafted else 0.0, np.float32),
            "total_accepted_draft_tokens": _tensor(accepted, np.int32),
            "total_draft_tokens": _tensor(drafted, np.int32),
        }
