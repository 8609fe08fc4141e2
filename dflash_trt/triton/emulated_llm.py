"""The `tensorrt_llm` model of a CPU-served repository: the tensorrtllm backend's request contract over the
emulated engine (`dflash_trt.emulation`), so clients, ensembles and the BLS written for a GPU server run unchanged
on a CPU, and the whole serving stack can be tested in a real Triton server.

The contract is the one the repository's `tensorrt_llm/config.pbtxt` declares (the same tensors, dtypes and dims for
both kinds of repository) with the C++ backend's request defaults, as read in tensorrtllm_backend's
`inflight_batcher_llm` sources (not run): an absent `temperature` samples at 1.0, an absent `random_seed` is 0, an
absent `end_id` never ends a request early, `streaming` answers once per decoding iteration with that iteration's
new tokens, otherwise one response carries all of them; output ids exclude the prompt. The executors' worker thread
(`dflash_trt.executors.worker`) steps the emulated stepper, in-flight batching up to the engine's `max_batch_size`;
a request whose client went away is cancelled before the next step, freeing its slot, and closed with a final
response (Triton releases a request only at its final response). The Triton `model.py` only
moves numpy arrays between Triton and `Server`.
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
from dflash_trt.executors.contract import Request, Response
from dflash_trt.executors.emulated import EmulatedStepper
from dflash_trt.executors.worker import Worker
from dflash_trt.sampling_rules import DEFAULT_SEED, DEFAULT_TEMPERATURE, Sampling, SamplingRefused
from dflash_trt.triton import processing as P

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


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """How the tensorrtllm backend answers one request: once per iteration or once in all, with perf metrics or
    without."""

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


def parse_request(inputs: dict[str, np.ndarray]) -> tuple[Request, Delivery]:
    """The tensorrtllm backend's reading of one request, its sampling normalised here with the backend's defaults
    (an absent temperature is 1.0, an absent seed 0); ValueError with the client's message when malformed."""
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
    try:
        sampling = Sampling(
            temperature=DEFAULT_TEMPERATURE if temperature is None else float(temperature),
            seed=DEFAULT_SEED if seed is None else int(seed),
        )
    except SamplingRefused as exc:
        raise ValueError(str(exc)) from None
    request = Request(
        input_ids=[int(t) for t in ids[:length]],
        max_new_tokens=max_new,
        sampling=sampling,
        stop_words=((int(end_id),), *stop_words) if end_id is not None and end_id >= 0 else stop_words,
    )
    delivery = Delivery(
        streaming=bool(_scalar(inputs, P.LLM_STREAMING) or False),
        perf_metrics=bool(_scalar(inputs, P.LLM_RETURN_PERF_METRICS) or False),
    )
    return request, delivery


@dataclass
class _InFlight:
    request: Request
    delivery: Delivery
    sink: ResponseSink
    arrival_ns: int
    admitted: bool = False  # the stepper took it
    scheduled_ns: int = 0
    first_token_ns: int = 0
    tokens: list[int] = field(default_factory=list)
    responses: int = 0  # iterations answered: the context step's first token, then one per verify step
    drafted: int = 0  # drafts verified over the request's steps: a chain's drafts, or a tree's nodes, per step


def _send_quietly(sink: ResponseSink, error: str | None) -> None:
    """A final response without outputs (with `error` when there is one). Triton keeps a request, and the model
    that holds it, until its final response: a request whose client left is closed this way too, or it would never
    be released and the model never unload. A client that already left cannot be told, and must not stop the
    worker."""
    try:
        sink.send({}, error, True)
    except Exception:  # the python backend raises when the response sender's client is gone
        pass


def _engine_failure(exc: Exception) -> str:
    """What the requests of a step that raised are told (the stepper goes on with the next ones)."""
    return f"the emulated engine failed: {type(exc).__name__}: {exc}"


