"""The engine's draft trees (`trtllm/tree.py`, executed under the emulated TensorRT-LLM ops) are the golden trees
(`reference/tree.py`) in the EAGLE layout, for every budget up to the tree's size (the chain at budgets up to the
draft positions), over the full vocabulary and a reduced one; and the in-graph walk accepts the golden path."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.emulation import functional
from dflash_trt.emulation.functional import Network, PluginConfig, net_guard
from dflash_trt.emulation.stand_ins import engine_source
from dflash_trt.reference.tree import DraftTree, budget_tree, log_probs, tree_accept


def tensor(data: torch.Tensor) -> functional.Tensor:
    return functional.Tensor(data=data)


def engine_trees(logits: torch.Tensor, budgets: list[int], nodes: int, ids: torch.Tensor | None = None):
    """`best_trees` of the real tree.py on `logits [bs, K, V]` under the stand-ins."""
    tree = engine_source("tree")
    bs, k, v = logits.shape
    with net_guard(Network(PluginConfig())):
        out = tree.best_trees(
            tensor(logits.reshape(bs * k, v).float()),
            None if ids is None else tensor(ids.to(torch.int32)),
            tensor(torch.tensor(budgets, dtype=torch.int32)),
            tree.TreeShape(depth=k, nodes=nodes, vocab=v),
            functional.shape(tensor(torch.zeros(bs, dtype=torch.int32)), 0),
        )
        return out.tokens.data, out.paths.data, out.count.data


def golden_layout(tree: DraftTree, nodes: int, depth: int) -> tuple[list[int], list[list[int]]]:
    tokens = list(tree.tokens) + [0] * (nodes - tree.size)
    paths = [[-1] * (depth + 1) for _ in range(nodes + 1)]
    for node in range(tree.size + 1):
        path = tree.path(node)
        paths[node][: len(path)] = path
    return tokens, paths


@pytest.mark.parametrize("seed, k, v, nodes", [(0, 4, 50, 12), (1, 6, 7, 20), (2, 3, 2, 9), (3, 5, 300, 31)])
def test_engine_trees_are_the_golden_trees(seed, k, v, nodes):
    generator = torch.Generator().manual_seed(seed)
    bs = 5
    logits = torch.randn(bs, k, v, generator=generator) * torch.tensor([0.5, 1.0, 2.0, 4.0, 8.0])[:, None, None]
    budgets = [nodes, k, 1, k + 1, nodes - 1][:bs]
    tokens, paths, count = engine_trees(logits, budgets, nodes)
    for b in range(bs):
        golden = budget_tree(log_probs(logits[b]), budgets[b])
        want_tokens, want_paths = golden_layout(golden, nodes, k)
        assert int(count[b]) == golden.size
        assert tokens[b].tolist() == want_tokens
        assert paths[b].tolist() == want_paths


def test_engine_trees_map_a_reduced_vocabulary():
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 3, 11, generator=generator)
    ids = torch.randperm(11, generator=generator) * 13 + 5
    tokens, paths, _ = engine_trees(logits, [8, 3], 8, ids)
    for b, budget in enumerate([8, 3]):
        golden = budget_tree(log_probs(logits[b]), budget, ids.expand(3, -1))
        want_tokens, want_paths = golden_layout(golden, 8, 3)
        assert (tokens[b].tolist(), paths[b].tolist()) == (want_tokens, want_paths)


def test_engine_walk_accepts_the_golden_path():
    """verify_tree against tree_accept, on trees of the engine's layout and target draws that follow them partway."""
    generator = torch.Generator().manual_seed(11)
    tree_module = engine_source("tree")
    k, nodes, v, bs = 4, 10, 6, 6
    logits = torch.randn(bs, k, v, generator=generator) * 3
    tokens, paths, count = engine_trees(logits, [nodes] * bs, nodes)
    drawn = torch.randint(0, v, (bs, nodes + 1), generator=generator, dtype=torch.int32)
    for b in range(bs):  # steer the draws down a random branch for a few levels
        node = 0
        for _ in range(b % (k + 1)):
            children = [i for i in range(1, int(count[b]) + 1) if int(paths[b, i, :].ge(0).sum()) - 2 >= 0
                        and int(paths[b, i, int(paths[b, i].ge(0).sum()) - 2]) == node]  # fmt: skip
            if not children:
                break
            child = children[int(torch.randint(len(children), (1,), generator=generator))]
            drawn[b, node] = tokens[b, child - 1]
            node = child
    lens = count.clone()
    lens[0] = 0  # a context request: nothing accepted
    with net_guard(Network(PluginConfig())):
        verdict = tree_module.verify_tree(
            tensor(drawn), tensor(tokens), tensor(lens), tensor(paths), tree_module.TreeShape(k, nodes, v)
        )
        accepted, n, row = verdict.accepted_tokens.data, verdict.num_accepted.data, verdict.accepted_path.data
    for b in range(bs):
        parents = [int(paths[b, i, int(paths[b, i].ge(0).sum()) - 2]) for i in range(1, int(lens[b]) + 1)]
        tree = DraftTree(tuple(tokens[b, : int(lens[b])].tolist()), tuple(parents))
        logits_b = torch.full((tree.size + 1, v), -5.0)
        logits_b[torch.arange(tree.size + 1), drawn[b, : tree.size + 1].long()] = 5.0
        path, bonus = tree_accept(tree, logits_b, 0.0, torch.full((nodes + 1,), 0.5))
        assert int(n[b]) == len(path)
        assert accepted[b, : len(path)].tolist() == [int(drawn[b, node]) for node in path]
        assert accepted[b, len(path) - 1] == bonus
        assert paths[b, int(row[b]), : len(path)].tolist() == path


@pytest.mark.parametrize("budget", range(4, 14))
def test_certain_positions_tie_children_with_parents(budget):
    """A position whose best token is certain in float32 (log-probability exactly 0) gives children the scores of
    their parents: the cut falls among equal scores, where depth order keeps parents and the tree prefix-closed."""
    generator = torch.Generator().manual_seed(budget)
    logits = torch.randn(1, 5, 9, generator=generator)
    logits[0, 1] = torch.linspace(-300.0, -200.0, 9)
    logits[0, 1, 4] = 100.0  # position 2 is certain: token 4
    logits[0, 3, 2] = 400.0  # so is position 4: token 2
    assert float(log_probs(logits[0])[1, 4]) == 0.0
    tokens, paths, count = engine_trees(logits, [budget], 13)
    golden = budget_tree(log_probs(logits[0]), budget)
    want_tokens, want_paths = golden_layout(golden, 13, 5)
    assert (int(count[0]), tokens[0].tolist(), paths[0].tolist()) == (golden.size, want_tokens, want_paths)
