"""The CPU-served `tensorrt_llm` model's logic (`triton/emulated_llm.py`) without Triton: the tensorrtllm backend's
request reading and defaults, and the served responses. Oracles: the golden loop for greedy tokens, hand-written
word lists and TensorRT-LLM's documented defaults (an absent temperature is 1.0), and the emulated executor
decoding the same sampled request directly."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.executors.contract import Request
from dflash_trt.executors.emulated import EmulatedStepper
from dflash_trt.inputs import DRAFT_LEN_SCHEDULE
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.sampling_rules import Sampling
from dflash_trt.tiny.heldout import load_heldout
from dflash_trt.tokenizer import load_tokenizer
from dflash_trt.triton import emulated_llm as E
from dflash_trt.triton import processing as P

MAX_NEW = 12
MAX_SEQ_LEN = 200

pytestmark = pytest.mark.timeout(300)


def _inputs(prompt: list[int], max_new: int = MAX_NEW, **extra) -> dict[str, np.ndarray]:
    return {
        P.LLM_INPUT_IDS: np.array([prompt], np.int32),
        P.LLM_INPUT_LENGTHS: np.array([len(prompt)], np.int32),
        P.LLM_REQUEST_OUTPUT_LEN: np.array([max_new], np.int32),
        **extra,
    }


def test_absent_inputs_take_the_cpp_backends_defaults():
    request, delivery = E.parse_request(_inputs([4, 5, 6]))
    assert (request.sampling.temperature, request.sampling.seed) == (1.0, 0)
    assert (delivery.streaming, delivery.perf_metrics) == (False, False)
    assert request.stop_words == () and request.input_ids == [4, 5, 6] and request.max_new_tokens == MAX_NEW


def test_end_id_and_stop_words_become_stop_sequences():
    words = np.array([[[7, 8, 9, 0], [2, 3, -1, -1]]], np.int32)  # words [7, 8] and [9]
    request, _ = E.parse_request(_inputs([1], **{P.LLM_END_ID: np.array([3], np.int32), P.LLM_STOP_WORDS: words}))
    assert request.stop_words == ((3,), (7, 8), (9,))
    assert E.parse_request(_inputs([1], **{P.LLM_END_ID: np.array([-1], np.int32)}))[0].stop_words == ()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({P.LLM_INPUT_LENGTHS: np.array([9], np.int32)}, "input_lengths 9 must be in 1..2"),
        ({P.LLM_INPUT_IDS: np.array([[1.0, 2.0]], np.float32)}, "input_ids must be an integer tensor"),
        ({P.LLM_REQUEST_OUTPUT_LEN: np.array([0], np.int32)}, "request_output_len must be >= 1"),
        ({P.LLM_BAD_WORDS: np.array([[[5], [1]]], np.int32)}, "bad_words_list refused"),
        ({P.LLM_STOP_WORDS: np.array([[[5, 6], [2, 1]]], np.int32)}, "offsets must increase"),
        ({P.LLM_STOP: np.array([True])}, "stop refused"),
        ({P.LLM_TEMPERATURE: np.array([0.5, 0.5], np.float32)}, "temperature must hold one value"),
    ],
)
def test_malformed_requests_are_refused_with_one_line(change, message):
    with pytest.raises(ValueError, match=message):
        E.parse_request({**_inputs([1, 2]), **change})
    with pytest.raises(ValueError, match="input request_output_len is required"):
        E.parse_request({P.LLM_INPUT_IDS: np.array([[1]]), P.LLM_INPUT_LENGTHS: np.array([1])})


class ListSink:
    """Collects one request's responses; `finished` is set by the final one."""

    def __init__(self, cancel_after: int | None = None):
        self.responses: list[tuple[dict, str | None, bool]] = []
        self.finished = threading.Event()
        self.cancel_after = cancel_after

    def send(self, outputs, error, final):
        self.responses.append((outputs, error, final))
        if final:
            self.finished.set()

    def cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.responses) >= self.cancel_after

    def tokens(self) -> list[int]:
        return [
            t for outputs, _, _ in self.responses if P.LLM_OUTPUT_IDS in outputs for t in outputs["output_ids"].ravel()
        ]


@pytest.fixture(scope="module")
def checkpoint(tiny: Path) -> Path:
    return tiny


@pytest.fixture(scope="module")
def prompts(checkpoint) -> list[list[int]]:
    tokenizer = load_tokenizer(checkpoint)
    return [tokenizer.encode(item.text) for item in load_heldout(limit=3)]


