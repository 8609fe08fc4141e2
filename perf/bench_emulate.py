"""Emulated engine decoding speed on the embedded tiny pair vs the golden model (`generate`), same prompts, same run;
and the emulation at tp 4 (four rank networks in lockstep, `emulation/ranks.py`) vs at tp 1.

Protocol: perf/bench_all.py. The emulation executes the engine network op by op under the stand-in TensorRT-LLM
(paged KV reads and writes, the runtime's packing, per-request attention), so it is slower than the golden model's
batched tensors; this measures by how much, and checks that all three produce the same tokens.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.executors.emulated import decode_batch
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.reference.stats import mean_acceptance_length
from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir
from dflash_trt.tokenizer import load_tokenizer

MAX_NEW_TOKENS = 64
PROMPTS = 8
REPEATS = 2
TP = 4


def _best(run) -> tuple[float, list]:
    best, results = 0.0, []
    for _ in range(REPEATS):
        started = time.perf_counter()
        results = run()
        best = max(best, sum(len(r.output_ids) for r in results) / (time.perf_counter() - started))
    return best, results


def main() -> int:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint, sharded = Path(scratch) / "checkpoint", Path(scratch) / f"checkpoint-tp{TP}"
        convert_checkpoint(target_dir(), draft_dir(), checkpoint, dtype="float32")
        convert_checkpoint(target_dir(), draft_dir(), sharded, dtype="float32", tp_size=TP)
        golden = load_golden_model(checkpoint)
        runtime = EmulatedEngine(checkpoint, max_batch_size=PROMPTS, tokens_per_block=32)
        ranks = EmulatedEngine(sharded, max_batch_size=PROMPTS, tokens_per_block=32)
        prompts = [load_tokenizer(checkpoint).encode(p.text) for p in load_heldout(limit=PROMPTS)]
    stops = list(golden.target.spec.eos_token_ids)
    golden_rate, expected = _best(lambda: speculative_generate(golden, prompts, MAX_NEW_TOKENS, stops))
    emulated_rate, emulated = _best(lambda: decode_batch(runtime, prompts, MAX_NEW_TOKENS, stops))
    ranks_rate, emulated_ranks = _best(lambda: decode_batch(ranks, prompts, MAX_NEW_TOKENS, stops))
    for label, results in (("tp 1", emulated), (f"tp {TP}", emulated_ranks)):
        if [r.output_ids for r in results] != [r.output_ids for r in expected]:
            print(f"the emulated engine's tokens at {label} differ from the golden model's", file=sys.stderr)
            return 1
    print(
        json.dumps(
            {
                "name": "emulate",
                "ratios": {
                    "emulated_tok_s_vs_golden_tok_s": round(emulated_rate / golden_rate, 3),
                    f"emulated_tp{TP}_tok_s_vs_tp1_tok_s": round(ranks_rate / emulated_rate, 3),
                },
                "details": {
                    "emulated_tok_s": round(emulated_rate, 1),
                    f"emulated_tp{TP}_tok_s": round(ranks_rate, 1),
                    "golden_tok_s": round(golden_rate, 1),
                    "engine_steps": runtime.stats.steps // REPEATS,
                    "prompts": PROMPTS,
                    "mean_acceptance_length": round(mean_acceptance_length(emulated), 3),
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
