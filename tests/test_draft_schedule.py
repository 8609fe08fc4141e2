"""The draft-length schedule: its one parsing rule, its meaning, the golden loop under it (lossless at T = 0, each
step's draft length the schedule's for the previous step's load), and `auto` as the planner derives it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dflash_trt.draft_schedule import AUTO, FIXED, DraftLenSchedule
from dflash_trt.errors import DFlashTrtError
from dflash_trt.inputs import DRAFT_LEN_SCHEDULE
from dflash_trt.reference.decode import SequenceResult, speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.tiny.heldout import load_heldout
from dflash_trt.tokenizer import load_tokenizer

RULE = DRAFT_LEN_SCHEDULE.describe()


@pytest.mark.parametrize(
    "text, steps",
    [
        ("none", ()),
        (" 1:15,16:7,64:3 ", ((1, 15), (16, 7), (64, 3))),
        ("8:3", ((8, 3),)),
        ("2:5, 4:5", ((2, 5), (4, 5))),  # equal draft lengths are allowed, rising ones are not
    ],
)
def test_tables_and_none_parse_to_their_steps(text: str, steps: tuple):
    assert DRAFT_LEN_SCHEDULE(text) == DraftLenSchedule(steps)
    assert DRAFT_LEN_SCHEDULE("auto") == AUTO


@pytest.mark.parametrize(
    "text",
    ["", "1", "1:", ":3", "1:3,", "16:7,1:15", "1:3,1:2", "1:3,8:4", "0:3", "1:0", "-1:3", "1:3:4", "a:b", "1:²",
     "AUTO", "1:2147483648", ",".join(f"{n}:1" for n in range(1, 66))],
)  # fmt: skip
def test_bad_tables_are_refused_in_one_message_style(text: str):
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be auto, none or N1:K1,N2:K2"):
        DRAFT_LEN_SCHEDULE(text)
    with pytest.raises(DFlashTrtError) as refused:
        DRAFT_LEN_SCHEDULE.check(text, "engine.draft_len_schedule")
    assert str(refused.value).startswith(f"engine.draft_len_schedule must be {RULE}, got ")
    with pytest.raises(DFlashTrtError):
        DRAFT_LEN_SCHEDULE.check(3, "engine.draft_len_schedule")  # a YAML number is not a table


def test_a_schedule_names_the_draft_length_of_each_load():
    schedule = DraftLenSchedule(((2, 9), (5, 4), (9, 1)))
    got = [schedule.draft_len(load, 15) for load in range(1, 12)]
    assert got == [15, 9, 9, 9, 4, 4, 4, 4, 1, 1, 1]  # below the first threshold: the full draft
    assert [FIXED.draft_len(load, 7) for load in (1, 100)] == [7, 7]
    assert schedule.text() == "2:9,5:4,9:1" and FIXED.text() == "none"
    assert schedule.fitted_to(9) is schedule
    with pytest.raises(DFlashTrtError, match=r"drafts 9 tokens but the drafter proposes at most block_size - 1 = 7"):
        schedule.fitted_to(7)


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
