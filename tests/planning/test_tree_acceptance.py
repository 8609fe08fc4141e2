"""The planner's static-tree model (analysis/tree_acceptance.py): the chain it contains is the chain's acceptance,
its best tree is the best over every prefix-closed rank tree (brute force), and rates derived from a chain keep the
chain's rank-1 rates."""

from __future__ import annotations

import itertools

import pytest

from dflash_trt.analysis.model import Acceptance
from dflash_trt.analysis.tree_acceptance import RankRates, rank_rates
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
