"""The golden executor under in-flight batching gives every request what `dflash-trt generate` gives it.

Requests of ragged lengths arrive while others run (closed loops of 1..8 users, and Poisson arrivals); the
oracle is `dflash-trt generate` on the same prompt file (the reference loop, all prompts in one batch): same
tokens, same acceptance length at every step. The stepper's own step log shows what was batched.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from dataclasses import replace

import pytest

from dflash_trt.bench.driver import run_load
from dflash_trt.bench.workload import file_workload
from dflash_trt.cli import main
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.executors.golden import GoldenExecutor
from dflash_trt.reference.model import load_golden_model
from dflash_trt.sampling_rules import Sampling
from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir
from dflash_trt.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow
MAX_NEW = 48  # some answers end before it (stop token), others meet it (the last block shrinks)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_golden")
    checkpoint = root / "ckpt"
    convert_checkpoint(target_dir(), draft_dir(), checkpoint, dtype="float32")
    tokenizer = load_tokenizer(checkpoint)
    prompts = [tokenizer.encode(p.text) for p in load_heldout(limit=10)]
    # Ragged: whole prompts (high acceptance) and cut ones of 3..10 tokens (low acceptance, early stops).
    prompts = [p if i % 2 == 0 else p[: 3 + i % 8] for i, p in enumerate(prompts)]
    prompt_file = root / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    return checkpoint, prompt_file, load_golden_model(checkpoint)


@pytest.fixture(scope="module")
def generated(setup):
    checkpoint, prompt_file, _ = setup
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert (
            main(
                [
                    "generate",
                    "--checkpoint_dir",
                    str(checkpoint),
                    "--input_file",
                    str(prompt_file),
                    "--max_new_tokens",
                    str(MAX_NEW),
                    "--json",
                ]
            )
            == 0
        )
    return json.loads(out.getvalue())["sequences"]


def _run(model, workload, block_size=None, **load):
    executor = GoldenExecutor(
        model,
        load.get("concurrency") or 8,
        workload.max_seq_len,
        block_size=block_size,
        stop_token_ids=list(model.target.spec.eos_token_ids),
    )
    trace = asyncio.run(run_load(executor, workload.requests, **load))
    return trace, executor.stepper.log


@pytest.mark.parametrize(
    "load",
    [{"concurrency": 1}, {"concurrency": 4}, {"concurrency": 8}, {"request_rate": 400.0}],
    ids=lambda d: "-".join(f"{k}{v:g}" for k, v in d.items()),
)
def test_in_flight_batching_equals_generate(setup, generated, load):
    _, prompt_file, model = setup
    workload = file_workload(prompt_file, MAX_NEW)
    started = time.perf_counter()
    trace, log = _run(model, workload, **load)
    assert 0 < trace.duration_s <= time.perf_counter() - started  # throughput divides by the load's wall time
    assert all(r.error is None for r in trace.records)
    for record in trace.records:
        expected = generated[record.prompt_index]
        assert record.output_ids == expected["output_ids"], record.prompt_index
        assert record.chunks[0] == 1  # the context step yields the first token
        assert record.chunks[1:] == expected["acceptance_lengths"], record.prompt_index
    concurrency = load.get("concurrency")
    if concurrency:
        assert max(n for _, n in trace.in_flight) == concurrency
        assert max(len(s.context) + len(s.generation) for s in log) == concurrency
    if concurrency != 1:
        # Requests joined while others were generating: context and generation requests in one step.
        assert any(s.context and s.generation for s in log)
    # Budget-clipped final steps and early stops happened in this workload (the cases worth checking).
    assert any(len(s["output_ids"]) == MAX_NEW for s in generated)
    assert any(len(s["output_ids"]) < MAX_NEW for s in generated)


def test_target_alone_gives_the_same_tokens_one_per_iteration(setup, generated):
    _, prompt_file, model = setup
    workload = file_workload(prompt_file, MAX_NEW)
    trace, _ = _run(model, workload, block_size=1, concurrency=4)
    for record in trace.records:
        assert record.output_ids == generated[record.prompt_index]["output_ids"]
        assert set(record.chunks) == {1}
    # DFlash needs fewer iterations than the target alone for the same tokens (acceptance > 1).
    spec, _ = _run(model, workload, concurrency=4)
    assert sum(len(r.chunks) for r in spec.records) < sum(len(r.chunks) for r in trace.records)


def test_requests_beyond_the_budget_fail_alone(setup):
    _, prompt_file, model = setup
    workload = file_workload(prompt_file, MAX_NEW)
    executor = GoldenExecutor(model, 2, 8, stop_token_ids=[])  # max_seq_len 8: long prompts cannot fit
    trace = asyncio.run(run_load(executor, workload.requests[:4], concurrency=2))
    failed = [r for r in trace.records if r.error]
    assert failed and all("exceeds" in r.error for r in failed)
    assert all(r.output_ids for r in trace.records if not r.error)


def test_temperatures_too_small_to_invert_are_greedy_and_others_refused(setup, generated):
    """The golden executor decodes greedily only: 1e-40 is greedy (sampling_rules), 0.5 is refused for the request."""
    _, prompt_file, model = setup
    first = file_workload(prompt_file, MAX_NEW).requests[:3]
    at = (1e-40, 0.5, 9e-6)
    requests = [replace(r, sampling=Sampling(temperature=t)) for r, t in zip(first, at, strict=True)]
    executor = GoldenExecutor(model, 3, 256, stop_token_ids=list(model.target.spec.eos_token_ids))
    trace = asyncio.run(run_load(executor, requests, concurrency=3))
    records = sorted(trace.records, key=lambda r: r.prompt_index)
    assert records[1].error.startswith("the golden executor decodes greedily (temperature below 1e-05)")
    assert [records[i].output_ids for i in (0, 2)] == [generated[i]["output_ids"] for i in (0, 2)]
