"""What draft trees buy in acceptance: mean accepted length per verify step of the embedded tiny pair with the chain
and with trees of 24, 32 and 64 nodes, greedy and at T = 1 (engine rule). Table in docs/engine.md §6.1.

    python perf/tree_acceptance.py [--prompts N] [--max_new_tokens N] [--seeds N] [--trees 24,32,64] [--json]

Not a unit test: the same held-out prompts decoded by the golden model for every (tree, temperature), each sampled
setting over several seeds; acceptance length counts the bonus token. Also reports the first draft position's
acceptance and the mean verified width (the anchor plus the drafted tokens the target checks per step), and from
the chain runs the per-position rank rates' fitted residual ratio (`analysis/tree_acceptance.RESIDUAL_RATIO`) and the
planner's static-tree prediction for each budget, from the measured rates and from the chain with that ratio.
"""

from __future__ import annotations

import argparse
import json
import sys

from tiny_golden import tiny_golden  # perf/tiny_golden.py

from dflash_trt.analysis.tree_acceptance import RankRates, rank_rates, residual_ratio
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.sampling import SamplingParams
from dflash_trt.reference.stats import (
    REPORTED_RANKS,
    mean_acceptance_length,
    per_position_acceptance,
    per_position_rank_rates,
)

TEMPERATURES = (0.0, 1.0)


def _predicted(model: tuple[RankRates, float], budget: int) -> dict:
    """The planner's static-tree mean for this budget, from the measured rank rates and from the chain + ratio."""
    table, ratio = model
    derived = RankRates.from_chain(table.chain(), ratio)
    return {
        "residual_ratio": round(ratio, 3),
        "static_tree_measured_ranks": round(table.tree_mean(budget), 3),
        "static_tree_chain_and_ratio": round(derived.tree_mean(budget), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts, decoded as one batch")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=3, help="runs per sampled setting")
    parser.add_argument("--trees", default="24,32,64", help="node budgets besides the chain")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    model, prompts = tiny_golden(args.prompts)
    stop_ids = list(model.target.spec.eos_token_ids)
    k = model.draft.spec.num_drafts
    rows = []
    models: dict[float, tuple[RankRates, float]] = {}
    for budget in [k, *(int(n) for n in args.trees.split(","))]:
        for temperature in TEMPERATURES:
            results = []
            for seed in range(1 if temperature == 0 else args.seeds):
                params = SamplingParams(temperature)
                results += speculative_generate(
                    model, prompts, args.max_new_tokens, stop_ids, params, seed=1000 * seed, draft_tree=budget
                )
            steps = [s for r in results for s in r.steps]
            if budget == k:
                table = rank_rates(per_position_rank_rates(results, k, REPORTED_RANKS))
                models[temperature] = (table, residual_ratio(table))
            rows.append(
                {
                    "draft": "chain" if budget == k else f"tree {budget}",
                    "temperature": temperature,
                    "mean_acceptance_length": round(mean_acceptance_length(results), 3),
                    "first_position_acceptance": round(per_position_acceptance(results, k)[0] or 0.0, 3),
                    "mean_verified_width": round(1 + sum(len(s.draft_ids) for s in steps) / len(steps), 2),
                    "steps": len(steps),
                    **_predicted(models[temperature], budget),
                }
            )
    if args.json:
        print(json.dumps({"block_size": model.draft.spec.block_size, "prompts": len(prompts), "rows": rows}))
        return 0
    print(
        f"block size {model.draft.spec.block_size}, {len(prompts)} held-out prompts, "
        f"{args.max_new_tokens} new tokens, {args.seeds} seeds per sampled setting"
    )
    print(
        "| drafts | T | mean acceptance length | first position | verified width | verify steps | static tree "
        "(measured ranks) | static tree (chain + ratio) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['draft']} | {row['temperature']:g} | {row['mean_acceptance_length']:.2f} | "
            f"{row['first_position_acceptance']:.3f} | {row['mean_verified_width']:.1f} | {row['steps']} | "
            f"{row['static_tree_measured_ranks']:.2f} | {row['static_tree_chain_and_ratio']:.2f} |"
        )
    print("residual ratio (chain runs): " + ", ".join(f"T={t:g}: {m[1]:.3f}" for t, m in models.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
