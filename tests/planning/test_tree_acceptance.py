"""The planner's static-tree model (analysis/tree_acceptance.py): the chain it contains is the chain's acceptance,
its best tree is the best over every prefix-closed rank tree (brute force), and rates derived from a chain keep the
chain's rank-1 rates."""

from __future__ import annotations

import itertools
import json

import pytest

from dflash_trt.analysis.model import Acceptance
from dflash_trt.analysis.tree_acceptance import RankRates, rank_rates, tree_method
from dflash_trt.draft_schedule import DraftLenSchedule
from dflash_trt.errors import DFlashTrtError


def brute_force(rates: list[list[float]], nodes: int) -> float:
    """1 + the largest sum of path probabilities over prefix-closed sets of at most `nodes` rank paths."""
    paths = [p for d in range(1, len(rates) + 1) for p in itertools.product(range(len(rates[0])), repeat=d)]
    value = {}
    for path in paths:
        v = 1.0
        for depth, rank in enumerate(path):
            v *= rates[depth][rank]
        value[path] = v
    best = 0.0
    for size in range(1, nodes + 1):
        for chosen in itertools.combinations(paths, size):
            members = set(chosen)
            if all(p[:-1] in members for p in chosen if len(p) > 1):
                best = max(best, sum(value[p] for p in chosen))
    return 1.0 + best


@pytest.mark.parametrize("nodes", [1, 2, 3, 4, 5])
def test_best_static_tree_against_brute_force(nodes):
    rates = [[0.6, 0.25, 0.1], [0.5, 0.3, 0.05], [0.9, 0.05, 0.0]]
    assert RankRates(tuple(map(tuple, rates))).tree_mean(nodes) == pytest.approx(brute_force(rates, nodes))


def test_a_tree_of_chain_rates_is_the_chain():
    chain = [0.9, 0.8, 0.7, 0.5]
    table = RankRates(tuple((a,) for a in chain))
    acceptance = Acceptance.from_position_rates(chain)
    assert table.tree_mean(4) == pytest.approx(acceptance.mean())
    assert table.tree_mean(40) == pytest.approx(acceptance.mean())  # nothing else to branch on
    assert table.tree_mean(2) == pytest.approx(1 + 0.9 + 0.9 * 0.8)
    assert table.chain().mean() == pytest.approx(acceptance.mean())


def test_rates_derived_from_a_chain_keep_its_acceptance_and_branch():
    acceptance = Acceptance.from_position_rates([0.95, 0.9, 0.6])
    table = RankRates.from_chain(acceptance, ratio=0.5, ranks=4)
    assert [row[0] for row in table.rates] == pytest.approx([0.95, 0.9, 0.6])
    assert table.rates[2][1:] == pytest.approx((0.4 * 0.5, 0.4 * 0.25, 0.4 * 0.125))
    assert table.tree_mean(3) == pytest.approx(acceptance.mean())  # the chain is the best 3 nodes here
    assert table.tree_mean(8) > acceptance.mean()


def test_measured_tables_are_checked():
    assert rank_rates([[0.5, 0.2], [0.4, 0.1], [0.0, 0.0]]).positions == 2
    with pytest.raises(DFlashTrtError, match="summing to at most 1"):
        rank_rates([[0.8, 0.3]])
    with pytest.raises(DFlashTrtError, match="at least one position"):
        rank_rates([[0.0]])


def test_plan_prices_a_tree_step_as_its_nodes_verified_beside_the_drafters_block():
    """A tree of N nodes: the step verifies N + 1 target tokens per sequence beside the drafter's whole block, and
    yields the best static tree's tokens over the chain's rates; memory-bound (one user) the wider verify costs
    little and the tree is faster, compute-bound (64 users) it costs more than the extra tokens return."""
    from dflash_trt.analysis.gpus import get_gpu
    from dflash_trt.analysis.harness_fits import calibration
    from dflash_trt.analysis.model import Deployment, Method, dflash_step, mean_context
    from dflash_trt.analysis.published import PAIRS
    from dflash_trt.decoding_modes import DFLASH

    target, drafter = PAIRS["qwen3-8b"].load()
    acc = Acceptance.from_mean(6.55, drafter.block_size)
    dep = Deployment(get_gpu("b200"), "bf16", "bf16", 1, calibration("trtllm"))
    ctx = mean_context(1024, 1024)
    chain, tree = Method(DFLASH, drafter, acc), tree_method(DFLASH, drafter, acc, 64)
    tokens = RankRates.from_chain(acc).tree_mean(64)
    for batch in (1, 8, 64):
        cost = tree.step(target, batch, ctx, dep)
        assert cost == dflash_step(target, drafter, batch, 65, tokens, ctx, dep, drafter.block_size, tree=True)
        assert cost.target_tokens == batch * 65
        assert tree.iteration(target, batch, ctx, dep).tokens_per_seq == pytest.approx(tokens, rel=1e-12)
        assert tokens > acc.mean()
    speed = {m: [m.iteration(target, b, ctx, dep).tok_s_user() for b in (1, 64)] for m in (chain, tree)}
    assert speed[tree][0] > speed[chain][0] and speed[tree][1] < speed[chain][1]
    with pytest.raises(DFlashTrtError, match="a tree more"):
        dflash_step(target, drafter, 1, drafter.block_size, tokens, ctx, dep, drafter.block_size, tree=True)
    with pytest.raises(DFlashTrtError, match="tokens for every budget"):
        Method(DFLASH, drafter, acc, DraftLenSchedule(((4, 8),)), draft_tree=64, tree_tokens=(tokens,))
    with pytest.raises(DFlashTrtError, match="node count and its tokens per step"):
        Method(DFLASH, drafter, acc, draft_tree=64)