def _tensor(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


class Server:
    """The emulated stepper behind the tensorrtllm contract, stepped by the executors' worker thread."""

    def __init__(self, stepper: EmulatedStepper, clock: Callable[[], int] = time.time_ns):
        self.stepper = stepper
        self.clock = clock
        self._ids = itertools.count()
        self._flights: dict[int, _InFlight] = {}
        self._lock = threading.Lock()  # the flights are added from Triton's threads, answered from the worker's
        self.worker = Worker(
            stepper,
            self._answer,
            name="emulated-tensorrt_llm",
            admitted=self._admitted,
            gone=self._gone,
            failure=_engine_failure,
        )

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> Server:
        """From the string parameters the CPU repository's tensorrt_llm/config.pbtxt gives the model."""
        tree = params.get("draft_tree")
        engine = EmulatedEngine(
            params["checkpoint_dir"],
            max_batch_size=int(params["max_batch_size"]),
            tokens_per_block=int(params["tokens_per_block"]),
            draft_tree=None if tree is None else int(tree),
        )
        return cls(EmulatedStepper(engine, int(params["max_seq_len"])))

    def submit(self, inputs: dict[str, np.ndarray], sink: ResponseSink) -> None:
        """Queue one request; a malformed one is answered at once with an error as its final response."""
        try:
            request, delivery = parse_request(inputs)
        except ValueError as exc:
            sink.send({}, str(exc), True)
            return
        request_id = next(self._ids)
        with self._lock:
            self._flights[request_id] = _InFlight(request, delivery, sink, self.clock())
        self.worker.submit(request_id, request)

    def stop(self) -> None:
        """Stop stepping, answer what is still queued or running with an error, and give the KV pool back."""
        self.worker.stop("the tensorrt_llm model is unloading")

    def _admitted(self, request_id: int) -> None:
        flight = self._flights[request_id]
        flight.admitted, flight.scheduled_ns = True, self.clock()

    def _gone(self) -> list[int]:
        """Admitted requests whose clients cancelled them; each is closed with a final response carrying nothing."""
        with self._lock:
            flights = self._flights.items()
            gone = [request_id for request_id, flight in flights if flight.admitted and flight.sink.cancelled()]
            sinks = [self._flights.pop(request_id).sink for request_id in gone]
        for sink in sinks:
            _send_quietly(sink, None)
        return gone

    def _answer(self, responses: list[Response]) -> None:
        for response in responses:
            flight = self._flights.get(response.request_id)
            if flight is None:
                continue  # its client cancelled it
            if response.error is not None:
                self._forget(response.request_id)
                _send_quietly(flight.sink, response.error)
            else:
                flight.drafted += response.draft_len or 0
                self._respond(response.request_id, flight, response.tokens, response.final)

    def _forget(self, request_id: int) -> None:
        with self._lock:
            self._flights.pop(request_id, None)

    def _respond(self, request_id: int, flight: _InFlight, tokens: list[int], finished: bool) -> None:
        now = self.clock()
        flight.first_token_ns = flight.first_token_ns or now
        flight.tokens.extend(tokens)
        flight.responses += 1
        streaming = flight.delivery.streaming
        if finished:
            self._forget(request_id)
        elif not streaming:
            return
        sent = tokens if streaming else flight.tokens
        outputs = {
            P.LLM_OUTPUT_IDS: np.array([[sent]], dtype=np.int32),
            P.LLM_SEQUENCE_LENGTH: np.array([[len(sent)]], dtype=np.int32),
        }
        if flight.delivery.perf_metrics:
            outputs.update(self._perf_metrics(flight, now))
        try:
            flight.sink.send(outputs, None, finished)
        except Exception:  # the client went away between the check and the send: free its slot, close the request
            if not finished:
                self.worker.cancel(request_id)
                self._forget(request_id)
                _send_quietly(flight.sink, None)

    def _perf_metrics(self, flight: _InFlight, now: int) -> dict[str, np.ndarray]:
        """The backend's perf outputs; KV blocks are those the request's tokens (and one draft block) occupy. Every
        verify step answers once, after the context step's first token. Draft tokens are those the steps verified
        (a draft tree's nodes; fewer than the engine's most when a schedule shortens the draft or a tree comes out
        smaller), so the rate is per draft verified, not per draft position."""
        engine = self.stepper.engine
        steps = flight.responses - 1
        drafted, accepted = flight.drafted, len(flight.tokens) - 1 - steps
        tokens = len(flight.request.input_ids) + len(flight.tokens) + engine.block
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
