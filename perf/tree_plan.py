"""What the performance model predicts for draft trees on every shipped build profile (build_configs/): tok/s per
user and per GPU at concurrency 1, 8 and 64 for the chain (the full 15 drafts, no schedule), fixed trees of 24, 32
and 64 nodes, the chain under its own `auto` draft lengths, and the 64-node tree engine under its `auto` node
budgets (draft_schedule.py: the one derivation over budgets 1..64 for batches 1..the profile's max_batch_size). The
scheduled rows name the value B each concurrency verifies (B <= 15: the chain of B drafts), at the profile's sweep
lengths, GPU, TP and formats, with the acceptance its `auto` schedule plans with.

A tree step verifies N + 1 target tokens beside the drafter's block; its tokens per step are the best static tree's
over the chain's per-position rates, the ranks past the drafter's best geometric (`tree_acceptance.RESIDUAL_RATIO`,
fitted on the tiny pair): an assumption, since no published DFlash drafter reports its rank rates. Prints a markdown
table (docs/performance.md §3.9). Not a unit test and not a measurement: the model's predictions.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dflash_trt.analysis.draft_schedule import derive_schedule, scheduled_method
from dflash_trt.analysis.model import Method, mean_context
from dflash_trt.analysis.published import PAIRS, pair_for_models
from dflash_trt.analysis.tree_acceptance import tree_method
from dflash_trt.decoding_modes import DFLASH
from dflash_trt.draft_schedule import DraftLenSchedule
from dflash_trt.pipeline.profiles import load_profile
from dflash_trt.pipeline.schedule import engine_deployment, profile_acceptance

CONCURRENCIES = (1, 8, 64)
TREES = (None, 24, 32, 64)  # None: the chain
AUTO_TREE = 64  # the tree engine whose node budgets `auto` derives
DRAFTS = 15  # the shipped drafters' block of 16
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
            yields = f"{method.tokens_per_step(1):.2f}/step"
            name = f"chain ({yields})" if tree is None else f"tree {tree} ({yields})"
            print(f"| {profile.name} | {name} | " + " | ".join(_cells(method, target, dep, ctx)) + " |")
        for nodes in (0, AUTO_TREE):  # each engine under its own `auto`: the chain's draft lengths, the tree's budgets
            auto = derive_schedule(target, drafter, acc, dep, ctx, profile.engine.max_batch_size, nodes).schedule
            method = scheduled_method(drafter, acc, auto, nodes)
            name = f"tree {nodes} auto ({auto.text()})" if nodes else f"chain auto ({auto.text()})"
            print(f"| {profile.name} | {name} | " + " | ".join(_cells(method, target, dep, ctx, auto)) + " |")
    return 0


def _cells(method: Method, target, dep, ctx: float, schedule: DraftLenSchedule | None = None) -> list[str]:
    """tok/s/user, tok/s/GPU at each concurrency (and the drafts or node budget `schedule` verifies there)."""
    cells = []
    longest = method.draft_tree or DRAFTS
    for c in CONCURRENCIES:
        it = method.iteration(target, c, ctx, dep)
        budget = "" if schedule is None else f" (B={schedule.draft_len(c, longest)})"
        cells.append(f"{it.tok_s_user():.0f}, {c * it.tok_s_user() / dep.tp:.0f}{budget}")
    return cells


if __name__ == "__main__":
    sys.exit(main())
