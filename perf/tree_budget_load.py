"""The tree's node budget by load on the embedded tiny pair: the engine network under the emulated runtime, a draft-tree
engine of 64 nodes with a draft-length schedule whose values are node budgets (draft_schedule.py), against the same
engine without a schedule (a 64-node tree every step) and the chain engine, at a low and a high load.

    python perf/tree_budget_load.py [--prompts N] [--max_new_tokens N] [--schedule 1:64,4:15,8:5] [--loads 1,16]

Each load is the engine's batch slots, every prompt queued at once, so each step holds about that many requests.
Reports per (engine, load, temperature): accepted tokens per step (the bonus included), nodes verified per step
(the runtime's generation length - 1), and how many steps verified trees (more than the block's 15 drafts) and
chains. Not a unit test: a measurement of acceptance on CPU; no speed (the emulation is not the engine's speed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.executors.emulated import decode_batch
from dflash_trt.inputs import DRAFT_LEN_SCHEDULE
from dflash_trt.sampling_rules import Sampling
from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir
from dflash_trt.tokenizer import load_tokenizer

TEMPERATURES = (0.0, 1.0)
NODES = 64


def _run(checkpoint: Path, prompts: list[list[int]], tokens: int, load: int, engine: dict, temperature: float) -> dict:
    """One engine at one load: accepted tokens and nodes per step over every request's verify steps."""
    emulated = EmulatedEngine(checkpoint, max_batch_size=load, **engine)
    sampling = [Sampling(temperature=temperature, seed=s) for s in range(len(prompts))]
    results = decode_batch(emulated, prompts, tokens, sampling=sampling)
    steps = [
        (len(step.draft_ids), accepted)
        for r in results
        for step, accepted in zip(r.steps, r.acceptance_lengths, strict=True)
    ]
    chain = emulated.depth
    return {
        "accepted_per_step": round(sum(a for _, a in steps) / len(steps), 3),
        "nodes_per_step": round(sum(n for n, _ in steps) / len(steps), 2),
        "tree_steps": sum(n > chain for n, _ in steps),
        "chain_steps": sum(n <= chain for n, _ in steps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts")
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--schedule", default="1:64,4:15,8:5", help="the tree engine's node budgets by load")
    parser.add_argument("--loads", default="1,16", help="batch slots (low and high load)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    schedule = DRAFT_LEN_SCHEDULE(args.schedule)
    engines = {
        "chain": {},
        f"tree {NODES}": {"draft_tree": NODES},
        f"tree {NODES}, schedule {schedule.text()}": {"draft_tree": NODES, "draft_len_schedule": schedule},
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "ckpt"
        convert_checkpoint(target_dir(), draft_dir(), checkpoint, dtype="float32")
        tokenizer = load_tokenizer(checkpoint)
        prompts = [tokenizer.encode(p.text) for p in load_heldout(limit=args.prompts)]
        for load in (int(x) for x in args.loads.split(",")):
            for temperature in TEMPERATURES:
                for name, engine in engines.items():
                    run = _run(checkpoint, prompts, args.max_new_tokens, load, engine, temperature)
                    rows.append({"engine": name, "load": load, "temperature": temperature, **run})
                    if not args.json:
                        print(rows[-1], flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