@pytest.fixture(scope="module")
def engine(checkpoint) -> EmulatedEngine:
    return EmulatedEngine(checkpoint, max_batch_size=2, tokens_per_block=16)


@pytest.fixture()
def server(engine):
    served = E.Server(EmulatedStepper(engine, MAX_SEQ_LEN))
    yield served
    served.stop()


def _wait(*sinks: ListSink) -> None:
    for sink in sinks:
        assert sink.finished.wait(120)


def test_streamed_greedy_responses_equal_the_golden_loop(server, checkpoint, prompts):
    golden = load_golden_model(checkpoint)
    sinks = [ListSink() for _ in prompts]
    streaming, greedy = np.array([True]), np.array([0.0], np.float32)
    for prompt, sink in zip(prompts, sinks, strict=True):
        server.submit(_inputs(prompt, **{P.LLM_STREAMING: streaming, P.LLM_TEMPERATURE: greedy}), sink)
    _wait(*sinks)
    for prompt, sink in zip(prompts, sinks, strict=True):
        assert sink.tokens() == speculative_generate(golden, [prompt], MAX_NEW)[0].output_ids
        assert [final for _, _, final in sink.responses] == [False] * (len(sink.responses) - 1) + [True]
        assert sink.responses[0][0][P.LLM_OUTPUT_IDS].shape == (1, 1, 1)  # the context step: the first token
        lengths = [int(o[P.LLM_SEQUENCE_LENGTH].ravel()[0]) for o, _, _ in sink.responses]
        assert lengths == [o[P.LLM_OUTPUT_IDS].size for o, _, _ in sink.responses]


def test_without_streaming_one_response_holds_every_token_and_the_metrics(server, engine, prompts):
    sink = ListSink()
    extra = {P.LLM_TEMPERATURE: np.array([0.0], np.float32), P.LLM_RETURN_PERF_METRICS: np.array([True])}
    server.submit(_inputs(prompts[0], **extra), sink)
    _wait(sink)
    [(outputs, error, final)] = sink.responses
    assert error is None and final and outputs[P.LLM_SEQUENCE_LENGTH].ravel().tolist() == [MAX_NEW]
    streamed = ListSink()
    server.submit(_inputs(prompts[0], **extra, **{P.LLM_STREAMING: np.array([True])}), streamed)
    _wait(streamed)
    chunks = [o[P.LLM_OUTPUT_IDS].size for o, _, _ in streamed.responses]
    steps = len(chunks) - 1  # verify steps after the context step
    assert outputs["total_draft_tokens"].ravel().tolist() == [steps * engine.k]
    assert outputs["total_accepted_draft_tokens"].ravel().tolist() == [sum(chunks[1:]) - steps]
    assert outputs["first_token_time_ns"].ravel()[0] <= outputs["last_token_time_ns"].ravel()[0]


def _metrics_and_steps(server: E.Server, prompt: list[int]) -> tuple[dict, int, int]:
    """The perf outputs of one streamed greedy request, its verify steps and the tokens they yielded."""
    sink = ListSink()
    extra = {
        P.LLM_TEMPERATURE: np.array([0.0], np.float32),
        P.LLM_RETURN_PERF_METRICS: np.array([True]),
        P.LLM_STREAMING: np.array([True]),
    }
    server.submit(_inputs(prompt, **extra), sink)
    _wait(sink)
    chunks = [o[P.LLM_OUTPUT_IDS].size for o, _, _ in sink.responses]
    return sink.responses[-1][0], len(chunks) - 1, sum(chunks[1:])


@pytest.mark.parametrize(("parameters", "drafts_per_step"), [({"draft_tree": "24"}, 24), ({}, 15)])
def test_a_tree_engines_draft_total_counts_its_nodes(checkpoint, prompts, parameters, drafts_per_step):
    """The CPU repository's parameters: a 24-node tree verifies 24 drafts a step, the chain its 15."""
    params = {"checkpoint_dir": str(checkpoint), "max_batch_size": "2", "max_seq_len": str(MAX_SEQ_LEN)}
    server = E.Server.from_parameters({**params, "tokens_per_block": "16", **parameters})
    try:
        outputs, steps, tokens = _metrics_and_steps(server, prompts[0])
    finally:
        server.stop()
    assert server.stepper.engine.k == drafts_per_step and steps > 0
    assert outputs["total_draft_tokens"].ravel().tolist() == [drafts_per_step * steps]
    assert outputs["total_accepted_draft_tokens"].ravel().tolist() == [tokens - steps]


