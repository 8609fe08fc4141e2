"""Draft trees: the most likely continuations of a block, verified at once (the golden definition).

A DFlash drafter proposes a whole block in one pass from mask tokens, so slot `d` gives a distribution `q_d` over the
`d`-th next token that does not depend on the drafts before it. A node of a draft tree is one continuation
`(t_1, ..., t_d)`; under the drafter's marginals it is the target's continuation with probability
`prod_j q_j(t_j)`, and the expected number of accepted drafts is the sum of that over the tree's nodes. So the tree
of at most `N` nodes maximising it holds the `N` most likely continuations, which are prefix-closed: a child is never
more likely than its parent. `best_tree` finds them by a beam over depths (the `N` best continuations of length `d`
extend only the `N` best of length `d - 1`) and a selection across depths, in float32 log-probabilities summed in
depth order, exactly as the engine network computes them (`trtllm/tree.py`).

Order and ties are part of the definition, so that the network can reproduce it: continuations rank by score, then
by depth (a parent before a child of equal score, which keeps the selection prefix-closed), then by their rank in
their depth's beam; a beam ranks its candidates by score, then by (parent's beam rank, token's rank); tokens rank by
log-probability, then by id. Nodes are numbered 1..n breadth-first in that order; node 0 is the anchor.

Verification (`tree_accept`) generalises the chain's exact-match rule: the target draws one token at every node (its
argmax at T = 0, else an inverse-CDF sample with the node's own uniform); from the anchor, the walk descends to the
child holding the drawn token while there is one. The drawn token where it stops is the bonus. Siblings hold distinct
tokens, so the walk is unique, and the nodes it visits are distinct and use distinct uniforms: every emitted token is
a fresh sample of the target given the tokens before it, so the output has the target's law (greedy: its argmax).
A chain is the tree whose node `i` is slot `i`'s argmax; its rule is `sampling.exact_match_accept`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.sampling import sample_by_uniform

ANCHOR = 0  # node 0: the anchor, the last accepted token, root of every path


@dataclass(frozen=True)
class DraftTree:
    """Nodes 1..n breadth-first: `tokens[i - 1]` and `parents[i - 1]` (a node index, 0 = the anchor) of node `i`."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise DFlashTrtError("a draft tree needs one parent per token")
        for node, parent in enumerate(self.parents, start=1):
            if not 0 <= parent < node:
                raise DFlashTrtError(f"draft tree node {node} has parent {parent}: parents precede their children")

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        return cls(tuple(tokens), tuple(range(len(tokens))))

    @property
    def size(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of every node 0..n (the anchor's is 0): a node's position is the anchor's plus its depth."""
        depth = [0]
        for parent in self.parents:
            depth.append(depth[parent] + 1)
        return depth

    @property
    def depth(self) -> int:
        return max(self.depths())

    def is_chain(self) -> bool:
        return self.parents == tuple(range(self.size))

    def path(self, node: int) -> list[int]:
        """Nodes from the anchor to `node`, both included."""
        nodes = [node]
        while nodes[-1] != ANCHOR:
            nodes.append(self.parents[nodes[-1] - 1])
        return nodes[::-1]

    def children(self, node: int) -> list[int]:
        return [child for child, parent in enumerate(self.parents, start=1) if parent == node]

    def visibility(self) -> torch.Tensor:
        """bool `[n + 1, n + 1]`: node `i` attends to node `j` iff `j` is on its path (itself included)."""
        visible = torch.zeros(self.size + 1, self.size + 1, dtype=torch.bool)
        for node in range(self.size + 1):
            visible[node, self.path(node)] = True
        return visible


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax in the engine's order of operations: `z - (max + log(sum(exp(z - max))))`."""
    z = logits.float()
    top = z.amax(dim=-1, keepdim=True)
    return z - (top + torch.log(torch.exp(z - top).sum(dim=-1, keepdim=True)))


def _ranked(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` best entries of the last dimension: highest first, ties by lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :count]


@dataclass(frozen=True)
class _Beam:
    """The best continuations of one length: score, parent's rank in the previous beam, token."""

    scores: torch.Tensor  # float32 [width]
    parents: torch.Tensor  # int64 [width]
    tokens: torch.Tensor  # int64 [width]


def _beams(logprobs: torch.Tensor, budget: int, candidate_ids: torch.Tensor | None) -> list[_Beam]:
    """Per depth, the `budget` most likely continuations (fewer where fewer exist)."""
    width = min(budget, logprobs.shape[-1])
    top = _ranked(logprobs, width)
    top_scores = logprobs.gather(-1, top)
    ids = top if candidate_ids is None else candidate_ids.gather(-1, top)
    beams = [_Beam(top_scores[0], torch.zeros(width, dtype=torch.long), ids[0])]
    for depth in range(1, logprobs.shape[0]):
        previous = beams[-1]
        candidates = (previous.scores[:, None] + top_scores[depth][None, :]).reshape(-1)
        keep = _ranked(candidates, min(budget, candidates.numel()))
        beams.append(_Beam(candidates[keep], keep // width, ids[depth][keep % width]))
    return beams


def best_tree(logprobs: torch.Tensor, budget: int, candidate_ids: torch.Tensor | None = None) -> DraftTree:
    """The tree of at most `budget` nodes holding the most likely continuations under per-slot log-probabilities
    `logprobs [depth, V]` (float32, `log_probs` of the drafter's logits). `candidate_ids [depth, V]` maps a column
    to its token id (a reduced draft vocabulary); by default column v is token v."""
    if budget < 1 or logprobs.dim() != 2 or logprobs.shape[0] < 1:
        raise DFlashTrtError(f"a draft tree needs a budget >= 1 and [depth, vocab] log-probabilities, got {budget}")
    beams = _beams(logprobs, budget, candidate_ids)
    # Across depths: score descending, then depth, then beam rank (the flattened order is depth-major).
    scores = torch.cat([beam.scores for beam in beams])
    chosen = sorted(_ranked(scores, min(budget, scores.numel())).tolist())
    offsets = [0]
    for beam in beams:
        offsets.append(offsets[-1] + len(beam.scores))
    node_of: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    for flat in chosen:  # depth-major flat order is breadth-first order
        depth = next(d for d in range(len(beams)) if flat < offsets[d + 1])
        rank = flat - offsets[depth]
        beam = beams[depth]
        parent = ANCHOR if depth == 0 else node_of.get((depth - 1, int(beam.parents[rank])))
        if parent is None:
            raise DFlashTrtError("draft tree selection is not prefix-closed")  # excluded by the ranking's order
        node_of[(depth, rank)] = len(tokens) + 1
        tokens.append(int(beam.tokens[rank]))
        parents.append(parent)
    return DraftTree(tuple(tokens), tuple(parents))


def budget_tree(
    logprobs: torch.Tensor, budget: int, candidate_ids: torch.Tensor | None = None, positions: int | None = None
) -> DraftTree:
    """What a tree engine drafts for a request whose node budget (the draft-length schedule's value for the step's
    load, at most the tree's nodes: draft_schedule.py) is `budget`: the chain of each position's best token when the
    budget does not exceed the engine's `positions` draft positions (default: every row of `logprobs`), as long as
    the rows given allow; else `best_tree` over the rows given (fewer than `positions` near the output budget)."""
    if budget > (logprobs.shape[0] if positions is None else positions):
        return best_tree(logprobs, budget, candidate_ids)
    length = min(budget, logprobs.shape[0])
    top = _ranked(logprobs[:length], 1)[:, 0]
    ids = top if candidate_ids is None else candidate_ids[:length].gather(-1, top[:, None])[:, 0]
    return DraftTree.chain(ids.tolist())


def expected_accepted(tree: DraftTree, logprobs: torch.Tensor, candidate_ids: torch.Tensor | None = None) -> float:
    """Sum over nodes of the drafter's probability of the node's continuation: the accepted drafts a step expects
    when the drafter's marginals are the target's (what `best_tree` maximises). float64."""
    probs = logprobs.double().exp()
    depth = tree.depths()
    total = 0.0
    for node in range(1, tree.size + 1):
        p = 1.0
        for step in tree.path(node)[1:]:
            column = tree.tokens[step - 1]
            row = depth[step] - 1
            if candidate_ids is not None:
                column = int((candidate_ids[row] == column).nonzero()[0])
            p *= float(probs[row, column])
        total += p
    return total


def tree_accept(
    tree: DraftTree, target_logits: torch.Tensor, temperature: float, uniforms: torch.Tensor
) -> tuple[list[int], int]:
    """The engine's verification of a draft tree: `target_logits [n + 1, V]` at nodes 0..n, `uniforms [>= n + 1]`
    (node i draws with uniform i) -> (accepted path of nodes from the anchor, bonus token)."""
    drawn = sample_by_uniform(target_logits, temperature, uniforms[: tree.size + 1]).tolist()
    path = [ANCHOR]
    while True:
        node = path[-1]
        child = next((c for c in tree.children(node) if tree.tokens[c - 1] == drawn[node]), None)
        if child is None:
            return path, drawn[node]
        path.append(child)
