"""The emulated engine request by request (`emulation/executor.py`, `bench/backends/emulated.py`): what a server
sees. Oracles: the golden loop (`speculative_generate`) on each prompt alone for greedy tokens, and the emulated
engine decoding the same request alone for sampled ones (a request's tokens may not depend on what else is in
flight); cancelled requests give their slot and pages back."""

from __future__ import annotations

import asyncio

import pytest
from _poisoned import POISONED_TOKEN

from dflash_trt.bench.backends.emulated import EmulatedBackend
from dflash_trt.bench.driver import BenchRequest, run_load
from dflash_trt.emulation import executor as executor_module
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.executor import EmulatedExecutor, Request, StepOutput
from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.loop_rules import longest_request
from dflash_trt.reference.model import load_golden_model
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


def _drain(executor: EmulatedExecutor) -> dict[int, list[list[int]]]:
    chunks: dict[int, list[list[int]]] = {}
    while executor.has_work():
        for out in executor.step():
            chunks.setdefault(out.index, []).append(out.tokens)
    return chunks


def test_streamed_responses_through_the_backend_equal_the_golden_tokens(engine, prompts, golden):
    requests = [BenchRequest(i, p, MAX_NEW) for i, p in enumerate(prompts)]
    trace = asyncio.run(run_load(EmulatedBackend(engine, 200), requests, concurrency=2, timeout_s=600))
    for record in trace.records:
        assert record.error is None
        assert record.output_ids == golden[record.prompt_index]
        assert record.chunks[0] == 1  # the context step answers with the first token alone
        assert sum(record.chunks) == MAX_NEW and max(record.chunks) > 1


def test_a_cancelled_request_frees_its_slot_and_pages(engine, prompts, golden):
    executor = EmulatedExecutor(engine, 200)
    free_before = len(executor.blocks.free)
    for i in range(3):
        executor.add(Request(i, prompts[i], MAX_NEW))
    first = executor.step()  # two slots: requests 0 and 1 run, 2 waits
    assert sorted(out.index for out in first) == [0, 1]
    assert executor.cancel(0) and executor.cancel(2) and not executor.cancel(99)
    executor.add(Request(3, prompts[3], MAX_NEW))
    chunks = _drain(executor)
    assert set(chunks) == {1, 3}
    assert sum(chunks[3], []) == golden[3]
    assert sum([first[1].tokens, *chunks[1]], []) == golden[1]
    assert len(executor.blocks.free) == free_before and sorted(executor.slots.free) == [0, 1]
    executor.close()


def test_a_sampled_request_decodes_the_same_alone_and_in_company(engine, prompts):
    alone = EmulatedExecutor(engine, 200)
    alone.add(Request(0, prompts[1], MAX_NEW, temperature=0.8, seed=7))
    expected = sum(_drain(alone)[0], [])
    alone.close()
    busy = EmulatedExecutor(engine, 200)
    busy.add(Request(5, prompts[0], MAX_NEW, temperature=1.1, seed=3))
    busy.step()
    busy.add(Request(6, prompts[1], MAX_NEW, temperature=0.8, seed=7))
    assert sum(_drain(busy)[6], []) == expected
    busy.close()


def test_requests_the_engine_cannot_take_are_refused(engine):
    executor = EmulatedExecutor(engine, 32)
    with pytest.raises(DFlashTrtError, match="exceeds max_seq_len 32"):
        executor.add(Request(0, [5] * 20, 13))
    with pytest.raises(DFlashTrtError, match="outside the vocabulary"):
        executor.add(Request(1, [engine.vocab_size], 4))
    with pytest.raises(DFlashTrtError, match="temperature"):
        executor.add(Request(2, [5, 6], 4, temperature=-1.0))
    executor.close()


def _run(
    engine: EmulatedEngine, requests: list[Request], max_seq_len: int = 200
) -> tuple[list[StepOutput], int, list[int]]:
    """Every request to the end in one executor: its responses, then the free pages and slots it was left with."""
    executor = EmulatedExecutor(engine, max_seq_len)
    for r in requests:
        executor.add(r)
    outputs = []
    while executor.has_work():
        outputs += executor.step()
    left = len(executor.blocks.free), sorted(executor.slots.free)
    executor.close()
    return outputs, *left


