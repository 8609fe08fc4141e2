"""The emulated engine request by request (`emulation/executor.py`, `bench/backends/emulated.py`): what a server
sees. Oracles: the golden loop (`speculative_generate`) on each prompt alone for greedy tokens, and the emulated
engine decoding the same request alone for sampled ones (a request's tokens may not depend on what else is in
flight); cancelled requests give their slot and pages back."""

from __future__ import annotations

import asyncio

import pytest

from dflash_trt.bench.backends.emulated import EmulatedBackend
from dflash_trt.bench.driver import BenchRequest, run_load
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.executor import EmulatedExecutor, Request
from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.tiny.heldout import load_heldout
from dflash_trt.tokenizer import load_tokenizer

MAX_NEW = 20
# The tiny pair's longest max_seq_len: its 256 RoPE rows minus the 3K positions an engine uses past it (K = 15).
LONGEST = 256 - 3 * 15


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
    trace = asyncio.run(run_load(EmulatedBackend(engine, LONGEST), requests, concurrency=2, timeout_s=600))
    for record in trace.records:
        assert record.error is None
        assert record.output_ids == golden[record.prompt_index]
        assert record.chunks[0] == 1  # the context step answers with the first token alone
        assert sum(record.chunks) == MAX_NEW and max(record.chunks) > 1


def test_a_cancelled_request_frees_its_slot_and_pages(engine, prompts, golden):
    executor = EmulatedExecutor(engine, LONGEST)
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
    alone = EmulatedExecutor(engine, LONGEST)
    alone.add(Request(0, prompts[1], MAX_NEW, temperature=0.8, seed=7))
    expected = sum(_drain(alone)[0], [])
    alone.close()
    busy = EmulatedExecutor(engine, LONGEST)
    busy.add(Request(5, prompts[0], MAX_NEW, temperature=1.1, seed=3))
    busy.step()
    busy.add(Request(6, prompts[1], MAX_NEW, temperature=0.8, seed=7))
    assert sum(_drain(busy)[6], []) == expected
    busy.close()


def test_requests_the_engine_cannot_take_are_refused_and_budgets_clipped(engine):
    """1.2.x's `LlmRequest::validate` on an engine built with max_seq_len 32 (its own: 32 + 2K = 62, K = 15): prompts
    up to 61 tokens (chunked context), the output clipped so that prompt + output + K <= 62."""
    executor = EmulatedExecutor(engine, 32)
    with pytest.raises(DFlashTrtError, match="62 tokens exceed the engine's maximum input length 61"):
        executor.add(Request(0, [5] * 62, 1))
    with pytest.raises(DFlashTrtError, match="47 tokens leave no output within the engine's max_seq_len 62"):
        executor.add(Request(0, [5] * 47, 1))
    edge = Request(0, [5] * 46, 1)
    executor.add(edge)
    clipped = Request(1, [5] * 20, 100)
    executor.add(clipped)
    assert (edge.max_new_tokens, clipped.max_new_tokens) == (1, 62 - 20 - 15)
    with pytest.raises(DFlashTrtError, match="outside the vocabulary"):
        executor.add(Request(1, [engine.vocab_size], 4))
    with pytest.raises(DFlashTrtError, match="temperature"):
        executor.add(Request(2, [5, 6], 4, temperature=-1.0))
    executor.close()


def test_requests_at_the_admission_edge_stay_within_the_rope_tables(tiny, prompts):
    """The longest engine the tiny pair builds with (max_seq_len 211, its own 241) takes a request as far as 1.2.x's
    executor admits it: prompt + output = 241 - K. Every step's draft block starts after the tokens it accepted (the
    network's count, before the budget clips what the request keeps) and spans K + 1 positions; the largest position
    any layer rotates to is the last such block's end, and the bound keeps it within the 256 RoPE rows."""
    engine = EmulatedEngine(tiny, max_batch_size=1, tokens_per_block=16)
    executor = EmulatedExecutor(engine, LONGEST)
    request = Request(0, prompts[0][:10], 10_000)
    executor.add(request)
    assert len(request.prompt) + request.max_new_tokens == LONGEST + 15  # clipped as the runtime clips it
    _drain(executor)
    executor.close()
    assert len(request.output) == request.max_new_tokens
    kept_before = [1 + sum(request.acceptance[:i]) for i in range(len(request.steps))]  # the first token: context
    block_ends = [
        len(request.prompt) + kept - 1 + (step.accepted + 1) + 15
        for kept, step in zip(kept_before, request.steps, strict=True)
    ]
    assert engine.stats.largest_position == max(block_ends) <= 255


def test_a_max_seq_len_past_the_rope_tables_is_refused_and_would_read_past_them(tiny, prompts, monkeypatch):
    """One position more and the executor refuses to start, as `build` refuses the engine. Without the bound, an
    engine built with max_seq_len == max_position_embeddings (what `build` allowed before) reaches past the table as
    soon as a request uses the output budget the runtime grants (the stand-in, unlike the kernel, refuses to read
    there)."""
    from dflash_trt.emulation import executor as executor_module
    from dflash_trt.emulation.functional import EmulationError

    engine = EmulatedEngine(tiny, max_batch_size=1, tokens_per_block=16)
    with pytest.raises(DFlashTrtError, match="--max_seq_len <= 211"):
        EmulatedExecutor(engine, LONGEST + 1)
    monkeypatch.setattr(executor_module, "check_positions", lambda facts, max_seq_len: None)
    executor = EmulatedExecutor(engine, 256)
    executor.add(Request(0, prompts[0][:10], 10_000))
    with pytest.raises(EmulationError, match="beyond the 256 rows of the RoPE table"):
        _drain(executor)
    executor.close()
