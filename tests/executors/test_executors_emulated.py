"""The emulated engine request by request (`executors/emulated.py`): what a server sees. Oracles: the golden loop
(`speculative_generate`) on each prompt alone for greedy tokens, and the emulated engine decoding the same request
alone for sampled ones (a request's tokens may not depend on what else is in flight); cancelled requests give their
slot and pages back."""

from __future__ import annotations

import asyncio

import pytest
from _poisoned import POISONED_TOKEN

from dflash_trt.bench.driver import run_load
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors import emulated as emulated_module
from dflash_trt.executors.contract import Request, Response
from dflash_trt.executors.emulated import EmulatedExecutor, EmulatedStepper
from dflash_trt.executors.emulated_inputs import Decoding
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.loop_rules import longest_request
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
    trace = asyncio.run(run_load(EmulatedExecutor(engine, 200), requests, concurrency=2, timeout_s=600))
    for record in trace.records:
        assert record.error is None
        assert record.output_ids == golden[record.prompt_index]
        assert record.chunks[0] == 1  # the context step answers with the first token alone
        assert sum(record.chunks) == MAX_NEW and max(record.chunks) > 1


def test_a_cancelled_request_frees_its_slot_and_pages(engine, prompts, golden):
    stepper = EmulatedStepper(engine, 200)
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
    alone = EmulatedStepper(engine, 200)
    alone.add(0, _sampled(prompts[1], 0.8, 7))
    expected = sum(_drain(alone)[0], [])
    alone.close()
    busy = EmulatedStepper(engine, 200)
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


def _run(
    engine: EmulatedEngine, requests: dict[int, Request], max_seq_len: int = 200
) -> tuple[list[Response], dict[int, Decoding], int, list[int]]:
    """Every request to the end in one stepper: its responses, each request's decoding, then the free pages and
    slots it was left with."""
    stepper = EmulatedStepper(engine, max_seq_len)
    decodings = {request_id: stepper.add(request_id, request) for request_id, request in requests.items()}
    outputs = []
    while stepper.has_work():
        outputs += stepper.step()
    left = len(stepper.blocks.free), sorted(stepper.slots.free)
    stepper.close()
    return outputs, decodings, *left


def test_a_request_the_engine_fails_on_fails_alone(poisoned_tiny, prompts):
    """Sampled, the poisoned prompt makes the engine raise in the step it shares with two others. It ends with the
    cause; the greedy and the sampled request beside it decode exactly as without it (tokens, acceptance, and the
    sampled one's random draws), and every page and slot is free at the end."""
    engine = EmulatedEngine(poisoned_tiny, max_batch_size=3, tokens_per_block=16)
    company = {0: _greedy(prompts[0]), 2: _sampled(prompts[1], 0.8, 7)}
    poisoned = _sampled([*prompts[2][:3], POISONED_TOKEN, *prompts[2][3:]], 1.0, 3)
    clean, alone, *_ = _run(engine, company)
    outputs, decodings, free_pages, free_slots = _run(engine, {0: company[0], 1: poisoned, 2: company[2]})
    failed = [out for out in outputs if out.error is not None]
    assert [(out.request_id, out.tokens, out.final) for out in failed] == [(1, [], True)]
    assert failed[0].error.startswith("the engine failed on this request: EmulationError: gather index out of range")
    together = [(decodings[i].output, decodings[i].acceptance) for i in (0, 2)]
    assert together == [(alone[i].output, alone[i].acceptance) for i in (0, 2)]
    assert [out for out in outputs if out.request_id != 1] == clean
    assert free_pages == len(EmulatedStepper(engine, 200).blocks.free) and free_slots == [0, 1, 2]


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 9.9e-6])
def test_temperatures_too_small_to_invert_decode_greedily(engine, prompts, golden, temperature):
    """Such a request samples at temperature 0 (`sampling_rules.effective_temperature`, applied when its `Sampling`
    is made; the network applies the same rule in-graph): it decodes the golden greedy tokens."""
    stepper = EmulatedStepper(engine, 200)
    stepper.add(0, _sampled(prompts[0], temperature, 5))
    assert sum(_drain(stepper)[0], []) == golden[0]
    stepper.close()


ADD = "add 1537 7993\n"  # its 2nd and 3rd verify steps accept all 16 tokens of a block
ADD_NEW = 9  # so the last step is the 2nd, with one token of budget left and every draft accepted