def test_a_request_the_engine_fails_on_fails_alone(poisoned_tiny, prompts):
    """Sampled, the poisoned prompt makes the engine raise in the step it shares with two others. It ends with the
    cause; the greedy and the sampled request beside it decode exactly as without it (tokens, acceptance, and the
    sampled one's random draws), and every page and slot is free at the end."""
    engine = EmulatedEngine(poisoned_tiny, max_batch_size=3, tokens_per_block=16)
    company = [Request(0, prompts[0], MAX_NEW), Request(2, prompts[1], MAX_NEW, temperature=0.8, seed=7)]
    poisoned = Request(1, [*prompts[2][:3], POISONED_TOKEN, *prompts[2][3:]], MAX_NEW, temperature=1.0, seed=3)
    alone = [Request(r.index, r.prompt, r.max_new_tokens, r.temperature, r.seed) for r in company]
    clean, *_ = _run(engine, alone)
    outputs, free_pages, free_slots = _run(engine, [company[0], poisoned, company[1]])
    failed = [out for out in outputs if out.error is not None]
    assert [(out.index, out.tokens, out.finished) for out in failed] == [(1, [], True)]
    assert failed[0].error.startswith("the engine failed on this request: EmulationError: gather index out of range")
    assert [(r.output, r.acceptance) for r in company] == [(r.output, r.acceptance) for r in alone]
    assert [out for out in outputs if out.index != 1] == clean
    assert free_pages == len(EmulatedExecutor(engine, 200).blocks.free) and free_slots == [0, 1, 2]


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 9.9e-6])
def test_temperatures_too_small_to_invert_decode_greedily_in_the_engine(engine, prompts, golden, temperature):
    """The network itself maps them to greedy (trtllm/verify.py): the executor hands it the raw temperature."""
    executor = EmulatedExecutor(engine, 200)
    executor.add(Request(0, prompts[0], MAX_NEW, temperature=temperature, seed=5))
    assert sum(_drain(executor)[0], []) == golden[0]
    executor.close()


ADD = "add 1537 7993\n"  # its 2nd and 3rd verify steps accept all 16 tokens of a block
ADD_NEW = 9  # so the last step is the 2nd, with one token of budget left and every draft accepted


def test_the_longest_request_reaches_the_last_position(tiny, edited_copy, monkeypatch):
    """`longest_request` is exact: the request's last step accepts all K drafts, so its next draft block ends
    2K = 30 positions past its last token. With exactly that many positions it decodes; with one fewer the
    executor refuses it at admission, and under the old rule (positions less one block, K + 1) it would have been
    admitted and failed in the engine (alone)."""
    prompt = load_tokenizer(tiny).encode(ADD)
    length = len(prompt) + ADD_NEW
    fits = EmulatedEngine(_positions(edited_copy, tiny, length + 30), max_batch_size=1, tokens_per_block=16)
    assert longest_request(length + 30, fits.k) == length and fits.k == 15
    request = Request(0, prompt, ADD_NEW)
    outputs, *_ = _run(fits, [request], length)
    assert request.steps[-1].accepted == fits.k and len(request.output) == ADD_NEW
    assert all(out.error is None for out in outputs)
    short = EmulatedEngine(_positions(edited_copy, tiny, length + 29), max_batch_size=1, tokens_per_block=16)
    with pytest.raises(DFlashTrtError, match=f"max_seq_len must be in 2..{length - 1} "):
        EmulatedExecutor(short, length)
    monkeypatch.setattr(executor_module, "longest_request", lambda positions, k: positions - (k + 1))
    outputs, *_ = _run(short, [Request(0, prompt, ADD_NEW)], length)
    assert (
        outputs[-1].error
        == "the engine failed on this request: EmulationError: a position beyond max_position_embeddings"
    )


def _positions(edited_copy, tiny, positions: int):
    def edit(config: dict) -> None:
        config["max_position_embeddings"] = positions

    return edited_copy(tiny, edit, name=f"positions{positions}")
