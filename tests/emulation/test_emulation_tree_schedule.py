"""A draft-tree engine under a draft-length schedule (draft_schedule.py): the schedule's value for a step's load is
each request's node budget, the chain of that many drafts up to the block's K and the best tree of that many nodes
past it. The network computes the budget in-graph from the step's load, the emulated runtime verifies what it emits,
and the result is the golden tree loop's under the same schedule, token for token and tree for tree, while requests
finishing move the load across the thresholds; with requests joining, the target's own greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _emulation import PROMPTS, STOP, convert, divergences, record_steps
from _pairs import PairVariant

from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.emulated import decode_batch
from dflash_trt.inputs import DRAFT_LEN_SCHEDULE
from dflash_trt.reference.decode import SequenceResult, StepTrace, speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.reference.sampling import SamplingParams
from dflash_trt.sampling_rules import Sampling
from dflash_trt.tiny.heldout import load_heldout
from dflash_trt.tokenizer import load_tokenizer

NEWLINE = 3  # the tiny tokenizer's "\\n": the held-out answers end lines at different steps
NODES = 40  # the engine's tree: at most 40 nodes over the tiny drafter's 15 positions


@pytest.fixture(scope="module")
def prompts(tiny: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny)
    return [tokenizer.encode(p.text) for p in load_heldout(limit=5)]


def _shapes(results: list[SequenceResult]) -> set[tuple[str, int]]:
    """What the steps verified: ("chain", drafts) or ("tree", nodes)."""

    def shape(step: StepTrace) -> tuple[str, int]:
        chain = step.parents is None or step.parents == list(range(len(step.draft_ids)))
        return ("chain" if chain else "tree", len(step.draft_ids))

    return {shape(step) for r in results for step in r.steps}


@pytest.mark.parametrize("temperatures", [[0.0, 0.0, 0.0], [0.0, 0.7, 1.0]], ids=["greedy", "mixed"])
def test_a_tree_engine_under_a_schedule_is_the_golden_loop_while_requests_finish(tiny, prompts, temperatures):
    """Three requests ending on a newline at different steps: 3 in flight verify chains of 3 drafts, 2 chains of
    15, 1 trees of 40 nodes. Every request ends on its stop token far from its budget (the golden loop's K tokens
    longer), so both sides finish requests at the same steps and see the same loads."""
    schedule = DRAFT_LEN_SCHEDULE("1:40,2:15,3:3")
    chosen, seeds, tokens = [prompts[1], prompts[3], prompts[0]], [5, 6, 7], 64
    model = load_golden_model(tiny)
    golden = speculative_generate(
        model,
        chosen,
        tokens + model.draft.spec.num_drafts,
        [NEWLINE],
        [SamplingParams(t) for t in temperatures],
        seeds=seeds,
        draft_tree=NODES,
        draft_len_schedule=schedule,
    )
    engine = EmulatedEngine(tiny, max_batch_size=3, draft_len_schedule=schedule, draft_tree=NODES)
    steps = record_steps(engine)
    sampling = [Sampling(temperature=t, seed=s) for t, s in zip(temperatures, seeds, strict=True)]
    emulated = decode_batch(engine, chosen, tokens, [NEWLINE], sampling=sampling)
    assert all(r.output_ids[-1] == NEWLINE and len(r.output_ids) < tokens for r in emulated)
    assert len({len(r.acceptance_lengths) for r in emulated}) == 3  # the load fell twice
    assert divergences(tiny, golden, emulated, tokens, temperatures) == []
    for step in steps:  # in-graph: every request's next budget is the schedule's for this step's load
        assert step["next"] == [schedule.draft_len(step["load"], NODES)] * step["load"]
    assert {("chain", 3), ("chain", 15), ("tree", NODES)} <= _shapes(emulated)


@pytest.mark.parametrize(("text", "shape"), [("1:5", ("chain", 5)), ("1:24", ("tree", 24))], ids=["chain", "tree"])
def test_sampled_decoding_under_one_budget_is_the_golden_loops(tiny, prompts, text, shape):
    """At T > 0 the engine's samples are the golden loop's token for token, for a budget below the block (a chain
    shorter than the engine's K) and one above it (a tree smaller than the engine's N); the golden loop runs K more
    tokens, so that near its budget it verifies what the engine verifies."""
    schedule = DRAFT_LEN_SCHEDULE(text)
    temperatures, seeds, tokens = [0.9, 0.0, 1.2], [7, 8, 9], 20
    model = load_golden_model(tiny)
    golden = speculative_generate(
        model,
        prompts[:3],
        tokens + model.draft.spec.num_drafts,
        sampling=[SamplingParams(t) for t in temperatures],
        seeds=seeds,
        draft_tree=NODES,
        draft_len_schedule=schedule,
    )
    engine = EmulatedEngine(tiny, max_batch_size=2, draft_len_schedule=schedule, draft_tree=NODES)
    sampling = [Sampling(temperature=t, seed=s) for t, s in zip(temperatures, seeds, strict=True)]
    emulated = decode_batch(engine, prompts[:3], tokens, sampling=sampling)
    assert divergences(tiny, golden, emulated, tokens, temperatures) == []
    assert _shapes(emulated) == {shape}


def test_joining_requests_move_the_budget_and_decoding_stays_the_target(tiny, prompts):
    """Requests arriving over time into 3 slots: each step's budget follows its load in-graph, the runtime verifies
    what the previous step emitted, and the tokens are the target's own greedy decoding."""
    schedule = DRAFT_LEN_SCHEDULE("1:32,2:20,3:6")
    engine = EmulatedEngine(tiny, max_batch_size=3, draft_len_schedule=schedule, draft_tree=NODES)
    steps = record_steps(engine)
    emulated = decode_batch(engine, prompts, 32, arrivals=[0, 1, 1, 3, 6])
    alone = speculative_generate(load_golden_model(tiny), prompts, 32, block_size=1)
    assert [r.output_ids for r in emulated] == [r.output_ids for r in alone]
    for previous, step in zip(steps, steps[1:], strict=False):
        assert step["next"] == [schedule.draft_len(step["load"], NODES)] * step["load"]
        assert {d for d in step["draft_lens"] if d} <= {schedule.draft_len(previous["load"], NODES)}
    assert {("tree", 32), ("tree", 20), ("chain", 6)} <= _shapes(emulated)


