"""Golden-model decoding speed on the embedded tiny pair: DFlash vs target-only decoding, same prompts, same run.

Not a unit test: a benchmark for `make bench` (protocol in perf/bench_all.py). The ratio that matters is
tokens/s of speculative decoding over tokens/s of block-size-1 decoding with the same golden model, which is what
acceptance buys on hardware where a verify step of B tokens costs about as much as one token (true of the GPU
engine; on a CPU the block costs more, so this ratio understates the GPU speedup).
"""

from __future__ import annotations

import json
import sys
import time

import torch
from tiny_golden import tiny_golden  # perf/tiny_golden.py

from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.stats import mean_acceptance_length

MAX_NEW_TOKENS = 96
REPEATS = 3


def _best_rate(model, prompts, stop_ids, block_size=None) -> tuple[float, list]:
    best, results = 0.0, []
    for _ in range(REPEATS):
        started = time.perf_counter()
        results = speculative_generate(model, prompts, MAX_NEW_TOKENS, stop_ids, block_size=block_size)
        rate = sum(len(r.output_ids) for r in results) / (time.perf_counter() - started)
        best = max(best, rate)
    return best, results


def main() -> int:
    torch.set_num_threads(1)
    model, heldout = tiny_golden(16)
    stop_ids = list(model.target.spec.eos_token_ids)
    ratios, details = {}, {}
    for batch in (1, 8):
        prompts = heldout[:batch]
        spec_rate, spec = _best_rate(model, prompts, stop_ids)
        ar_rate, ar = _best_rate(model, prompts, stop_ids, block_size=1)
        if [r.output_ids for r in spec] != [r.output_ids for r in ar]:
            print("speculative output differs from target-only output", file=sys.stderr)
            return 1
        ratios[f"dflash_tok_s_vs_target_only_tok_s_batch{batch}"] = round(spec_rate / ar_rate, 3)
        details[f"batch{batch}"] = {
            "dflash_tok_s": round(spec_rate, 1),
            "target_only_tok_s": round(ar_rate, 1),
            "mean_acceptance_length": round(mean_acceptance_length(spec), 3),
        }
    print(json.dumps({"name": "decode", "ratios": ratios, "details": details}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
