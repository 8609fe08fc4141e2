"""What the 1.2.x runtime derives from the draft paths an EAGLE engine emits, as the emulated executor applies it
(docs/engine.md §4, §6.1; read in the sources, not run).

Paths are `[max_draft_len + 1][num_eagle_layers + 1]` rows of node indices (node 0 the anchor), -1 after a row's
end. `unpackEagleData` gives node `paths[p][l]` the position offset `l`; `getPackedMaskFromPath` lets it attend to
itself and to every earlier node of each row holding it; `packAcceptedPaths` and the rewind kernel move the
accepted row's `i`-th draft from `anchor + paths[best][i]` to `anchor + i`, in every layer of the pool.
"""

from __future__ import annotations


def path_geometry(paths: list[list[int]], nodes: int) -> tuple[list[int], list[list[bool]]]:
    """Per node 0..`nodes` - 1 (the step's generation length): its position offset and which nodes it attends to.
    Nodes past the generation length are not verified (a chain drafting fewer than its paths hold); a row's nodes
    grow with its levels, so the row ends there."""
    depth = [0] * nodes
    sees = [[False] * nodes for _ in range(nodes)]
    sees[0][0] = True
    for row in paths:
        for level, node in enumerate(row):
            if not 0 <= node < nodes:
                break
            depth[node] = level
            for earlier in row[: level + 1]:
                sees[node][earlier] = True
    return depth, sees


def rewind_moves(paths: list[list[int]], best_row: int, accepted: int) -> tuple[list[int], list[int]]:
    """(from, to) offsets past the anchor of the K/V the rewind moves after a step that emitted `accepted` tokens
    (accepted drafts + the bonus) along row `best_row`."""
    row = paths[best_row]
    return [row[i] for i in range(1, accepted)], list(range(1, accepted))
