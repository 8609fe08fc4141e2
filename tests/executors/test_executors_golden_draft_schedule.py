"""The golden in-flight executor under a draft-length schedule: the target's tokens for every request, whenever it
joined, and each generation request verifies the schedule's draft length for the load of the step before."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_trt.executors.contract import Request
from dflash_trt.executors.golden import GoldenStepper
from dflash_trt.inputs import DRAFT_LEN_SCHEDULE
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.tiny.heldout import load_heldout
from dflash_trt.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tiny_prompts(tiny: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny)
    return [tokenizer.encode(item.text) for item in load_heldout(limit=6)]


@pytest.mark.parametrize("text", ["1:2", "2:12,3:5,4:1"])
def test_golden_executor_drafts_by_load_with_requests_joining(tiny: Path, tiny_prompts: list[list[int]], text: str):
    """Each generation request verifies the schedule's draft length for the previous step's load, cut to what its
    budget leaves."""
    schedule = DRAFT_LEN_SCHEDULE(text)
    model = load_golden_model(tiny)
    budgets = [20, 9, 20, 14, 20, 6]
    executor = GoldenStepper(model, 3, 4096, draft_len_schedule=schedule)
    arrivals = {0: [0, 1], 1: [2], 3: [3, 4], 6: [5]}
    produced: dict[int, list[int]] = {i: [] for i in range(len(tiny_prompts))}
    expected_lens, observed_lens, loads, step = [], [], [], 0
    while step <= max(arrivals) or executor.has_work():
        for i in arrivals.get(step, []):
            executor.add(i, Request(input_ids=tiny_prompts[i], max_new_tokens=budgets[i]))
        before = {i: len(tokens) for i, tokens in produced.items()}
        responses = executor.step()
        log = executor.log[-1]
        for response in responses:
            produced[response.request_id] += response.tokens
            if response.request_id in log.context:
                assert response.draft_len is None  # a prefill verifies no drafts
                continue
            observed_lens.append(response.draft_len)
            budget_left = budgets[response.request_id] - before[response.request_id]
            expected_lens.append(min(schedule.draft_len(loads[-1], 15), budget_left))
        loads.append(len(log.context) + len(log.generation))
        step += 1
    alone = speculative_generate(model, tiny_prompts, budgets, block_size=1)
    assert [produced[i] for i in range(len(tiny_prompts))] == [r.output_ids for r in alone]
    assert observed_lens == expected_lens and len(set(observed_lens)) > 1
