"""Draft trees in the engine network, in TensorRT-LLM 1.2.x ops: each request's best tree from the draft block's
per-slot logits, laid out as the EAGLE contract carries it, and its verification (docs/engine.md §6.1).

The golden definition is `reference/tree.py`; this is the same arithmetic on static shapes: `K` draft positions,
at most `N` nodes per request, the request count a runtime tensor. Per position the `w = min(N, V)` most likely
tokens (an ITopKLayer each), float32 log-probabilities summed depth by depth; a beam keeps the `N` best
continuations of each length (a top-k over `N * w` candidates); across depths the `n` best (`n` = the request's
budget, at most `N`) are found without a sort: the n-th best score is read off a top-k of the scores, everything
above it is kept, and of the scores equal to it the first ones in depth-major order (a prefix sum), which is the
golden order (a parent before its child of equal score). A budget of at most `K` is the chain: the best
continuation of each length, the first `n`.

EAGLE layout, one row per node: `tokens [bs, N]` (node i + 1 at column i, breadth-first), `paths [bs, N + 1, K + 1]`
(row i lists node i's path from the anchor, node 0, then -1), `count [bs]` nodes. The runtime derives each node's
position offset (its depth) and the packed tree mask from `paths` and feeds them back as the next step's
`draft_paths`, so row i of the verified step's paths is node i's path: a node's depth is its row's length - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorrt as trt
from tensorrt_llm.functional import (
    Tensor,
    argmax,
    cast,
    concat,
    cumsum,
    eq,
    exp,
    expand,
    gather,
    index_select,
    max,
    shape,
    slice,
    sum,
    unary,
    unsqueeze,
    where,
)

from dflash_trt.trtllm.drafting import topk
from dflash_trt.trtllm.verify import f32, i32


def log_probs(logits: Tensor) -> Tensor:
    """float32 log-softmax along the last dimension, in the golden order: `z - (max + log(sum(exp(z - max))))`."""
    top = max(logits, 1, keepdim=True)
    total = sum(exp(logits - top), dim=1, keepdim=True)
    return logits - (top + unary(total, trt.UnaryOperation.LOG))


@dataclass(frozen=True)
class TreeShape:
    """The static sizes: draft positions, nodes at most, candidates per position, and each depth's beam width."""

    depth: int  # K
    nodes: int  # N
    vocab: int  # columns of the logits (the drafter's vocabulary)

    @property
    def width(self) -> int:
        return min(self.nodes, self.vocab)

    def beams(self) -> list[int]:
        widths = [self.width]
        for _ in range(1, self.depth):
            widths.append(min(self.nodes, widths[-1] * self.width))
        return widths

    def offsets(self) -> list[int]:
        """Where each depth's beam starts in the depth-major flat order."""
        starts = [0]
        for width in self.beams():
            starts.append(starts[-1] + width)
        return starts


@dataclass(frozen=True)
class EngineTree:
    tokens: Tensor  # int32 [bs, N]
    paths: Tensor  # int32 [bs, N + 1, K + 1]
    count: Tensor  # int32 [bs]


@dataclass(frozen=True)
class _Candidates:
    """Every beam entry in depth-major order: score, token id, parent's flat index (-1: the anchor), depth (1..K)."""

    scores: Tensor  # float32 [bs, M]
    tokens: Tensor  # int32 [bs, M]
    parent_flat: Tensor  # int32 [bs, M]
    first_of_depth: np.ndarray  # bool [M]: the beam's best entry of its depth (the chain)
    depths: np.ndarray  # int32 [M]


