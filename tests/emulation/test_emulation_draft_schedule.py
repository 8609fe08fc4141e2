"""The engine network under a draft-length schedule, run by the emulated EAGLE runtime: each step's
`next_draft_lens` is the schedule's for the step's load, the runtime feeds them back as the next step's draft
lengths (variable generation lengths, packed masks and position offsets per request), and decoding stays exact:
the target's tokens at T = 0 with requests joining mid-flight and prompts chunked, the golden loop's samples at
T > 0, and the target's law in a chi-square test while the load (and with it the draft length) moves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _emulation import divergences, record_steps
from _pairs import PairVariant, make_pair
from scipy.stats import chisquare

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.executors.contract import Request
from dflash_trt.executors.emulated import EmulatedStepper, decode_batch
from dflash_trt.inputs import DRAFT_LEN_SCHEDULE
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.reference.sampling import SamplingParams
from dflash_trt.sampling_rules import Sampling
from dflash_trt.tiny.heldout import load_heldout
from dflash_trt.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tiny_prompts(tiny: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny)
    texts = [item.text for item in load_heldout(limit=12)]
    # Whole held-out problems (long accepted runs) and two long joined prompts that a small max_num_tokens chunks.
    return [tokenizer.encode(t) for t in texts[:4]] + [
        sum((tokenizer.encode(t) for t in texts[i : i + 4]), []) for i in (4, 8)
    ]


@pytest.mark.parametrize("text", ["1:3", "2:11,3:2", "3:1"])
def test_the_network_drafts_by_load_and_stays_the_target(tiny: Path, tiny_prompts: list[list[int]], text: str):
    schedule = DRAFT_LEN_SCHEDULE(text)
    engine = EmulatedEngine(tiny, max_batch_size=3, max_num_tokens=48, tokens_per_block=16, draft_len_schedule=schedule)
    steps = record_steps(engine)
    emulated = decode_batch(engine, tiny_prompts, 20, arrivals=[0, 0, 1, 4, 4, 9])
    alone = speculative_generate(load_golden_model(tiny), tiny_prompts, 20, block_size=1)
    assert [r.output_ids for r in emulated] == [r.output_ids for r in alone]
    k = engine.k
    for previous, step in zip(steps, steps[1:], strict=False):
        # In-graph: every request's next draft length is the schedule's for this step's load.
        assert step["next"] == [schedule.draft_len(step["load"], k)] * step["load"]
        # The runtime: a generation request verifies what the previous step told it (context requests read 0).
        assert {d for d in step["draft_lens"] if d} <= {schedule.draft_len(previous["load"], k)}
    verified = [len(s.draft_ids) for r in emulated for s in r.steps]
    assert set(verified) <= {schedule.draft_len(load, k) for load in range(1, 4)}
    assert engine.stats.context_chunks > len(tiny_prompts)  # long prompts were chunked
    if text != "1:3":
        assert len(set(verified)) > 1  # the load moved the draft length


def test_sampled_decoding_under_a_short_draft_is_the_golden_loops(tiny: Path, tiny_prompts: list[list[int]]):
    """At T > 0 the engine's samples are the golden loop's, token for token, when both verify 4 drafts a step
    (the golden loop run K tokens further, so that near its budget it verifies what the engine verifies)."""
    schedule = DRAFT_LEN_SCHEDULE("1:4")
    prompts, tokens, k = tiny_prompts[:4], 20, 15
    temperatures = [0.0, 0.8, 1.2, 0.6]
    seeds = [7, 8, 9, 10]
    golden = speculative_generate(
        load_golden_model(tiny),
        prompts,
        tokens + k,
        sampling=[SamplingParams(t) for t in temperatures],
        seeds=seeds,
        draft_len_schedule=schedule,
    )
    engine = EmulatedEngine(tiny, max_batch_size=2, draft_len_schedule=schedule)
    sampling = [Sampling(temperature=t, seed=s) for t, s in zip(temperatures, seeds, strict=True)]
    emulated = decode_batch(engine, prompts, tokens, sampling=sampling)
    assert divergences(tiny, golden, emulated, tokens, temperatures) == []
    assert {len(s.draft_ids) for r in emulated for s in r.steps} == {4}


VOCAB, PROMPT = 8, [3, 5, 7]


@pytest.mark.slow
@pytest.mark.parametrize(("text", "nodes"), [("1:2,24:1", None), ("1:5,24:1", 5)], ids=["chain", "tree-budget-by-load"])
def test_sampled_tokens_follow_the_target_law_while_the_load_moves(tmp_path: Path, text: str, nodes: int | None):
    """Thousands of 3-token continuations through the emulated engine, arriving in waves so that the batch (and
    with it the schedule's draft length, 2 or 1 of a 2-draft block; on a 5-node tree engine its node budget, a tree
    of 5 or the chain of 1) keeps changing; the target's exact law from its own conditionals, in float64."""
    target_dir, draft_dir = make_pair(
        tmp_path, PairVariant(vocab=VOCAB, block_size=3, init_std=0.15, taps=[1, 3], seed=3)
    )
    convert_checkpoint(target_dir, draft_dir, tmp_path / "ckpt", dtype="float32")
    model = load_golden_model(tmp_path / "ckpt")
    samples, temperature = 2400, 0.8
    schedule = DRAFT_LEN_SCHEDULE(text)
    engine = EmulatedEngine(tmp_path / "ckpt", max_batch_size=48, draft_len_schedule=schedule, draft_tree=nodes)
    steps = record_steps(engine)
    # Waves of 40 and of 8 requests, 4 steps apart: the load swings across the 24-request threshold.
    waves = [40 if g % 2 == 0 else 8 for g in range(2 * samples // 48)]
    arrivals = [4 * g for g, size in enumerate(waves) for _ in range(size)]
    sampling = [Sampling(temperature=temperature, seed=s) for s in range(samples)]
    results = decode_batch(engine, [PROMPT] * samples, 3, [], arrivals=arrivals, sampling=sampling)
    assert {schedule.draft_len(s["load"], nodes or 2) for s in steps} == {1, nodes or 2}
    counts = torch.zeros(VOCAB**3)
    for r in results:
        a, b, c = r.output_ids
        counts[(a * VOCAB + b) * VOCAB + c] += 1
    continuations = [(a, b, c) for a in range(VOCAB) for b in range(VOCAB) for c in range(VOCAB)]
    tokens = torch.tensor([PROMPT + [a, b] for a, b, _ in continuations])
    cache = model.target.new_cache(len(tokens), tokens.shape[1] + 1)
    positions = torch.arange(tokens.shape[1]).expand(len(tokens), -1)
    logits, _ = model.target.forward(tokens, positions, torch.ones_like(tokens, dtype=torch.bool), cache)
    probs = torch.softmax(logits[:, len(PROMPT) - 1 :].double() / temperature, dim=-1)
    chosen = torch.tensor(continuations)[:, :, None]
    law = probs.gather(-1, chosen)[:, :, 0].prod(dim=1)
    expected = law * samples
    big = expected >= 5
    observed, wanted = counts[big], expected[big]
    observed = torch.cat([observed, counts[~big].sum()[None]])
    wanted = torch.cat([wanted, expected[~big].sum()[None]])
    assert chisquare(observed.numpy(), wanted.numpy() * samples / float(wanted.sum())).pvalue > 1e-3


def test_each_response_names_the_drafts_its_iteration_verified(tiny: Path, tiny_prompts: list[list[int]]):
    """The stepper's responses carry what `bench` records per iteration: none for the prefill, then the schedule's
    draft length for the previous step's load (here 3 requests, then 2 as the short budget ends one)."""
    schedule = DRAFT_LEN_SCHEDULE("2:5,3:2")
    engine = EmulatedEngine(tiny, max_batch_size=3, draft_len_schedule=schedule)
    stepper = EmulatedStepper(engine, 200)
    budgets = [24, 3, 24]
    decodings = [stepper.add(i, Request(input_ids=tiny_prompts[i], max_new_tokens=n)) for i, n in enumerate(budgets)]
    reported: dict[int, list[int | None]] = {i: [] for i in range(3)}
    loads = []
    while stepper.has_work():
        loads.append(len(stepper.active) + len(stepper.waiting))
        for response in stepper.step():
            reported[response.request_id].append(response.draft_len)
    stepper.close()
    assert loads[:2] == [3, 3] and 2 in loads
    for i, decoding in enumerate(decodings):
        verified = [len(trace.draft_ids) for trace in decoding.steps]
        assert reported[i] == [None, *verified]
        assert set(verified) <= {2, 5}
    assert {d for i in (0, 2) for d in reported[i][1:]} == {2, 5}