def test_the_longest_request_reaches_the_last_position(tiny, edited_copy, monkeypatch):
    """`longest_request` is exact: the request's last step accepts all K drafts, so its next draft block ends
    2K = 30 positions past its last token. With exactly that many positions it decodes; with one fewer the
    stepper refuses it at admission, and under the old rule (positions less one block, K + 1) it would have been
    admitted and failed in the engine (alone)."""
    prompt = load_tokenizer(tiny).encode(ADD)
    length = len(prompt) + ADD_NEW
    fits = EmulatedEngine(_positions(edited_copy, tiny, length + 30), max_batch_size=1, tokens_per_block=16)
    assert longest_request(length + 30, fits.k) == length and fits.k == 15
    outputs, decodings, *_ = _run(fits, {0: Request(input_ids=prompt, max_new_tokens=ADD_NEW)}, length)
    assert decodings[0].steps[-1].accepted == fits.k and len(decodings[0].output) == ADD_NEW
    assert all(out.error is None for out in outputs)
    short = EmulatedEngine(_positions(edited_copy, tiny, length + 29), max_batch_size=1, tokens_per_block=16)
    with pytest.raises(DFlashTrtError, match=f"max_seq_len must be in 2..{length - 1} "):
        EmulatedStepper(short, length)
    monkeypatch.setattr(emulated_module, "longest_request", lambda positions, k: positions - (k + 1))
    outputs, *_ = _run(short, {0: Request(input_ids=prompt, max_new_tokens=ADD_NEW)}, length)
    assert (
        outputs[-1].error
        == "the engine failed on this request: EmulationError: a position beyond max_position_embeddings"
    )


def _positions(edited_copy, tiny, positions: int):
    def edit(config: dict) -> None:
        config["max_position_embeddings"] = positions

    return edited_copy(tiny, edit, name=f"positions{positions}")


def test_the_longest_build_runs_the_longest_request_and_stays_in_the_tables(tiny, prompts):
    """An engine built with the longest max_seq_len the tiny pair allows (engine_lengths: 211) runs requests of
    211 + K = 226 tokens (1.2.x's `LlmRequest::validate` on its own max_seq_len 241): exactly the longest request its
    256 positions hold. Every step's draft block starts after the tokens it accepted (the network's count, before
    the budget clips what the request keeps) and spans K + 1 positions; the largest position any layer rotates is the
    last such block's end, inside the table."""
    from dflash_trt.trtllm.engine_lengths import engine_longest_request, longest_buildable

    engine = EmulatedEngine(tiny, max_batch_size=1, tokens_per_block=16)
    runs = engine_longest_request(longest_buildable(engine.facts), engine.k)
    assert (longest_buildable(engine.facts), runs) == (211, longest_request(256, 15))
    with pytest.raises(DFlashTrtError, match="max_seq_len must be in 2..226"):
        EmulatedStepper(engine, runs + 1)
    stepper = EmulatedStepper(engine, runs)
    decoding = stepper.add(0, Request(input_ids=prompts[0][:10], max_new_tokens=runs - 10))
    _drain(stepper)
    stepper.close()
    assert len(decoding.output) == runs - 10
    kept_before = [1 + sum(decoding.acceptance[:i]) for i in range(len(decoding.steps))]  # the first token: context
    block_ends = [
        len(decoding.prompt) + kept - 1 + (step.accepted + 1) + engine.k
        for kept, step in zip(kept_before, decoding.steps, strict=True)
    ]
    assert engine.stats.largest_position == max(block_ends) <= 255


def test_a_draft_tree_engine_runs_the_chains_longest_request(tiny, prompts):
    """A tree of 40 nodes sits at the anchor's position plus its depth (<= K = 15), so its engine holds the chain's
    longest request, 256 - 2K = 226 tokens (not 256 - 2 x 40): the stepper admits exactly that, and decoding it keeps
    every rotated position inside the table, the largest being the last draft block's end."""
    engine = EmulatedEngine(tiny, max_batch_size=1, tokens_per_block=16, draft_tree=40)
    assert (engine.k, engine.depth) == (40, 15)
    with pytest.raises(DFlashTrtError, match="max_seq_len must be in 2..226 "):
        EmulatedStepper(engine, 227)
    stepper = EmulatedStepper(engine, 226)
    decoding = stepper.add(0, Request(input_ids=prompts[0][:10], max_new_tokens=216))
    _drain(stepper)
    stepper.close()
    assert len(decoding.output) == 216
    kept_before = [1 + sum(decoding.acceptance[:i]) for i in range(len(decoding.steps))]
    block_ends = [
        len(decoding.prompt) + kept - 1 + (step.accepted + 1) + engine.depth
        for kept, step in zip(kept_before, decoding.steps, strict=True)
    ]
    assert engine.stats.largest_position == max(block_ends) <= 255


def test_a_step_smaller_than_a_kv_page_is_refused(tiny):
    """Prompt chunks are whole pages: with a step below a page, a prompt longer than a step would never be scheduled
    (the executor would spin without progress), so the engine is refused when it is made."""
    with pytest.raises(DFlashTrtError, match=r"--max_num_tokens 16 is below --tokens_per_block 32"):
        EmulatedEngine(tiny, max_batch_size=1, max_num_tokens=16, tokens_per_block=32)
    EmulatedEngine(tiny, max_batch_size=1, max_num_tokens=32, tokens_per_block=32)