def test_a_schedules_draft_total_counts_what_each_step_verified(checkpoint, prompts):
    """With one request in the step the schedule 1:4 drafts 4 tokens, not the engine's 15."""
    engine = EmulatedEngine(
        checkpoint, max_batch_size=2, tokens_per_block=16, draft_len_schedule=DRAFT_LEN_SCHEDULE("1:4")
    )
    server = E.Server(EmulatedStepper(engine, MAX_SEQ_LEN))
    try:
        outputs, steps, tokens = _metrics_and_steps(server, prompts[0])
    finally:
        server.stop()
    assert engine.k == 15 and outputs["total_draft_tokens"].ravel().tolist() == [4 * steps]
    assert outputs["total_accepted_draft_tokens"].ravel().tolist() == [tokens - steps]
    assert outputs["acceptance_rate"].ravel()[0] == pytest.approx((tokens - steps) / (4 * steps))


# A prompt on which the tiny pair is unsure: sampling at 1.0 with seed 0 leaves the greedy path.
UNSURE = [5, 90, 33, 7, 64, 2]


def test_an_absent_temperature_samples_at_one_with_seed_zero(server, engine):
    sink = ListSink()
    server.submit(_inputs(UNSURE), sink)
    _wait(sink)
    stepper = EmulatedStepper(engine, MAX_SEQ_LEN)
    try:
        at = [Sampling(temperature=1.0, seed=0), Sampling(temperature=0.0, seed=0)]
        sampled, greedy = (
            stepper.add(i, Request(input_ids=UNSURE, max_new_tokens=MAX_NEW, sampling=s)) for i, s in enumerate(at)
        )
        while stepper.has_work():
            stepper.step()
    finally:
        stepper.close()
    assert sink.tokens() == sampled.output != greedy.output


def test_a_cancelled_request_frees_its_slot(server, prompts):
    leaving = [ListSink(cancel_after=1) for _ in range(2)]
    streaming = {P.LLM_STREAMING: np.array([True]), P.LLM_TEMPERATURE: np.array([0.0], np.float32)}
    for sink in leaving:
        server.submit(_inputs(prompts[0], MAX_SEQ_LEN - len(prompts[0]), **streaming), sink)
    staying = ListSink()
    server.submit(_inputs(prompts[1], 4, **streaming), staying)
    _wait(staying)
    for sink in leaving:  # one or two streamed responses, then the close Triton needs to release the request
        assert 2 <= len(sink.responses) <= 3 and sink.responses[-1] == ({}, None, True)
        assert [final for _, _, final in sink.responses].count(True) == 1
    assert not server.stepper.has_work()


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(server, prompts, monkeypatch):
    real_step = server.stepper.step
    calls = {"n": 0}

    def failing_once():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("out of pages")
        return real_step()

    monkeypatch.setattr(server.stepper, "step", failing_once)
    first, second = ListSink(), ListSink()
    server.submit(_inputs(prompts[0]), first)
    _wait(first)
    assert first.responses == [({}, "the emulated engine failed: RuntimeError: out of pages", True)]
    server.submit(_inputs(prompts[0], 3), second)
    _wait(second)
    assert second.responses[-1][1] is None and len(second.tokens()) == 3


class GoneSink(ListSink):
    """A client that left: every send raises, as the python backend's response sender then does."""

    def send(self, outputs, error, final):
        self.responses.append((outputs, error, final))
        raise RuntimeError("the response sender's client is gone")


def test_a_client_gone_at_send_time_frees_its_slot(server, prompts):
    gone = [GoneSink() for _ in range(2)]
    streaming = {P.LLM_STREAMING: np.array([True]), P.LLM_TEMPERATURE: np.array([0.0], np.float32)}
    for sink in gone:
        server.submit(_inputs(prompts[0], MAX_SEQ_LEN - len(prompts[0]), **streaming), sink)
    after = ListSink()
    server.submit(_inputs(prompts[1], 3, **streaming), after)
    _wait(after)
    assert len(after.tokens()) == 3
    for sink in gone:  # the send that failed, then one attempt to close the request
        assert len(sink.responses) == 2 and not sink.responses[0][2] and sink.responses[1] == ({}, None, True)