def test_a_tree_engines_schedule_is_bounded_by_its_nodes(tiny):
    with pytest.raises(DFlashTrtError, match="verifies 41 drafts per request but the engine verifies at most 40"):
        EmulatedEngine(tiny, draft_len_schedule=DRAFT_LEN_SCHEDULE("2:41"), draft_tree=NODES)
    with pytest.raises(DFlashTrtError, match="the engine verifies at most 15"):
        EmulatedEngine(tiny, draft_len_schedule=DRAFT_LEN_SCHEDULE("2:16"))


@pytest.mark.parametrize(("text", "shape"), [("1:12", ("tree", 12)), ("1:3", ("chain", 3))], ids=["tree", "chain"])
def test_a_random_pairs_tree_engine_under_a_budget_is_the_golden_loop(tmp_path, text, shape):
    """A tied Llama pair with one KV head and a block of 6 (5 draft positions), a 33-node tree engine: a budget of
    12 nodes and one of 3 drafts decode as the golden loop does, tree for tree."""
    ckpt = convert(tmp_path, PairVariant(arch="llama", block_size=6, kv_heads=1, draft_kv_heads=1, tie=True, seed=2))
    schedule = DRAFT_LEN_SCHEDULE(text)
    model = load_golden_model(ckpt)
    k = model.draft.spec.num_drafts
    golden = speculative_generate(model, PROMPTS, 16 + k, STOP, draft_tree=33, draft_len_schedule=schedule)
    engine = EmulatedEngine(ckpt, max_batch_size=3, tokens_per_block=16, draft_len_schedule=schedule, draft_tree=33)
    emulated = decode_batch(engine, PROMPTS, 16, STOP)
    assert divergences(ckpt, golden, emulated, 16) == []
    assert _shapes(emulated) == {shape}
