"""Decoding under a draft-length schedule on the CPU: the golden in-flight executor (what `bench --checkpoint_dir`
runs) on the embedded tiny pair, the full draft against a schedule that shortens it with the load, at several
concurrencies, with the target alone as the same run's baseline.

Not a unit test: a benchmark for `make bench` (protocol in perf/bench_all.py). Ratios: throughput under the schedule
over throughput with the full draft (`none`), and each over the target alone, at each concurrency; the details
hold tok/s, tokens per generation iteration and mean drafts verified. A CPU prices a verified token as compute at
every batch, where a GPU's step is bound by reading the weights at small batches, so these ratios say what the
schedule does to the work, not the GPU speed-up the planner predicts (docs/performance.md §3.8).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from dflash_trt.bench.measure import measure_point
from dflash_trt.bench.results import BenchPoint
from dflash_trt.bench.targets import Target, executor_factory
from dflash_trt.bench.workload import Workload
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.decoding_modes import AR, DFLASH
from dflash_trt.executors.contract import Request
from dflash_trt.inputs import DRAFT_LEN_SCHEDULE
from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir
from dflash_trt.tokenizer import load_tokenizer

CONCURRENCIES = (1, 4, 16)
SCHEDULE = "4:7,16:3"  # with 4 requests in a step draft 7, with 16 draft 3; below 4 the full 15
MAX_NEW_TOKENS = 64
PROMPTS = 16
REPEATS = 2


def _best(target: Target, workload: Workload, concurrency: int) -> BenchPoint:
    """The faster of REPEATS runs (a shared CPU's noise only ever slows a run down)."""
    factory = executor_factory(target, workload)
    runs = [measure_point(factory, workload, target.mode, concurrency=concurrency) for _ in range(REPEATS)]
    return max(runs, key=lambda p: p.throughput_tok_s)


def _details(point: BenchPoint) -> dict[str, float | None]:
    drafts = [d for r in point.per_request for d in r.draft_lens or []]
    return {
        "tok_s": round(point.throughput_tok_s, 1),
        "tokens_per_iteration": None if point.acceptance_length is None else round(point.acceptance_length, 3),
        "mean_drafts_verified": round(sum(drafts) / len(drafts), 2) if drafts else None,
    }


def main() -> int:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = Path(scratch) / "checkpoint"
        convert_checkpoint(target_dir(), draft_dir(), checkpoint, dtype="float32")
        tokenizer = load_tokenizer(checkpoint)
        prompts = [tokenizer.encode(p.text) for p in load_heldout(limit=PROMPTS)]
        requests = [Request(input_ids=p, max_new_tokens=MAX_NEW_TOKENS) for p in prompts]
        workload = Workload(requests, ignore_eos=True, description={"kind": "held-out", "count": len(requests)})
        targets = {
            "none": Target(DFLASH, checkpoint_dir=str(checkpoint)),
            SCHEDULE: Target(DFLASH, checkpoint_dir=str(checkpoint), draft_len_schedule=DRAFT_LEN_SCHEDULE(SCHEDULE)),
            "target_alone": Target(AR, checkpoint_dir=str(checkpoint)),
        }
        ratios, details = {}, {}
        for concurrency in CONCURRENCIES:
            points = {name: _best(target, workload, concurrency) for name, target in targets.items()}
            outputs = {name: [r.output_ids for r in p.per_request] for name, p in points.items()}
            if not outputs["none"] == outputs[SCHEDULE] == outputs["target_alone"]:
                print(f"concurrency {concurrency}: the outputs differ between schedules", file=sys.stderr)
                return 1
            rate = {name: p.throughput_tok_s for name, p in points.items()}
            ratios[f"schedule_tok_s_vs_full_draft_tok_s_c{concurrency}"] = round(rate[SCHEDULE] / rate["none"], 3)
            ratios[f"full_draft_tok_s_vs_target_alone_c{concurrency}"] = round(rate["none"] / rate["target_alone"], 3)
            ratios[f"schedule_tok_s_vs_target_alone_c{concurrency}"] = round(rate[SCHEDULE] / rate["target_alone"], 3)
            details[f"c{concurrency}"] = {name: _details(p) for name, p in points.items()}
    print(json.dumps({"name": "draft_schedule", "schedule": SCHEDULE, "ratios": ratios, "details": details}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
