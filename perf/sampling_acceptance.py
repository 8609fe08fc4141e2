"""What sampling costs in acceptance: mean acceptance length of the embedded tiny pair at T = 0, 0.6 and 1.0 under
the engine's rule (argmax drafts, exact-match sampled verification) and the reference's (sampled drafts, rejection
sampling). Table in docs/engine.md §6.

    python perf/sampling_acceptance.py [--prompts N] [--max_new_tokens N] [--seeds N] [--json]

Not a unit test: the same held-out prompts decoded by the golden model for every (rule, temperature), each sampled
setting over several seeds; acceptance length counts the bonus token (max = block size).
"""

from __future__ import annotations

import argparse
import json
import sys

from tiny_golden import tiny_golden  # perf/tiny_golden.py

from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.sampling import SamplingParams
from dflash_trt.reference.stats import mean_acceptance_length
from dflash_trt.sampling_rules import ENGINE, REFERENCE

TEMPERATURES = (0.0, 0.6, 1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts, decoded as one batch")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=3, help="runs per sampled setting")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    model, prompts = tiny_golden(args.prompts)
    stop_ids = list(model.target.spec.eos_token_ids)
    rows = []
    for method in (ENGINE, REFERENCE):
        for temperature in TEMPERATURES:
            runs = 1 if temperature == 0 else args.seeds
            results = []
            for seed in range(runs):
                params = SamplingParams(temperature, method=method)
                results += speculative_generate(model, prompts, args.max_new_tokens, stop_ids, params, seed=1000 * seed)
            rows.append(
                {
                    "sampling": method,
                    "temperature": temperature,
                    "mean_acceptance_length": round(mean_acceptance_length(results), 3),
                    "steps": sum(len(r.acceptance_lengths) for r in results),
                }
            )
    if args.json:
        print(json.dumps({"block_size": model.draft.spec.block_size, "prompts": len(prompts), "rows": rows}))
        return 0
    print(
        f"block size {model.draft.spec.block_size}, {len(prompts)} held-out prompts, "
        f"{args.max_new_tokens} new tokens, {args.seeds} seeds per sampled setting"
    )
    print("| sampling | T | mean acceptance length | verify steps |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['sampling']} | {row['temperature']:g} | {row['mean_acceptance_length']:.2f} | {row['steps']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