def _candidates(logprobs: Tensor, ids: Tensor, batch: Tensor, tree: TreeShape) -> _Candidates:
    """The beam over depths: `logprobs` / `ids` `[bs, K, w]` are each position's best tokens, best first."""
    w, widths, starts = tree.width, tree.beams(), tree.offsets()

    def position(x: Tensor, d: int) -> Tensor:
        return slice(x, [0, d, 0], concat([batch, 1, w])).view(concat([batch, w]))

    scores, tokens = [position(logprobs, 0)], [position(ids, 0)]
    parents = [expand(i32([[-1]]), concat([batch, w]))]
    for d in range(1, tree.depth):
        previous = widths[d - 1]
        candidates = unsqueeze(scores[-1], 2) + unsqueeze(position(logprobs, d), 1)
        best, flat = topk(candidates.view(concat([batch, previous * w])), widths[d], 1)
        flat_rows = flat.view(concat([batch * widths[d]]))
        parent_rank = index_select(i32(np.arange(previous * w) // w), 0, flat_rows)
        token_rank = index_select(i32(np.arange(previous * w) % w), 0, flat_rows)
        scores.append(best)
        tokens.append(gather(position(ids, d), 1, token_rank.view(concat([batch, widths[d]]))))
        parents.append(parent_rank.view(concat([batch, widths[d]])) + starts[d - 1])
    depths = np.concatenate([np.full(width, d + 1, dtype=np.int32) for d, width in enumerate(widths)])
    first = np.zeros(starts[-1], dtype=bool)
    first[starts[:-1]] = True
    return _Candidates(concat(scores, dim=1), concat(tokens, dim=1), concat(parents, dim=1), first, depths)


def _select(c: _Candidates, budget: Tensor, tree: TreeShape, batch: Tensor) -> Tensor:
    """bool `[bs, M]`: each request's `budget` best candidates (score, then depth-major order); a budget of at most
    K keeps the chain (each depth's best entry) only."""
    total = c.depths.size
    chain = unsqueeze(budget < tree.depth + 1, 1)
    off_chain = i32([[0 if f else 1 for f in c.first_of_depth]]) > 0
    scores = where(chain, where(off_chain, f32([[-np.inf]]), c.scores), c.scores)
    top, _ = topk(scores, min(tree.nodes, total), 1)
    wanted = where(budget < total, budget, i32([total]))
    threshold = gather(top, 1, unsqueeze(wanted - 1, 1))
    above = cast(scores > threshold, "int32")
    level = cast(eq(scores, threshold), "int32") * cast(threshold > f32([[-np.inf]]), "int32")
    room = unsqueeze(wanted, 1) - sum(above, dim=1, keepdim=True)
    return (above + level * cast(cumsum(level, 1) < room + 1, "int32")) > 0


def _to_nodes(values: Tensor, onehot: Tensor) -> Tensor:
    """`[bs, N]`: the value of the candidate that became each node (0 for a node that does not exist)."""
    return sum(where(onehot, unsqueeze(values, 1), i32([[[0]]])), dim=2)


def _paths(parents: Tensor, depths: Tensor, count: Tensor, tree: TreeShape, batch: Tensor) -> Tensor:
    """`[bs, N + 1, K + 1]`: row i = node i's path from the anchor, -1 after it and in rows past `count`."""
    k, rows = tree.depth, tree.nodes + 1
    ancestor = expand(i32([list(range(rows))]), concat([batch, rows]))
    up = [ancestor]
    for _ in range(k):
        ancestor = gather(parents, 1, ancestor)
        up.append(ancestor)
    ancestors = concat([unsqueeze(a, 2) for a in up], dim=2)  # [bs, N + 1, steps up]
    levels = i32([[list(range(k + 1))]])
    steps = unsqueeze(depths, 2) - levels
    on_path = steps > -1
    at_level = gather(ancestors, 2, where(on_path, steps, i32([[[0]]])))
    exists = unsqueeze(unsqueeze(count, 1) > i32([list(range(rows))]) - 1, 2)
    keep = cast(on_path, "int32") * cast(exists, "int32") > 0
    return where(keep, at_level, i32([[[-1]]]))


def best_trees(logits: Tensor, ids: Tensor | None, budget: Tensor, tree: TreeShape, batch: Tensor) -> EngineTree:
    """Each request's best tree of at most `budget[b]` nodes (<= N) from its draft positions' float32 logits
    `[bs * K, V]`; `ids` maps a column to a token id (`[V]`, a reduced vocabulary's target ids) or None."""
    k, n, w = tree.depth, tree.nodes, tree.width
    best, columns = topk(log_probs(logits), w, 1)
    tokens = (
        columns
        if ids is None
        else index_select(ids, 0, columns.view(concat([batch * k * w]))).view(concat([batch * k, w]))
    )
    c = _candidates(best.view(concat([batch, k, w])), tokens.view(concat([batch, k, w])), batch, tree)
    selected = _select(c, budget, tree, batch)
    chosen = cast(selected, "int32")
    node = cumsum(chosen, 1) * chosen  # breadth-first node number (1-based), 0 where not selected
    count = sum(chosen, dim=1)
    parent_node = where(c.parent_flat < 0, i32([[0]]), gather(node, 1, where(c.parent_flat < 0, 0, c.parent_flat)))
    onehot = eq(unsqueeze(node, 1), i32([[[i] for i in range(1, n + 1)]]))
    depth_of = concat([expand(i32([[0]]), concat([batch, 1])), _to_nodes(i32([c.depths]), onehot)], dim=1)
    parent_of = concat([expand(i32([[0]]), concat([batch, 1])), _to_nodes(parent_node, onehot)], dim=1)
    paths = _paths(parent_of, depth_of, count, tree, batch)
    return EngineTree(_to_nodes(c.tokens, onehot), paths, count)


@dataclass(frozen=True)
class TreeVerdict:
    accepted_tokens: Tensor  # int32 [bs, K + 1]
    num_accepted: Tensor  # int32 [bs]
    accepted_path: Tensor  # int32 [bs]: the row of draft_paths holding the accepted nodes
    accepted_nodes: Tensor  # int32 [bs, K + 1]: node of each accepted depth (-1 past the bonus's node)


def path_depths(draft_paths: Tensor) -> Tensor:
    """int32 `[bs, N + 1]`: each node's depth, its path row's length - 1 (-1 for a row without a path)."""
    return sum(cast(draft_paths > -1, "int32"), dim=2) - 1


def verify_tree(
    drawn: Tensor, draft_tokens: Tensor, draft_lens: Tensor, draft_paths: Tensor, tree: TreeShape
) -> TreeVerdict:
    """The walk from the anchor: `drawn [bs, N + 1]` is the target's token at every node (argmax or sampled with the
    node's uniform); along each path row, a node is accepted while the draw at its parent is its token (and it is
    one of the request's `draft_lens` nodes). The row accepting most holds the walk."""
    k, n = tree.depth, tree.nodes
    batch = shape(draft_lens, 0)
    rows = concat([batch, n + 1, k])
    node = slice(draft_paths, [0, 0, 1], rows)
    parent = slice(draft_paths, [0, 0, 0], rows)
    real = cast(node > 0, "int32") * cast(node < unsqueeze(unsqueeze(draft_lens, 1), 2) + 1, "int32")
    flat = concat([batch, (n + 1) * k])
    token = gather(draft_tokens, 1, where(real > 0, node - 1, i32([[[0]]])).view(flat)).view(rows)
    above = gather(drawn, 1, where(parent > -1, parent, i32([[[0]]])).view(flat)).view(rows)
    matched = real * cast(eq(token, above), "int32")
    depth = sum(cast(cumsum(1 - matched, 2) < 1, "int32"), dim=2)  # accepted drafts along each row
    best = argmax(depth, 1, keepdim=True)
    accepted = max(depth, 1)
    row = gather(draft_paths, 1, expand(unsqueeze(best, 2), concat([batch, 1, k + 1]))).view(concat([batch, k + 1]))
    on_path = cast(i32([list(range(k + 1))]) < unsqueeze(accepted, 1) + 1, "int32") > 0
    nodes = where(on_path, row, i32([[-1]]))
    tokens = gather(drawn, 1, where(on_path, row, i32([[0]])))
    return TreeVerdict(tokens, accepted + 1, best.view(concat([batch])), nodes)
