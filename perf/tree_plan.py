"""What the performance model predicts for draft trees on every shipped build profile (build_configs/): tok/s per
user and per GPU at concurrency 1, 8 and 64 for the chain (the full 15 drafts, no schedule) and trees of 24, 32 and
64 nodes, at the profile's sweep lengths, GPU, TP and formats, with the acceptance its `auto` schedule plans with.

A tree step verifies N + 1 target tokens beside the drafter's block; its tokens per step are the best static tree's
over the chain's per-position rates, the ranks past the drafter's best geometric (`tree_acceptance.RESIDUAL_RATIO`,
fitted on the tiny pair): an assumption, since no published DFlash drafter reports its rank rates. Prints a markdown
table (docs/performance.md §3.9). Not a unit test and not a measurement: the model's predictions.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dflash_trt.analysis.model import Method, mean_context
from dflash_trt.analysis.published import PAIRS, pair_for_models
from dflash_trt.analysis.tree_acceptance import tree_method
from dflash_trt.decoding_modes import DFLASH
from dflash_trt.pipeline.profiles import load_profile
from dflash_trt.pipeline.schedule import engine_deployment, profile_acceptance

CONCURRENCIES = (1, 8, 64)
TREES = (None, 24, 32, 64)  # None: the chain
PROFILES = Path(__file__).resolve().parent.parent / "build_configs"


def main() -> int:
    head = "| profile | drafts | " + " | ".join(f"c={c} tok/s/user, tok/s/GPU" for c in CONCURRENCIES) + " |"
    print(head)
    print("|" + "---|" * (2 + len(CONCURRENCIES)))
    for path in sorted(PROFILES.glob("*/*.yaml")):
        profile = load_profile(path)
        key = pair_for_models(profile.model.target, profile.model.draft)
        if key is None:
            continue
        target, drafter = PAIRS[key].load()
        dep = engine_deployment(profile)
        acc = profile_acceptance(profile, drafter)
        ctx = mean_context(profile.sweep.input_len, profile.sweep.output_len)
        for tree in TREES:
            method = Method(DFLASH, drafter, acc) if tree is None else tree_method(DFLASH, drafter, acc, tree)
            cells = []
            for c in CONCURRENCIES:
                it = method.iteration(target, c, ctx, dep)
                cells.append(f"{it.tok_s_user():.0f}, {c * it.tok_s_user() / dep.tp:.0f}")
            yields = f"{method.tokens_per_step(1):.2f}/step"
            name = f"chain ({yields})" if tree is None else f"tree {tree} ({yields})"
            print(f"| {profile.name} | {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