def _qwen3_on_b200():
    from dflash_trt.analysis.gpus import get_gpu
    from dflash_trt.analysis.harness_fits import calibration
    from dflash_trt.analysis.model import Deployment, mean_context
    from dflash_trt.analysis.published import PAIRS

    target, drafter = PAIRS["qwen3-8b"].load()
    dep = Deployment(get_gpu("b200"), "bf16", "bf16", 1, calibration("trtllm"))
    return target, drafter, Acceptance.from_mean(6.55, drafter.block_size), dep, mean_context(1024, 1024)


def test_a_tree_engines_schedule_prices_each_batch_at_its_node_budget():
    """Under `1:64,4:30,8:15,64:4` a 64-node tree engine verifies 65 tokens a request at one user and 31 at four
    (the static trees' yields), 16 at 8 users (the chain of 15: the chain engine's step and yield) and 5 at 64 (the
    chain cut at 4 drafts)."""
    from dflash_trt.analysis.model import Method, dflash_step
    from dflash_trt.decoding_modes import DFLASH

    target, drafter, acc, dep, ctx = _qwen3_on_b200()
    schedule = DraftLenSchedule(((1, 64), (4, 30), (8, 15), (64, 4)))
    tree = tree_method(DFLASH, drafter, acc, 64, schedule)
    block = drafter.block_size
    one = dflash_step(target, drafter, 1, 65, RankRates.from_chain(acc).tree_mean(64), ctx, dep, block, tree=True)
    assert tree.step(target, 1, ctx, dep) == one
    assert tree.tokens_per_step(1) == pytest.approx(RankRates.from_chain(acc).tree_mean(64), rel=1e-12)
    four = dflash_step(target, drafter, 4, 31, RankRates.from_chain(acc).tree_mean(30), ctx, dep, block, tree=True)
    assert tree.step(target, 4, ctx, dep) == four and four.target_tokens == 4 * 31
    for batch, drafts in ((8, 15), (64, 4)):
        chain = Method(DFLASH, drafter, acc, DraftLenSchedule(((1, drafts),)))
        assert tree.step(target, batch, ctx, dep) == chain.step(target, batch, ctx, dep)
        assert tree.step(target, batch, ctx, dep).target_tokens == batch * (drafts + 1)
        assert tree.tokens_per_step(batch) == pytest.approx(acc.resized(drafts + 1).mean(), rel=1e-12)


def test_auto_gives_a_tree_engine_wide_trees_at_one_user_and_the_chain_or_less_under_load():
    """The one derivation, over node budgets 1..N: non-increasing with the load, a tree (past the block's 15 drafts)
    at one user, at most the chain at 64 users; wherever the best budget is a chain, the tree engine's best is the
    chain engine's to the last digit (the same yields and steps), and it is never below it."""
    from dflash_trt.analysis.draft_schedule import derive_schedule

    target, drafter, acc, dep, ctx = _qwen3_on_b200()
    chain = derive_schedule(target, drafter, acc, dep, ctx, 64)
    tree = derive_schedule(target, drafter, acc, dep, ctx, 64, nodes=64)
    budgets = [row.draft_len for row in tree.rows]
    assert budgets == sorted(budgets, reverse=True) and max(budgets) <= 64
    assert budgets[0] > drafter.block_size - 1 and budgets[-1] <= drafter.block_size - 1
    assert [tree.schedule.draft_len(row.batch, 64) for row in tree.rows] == budgets
    for t, c in zip(tree.rows, chain.rows, strict=True):
        assert t.best_tok_s >= c.best_tok_s
        if t.best_draft_len < drafter.block_size:
            assert (t.best_draft_len, t.best_tok_s) == (c.best_draft_len, c.best_tok_s)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--draft_tree", "14"], "a tree holds at least the chain's 15 drafts"),
        (["--draft_tree", "257"], "EAGLE verifies at most 256 drafts"),
        (["--draft_tree", "32", "--draft_len_schedule", "8:33"], "verifies 33 drafts per request but the engine"),
        (["--draft_len_schedule", "8:16"], "the engine verifies at most 15 "),
    ],
)
def test_plan_refuses_trees_it_cannot_price(extra, message, capsys):
    from dflash_trt.cli import main

    assert main(["plan", "--preset", "qwen3-8b", "--concurrency", "1", *extra]) == 2
    assert message in capsys.readouterr().err


def test_plan_states_the_trees_verified_tokens_and_yield(capsys):
    from dflash_trt.cli import main

    assert main(["plan", "--preset", "qwen3-8b", "--gpu", "b200", "--concurrency", "1,8", "--draft_tree", "32"]) == 0
    out = capsys.readouterr().out
    assert "draft trees of at most 32 nodes: at one user 33 target tokens verified per step" in out


def test_plan_derives_a_tree_engines_node_budgets(capsys):
    from dflash_trt.cli import main

    argv = ["plan", "--preset", "qwen3-8b", "--gpu", "b200", "--concurrency", "1,64", "--max_batch_size", "64"]
    assert main([*argv, "--draft_tree", "64", "--draft_len_schedule", "auto", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    steps = report["draft_len_schedule"]["steps"]
    rows = next(iter(report["draft_len_schedule"]["rows"].values()))
    assert [r["batch"] for r in rows] == [1, 64]
    assert rows[0]["draft_len"] > 15 >= rows[1]["draft_len"] and rows[0]["fixed_draft_len"] == 64
    assert any(
        f"dflash-trt build --draft_tree 64 --draft_len_schedule {report['draft_len_schedule']['schedule']}" in n
        for n in report["notes"]
    )
    assert all(k <= 64 for _, k in steps)
