"""The emulated engine request by request (`executors/emulated.py`): what a server sees. Oracles: the golden loop
(`speculative_generate`) on each prompt alone for greedy tokens, and the emulated engine decoding the same request
alone for sampled ones (a request's tokens may not depend on what else is in flight); cancelled requests give their
slot and pages back."""

from __future__ import annotations

import asyncio

import pytest

from dflash_trt.bench.driver import run_load
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import Request
from dflash_trt.executors.emulated import EmulatedExecutor, EmulatedStepper
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.sampling_rules import Sampling, SamplingRefused
from dflash_trt.tiny.heldout import load_heldout
from dflash_trt.tokenizer import load_tokenizer

MAX_NEW = 20


@pytest.fixture(scope="module")
def prompts(tiny) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny)
    texts = [item.text for item in load_heldout(limit=4)]
    return [tokenizer.encode(t) for t in texts] + [tokenizer.encode(texts[0])[:5]]


@pytest.fixture(scope="module")
def engine(tiny) -> EmulatedEngine:
    return EmulatedEngine(tiny, max_batch_size=2, tokens_per_block=16)


@pytest.fixture(scope="module")
def golden(tiny, prompts) -> list[list[int]]:
    model = load_golden_model(tiny)
    return [speculative_generate(model, [p], MAX_NEW)[0].output_ids for p in prompts]


def _drain(stepper: EmulatedStepper) -> dict[int, list[list[int]]]:
    chunks: dict[int, list[list[int]]] = {}
    while stepper.has_work():
        for out in stepper.step():
            chunks.setdefault(out.request_id, []).append(out.tokens)
    return chunks


def _greedy(prompt: list[int]) -> Request:
    return Request(input_ids=prompt, max_new_tokens=MAX_NEW)


def _sampled(prompt: list[int], temperature: float, seed: int) -> Request:
    return Request(input_ids=prompt, max_new_tokens=MAX_NEW, sampling=Sampling(temperature=temperature, seed=seed))


def test_streamed_responses_through_the_executor_equal_the_golden_tokens(engine, prompts, golden):
    requests = [_greedy(p) for p in prompts]
    trace = asyncio.run(run_load(EmulatedExecutor(engine, 256), requests, concurrency=2, timeout_s=600))
    for record in trace.records:
        assert record.error is None
        assert record.output_ids == golden[record.prompt_index]
        assert record.chunks[0] == 1  # the context step answers with the first token alone
        assert sum(record.chunks) == MAX_NEW and max(record.chunks) > 1


def test_a_cancelled_request_frees_its_slot_and_pages(engine, prompts, golden):
    stepper = EmulatedStepper(engine, 256)
    free_before = len(stepper.blocks.free)
    for i in range(3):
        stepper.add(i, _greedy(prompts[i]))
    first = stepper.step()  # two slots: requests 0 and 1 run, 2 waits
    assert sorted(out.request_id for out in first) == [0, 1]
    for request_id in (0, 2, 99):  # running, waiting, unknown
        stepper.cancel(request_id)
    stepper.add(3, _greedy(prompts[3]))
    chunks = _drain(stepper)
    assert set(chunks) == {1, 3}
    assert sum(chunks[3], []) == golden[3]
    assert sum([first[1].tokens, *chunks[1]], []) == golden[1]
    assert len(stepper.blocks.free) == free_before and sorted(stepper.slots.free) == [0, 1]
    stepper.close()


def test_a_sampled_request_decodes_the_same_alone_and_in_company(engine, prompts):
    alone = EmulatedStepper(engine, 256)
    alone.add(0, _sampled(prompts[1], 0.8, 7))
    expected = sum(_drain(alone)[0], [])
    alone.close()
    busy = EmulatedStepper(engine, 256)
    busy.add(5, _sampled(prompts[0], 1.1, 3))
    busy.step()
    busy.add(6, _sampled(prompts[1], 0.8, 7))
    assert sum(_drain(busy)[6], []) == expected
    busy.close()


def test_requests_the_engine_cannot_take_are_refused(engine):
    stepper = EmulatedStepper(engine, 32)
    with pytest.raises(DFlashTrtError, match="exceeds max_seq_len 32"):
        stepper.add(0, Request(input_ids=[5] * 20, max_new_tokens=13))
    with pytest.raises(DFlashTrtError, match="outside the vocabulary"):
        stepper.add(1, Request(input_ids=[engine.vocab_size], max_new_tokens=4))
    with pytest.raises(SamplingRefused, match="temperature"):  # no such request can be made
        _sampled([5, 6], -1.0, 0)
    assert not stepper.has_work()
    stepper.close()
