"""The golden loop under a draft-length schedule: lossless at T = 0, each step's draft length the schedule's for
the previous step's load, cut to what the output budget leaves."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_trt.draft_schedule import DraftLenSchedule
from dflash_trt.inputs import DRAFT_LEN_SCHEDULE
from dflash_trt.reference.decode import SequenceResult, speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.tiny.heldout import load_heldout
from dflash_trt.tokenizer import load_tokenizer


def _expected_counts(results: list[SequenceResult], budgets: list[int], schedule: DraftLenSchedule, k: int) -> list:
    """Every step's verified-draft count as the schedule sets it: its length for the number of sequences that took
    part in the previous step (the prefill counts them all), cut to what each output budget leaves."""
    out = []
    for r, budget in zip(results, budgets, strict=True):
        produced = 1  # the prefill's first token
        for step in range(len(r.steps)):
            load = len(results) if step == 0 else sum(len(o.steps) >= step for o in results)
            out.append(min(schedule.draft_len(load, k), budget - produced))
            produced += r.acceptance_lengths[step]
    return out


@pytest.fixture(scope="module")
def tiny_prompts(tiny: Path) -> list[list[int]]:
    """Held-out prompts of the trained tiny pair (long accepted runs), whole and cut short (early rejections)."""
    tokenizer = load_tokenizer(tiny)
    prompts = [tokenizer.encode(p.text) for p in load_heldout(limit=6)]
    return [p if i % 2 == 0 else p[: 3 + i] for i, p in enumerate(prompts)]


@pytest.mark.parametrize("text", ["1:1", "1:4", "3:6,5:2", "2:15,4:9,6:1"])
def test_golden_loop_under_a_schedule_is_the_target_alone(tiny: Path, tiny_prompts: list[list[int]], text: str):
    """Greedy decoding under any schedule gives the target's own tokens; each step verifies the schedule's draft
    length for the previous step's load, which falls as the ragged budgets end sequences."""
    model = load_golden_model(tiny)
    budgets = [40, 8, 25, 3, 33, 17]
    schedule = DRAFT_LEN_SCHEDULE(text)
    alone = speculative_generate(model, tiny_prompts, budgets, block_size=1)
    scheduled = speculative_generate(model, tiny_prompts, budgets, draft_len_schedule=schedule)
    assert [r.output_ids for r in scheduled] == [r.output_ids for r in alone]
    observed = [len(trace.draft_ids) for r in scheduled for trace in r.steps]
    k = model.draft.spec.block_size - 1
    assert observed == _expected_counts(scheduled, budgets, schedule, k)
    fixed = speculative_generate(model, tiny_prompts, budgets)
    assert sum(len(r.steps) for r in fixed) < sum(len(r.steps) for r in scheduled)  # shorter drafts: more steps
