"""The runtime's EAGLE contract as the engine speaks it: one chain of the drafter's drafts (`block_size - 1`, or
`block_size` when the anchor's slot drafts too) or a draft tree's nodes, the chain's choices and paths, and the
packed attention masks of a draft block. Pure Python, so the network, the emulation and the plan share them."""

from __future__ import annotations

import math

from dflash_trt.errors import DFlashTrtError
from dflash_trt.inputs import draft_tree_nodes
from dflash_trt.trtllm.build_limits import MAX_EAGLE_DRAFT_LEN
from dflash_trt.trtllm.build_settings import EngineBuildSettings
from dflash_trt.trtllm.checkpoint_facts import CheckpointFacts


def check_tree_nodes(nodes: int | None, num_drafts: int, dflash2: bool, what: str = "--draft_tree") -> int:
    """0 for the chain, `nodes` for a tree (the golden loop's rule, `inputs.draft_tree_nodes`), at most what an
    EAGLE engine verifies (the builder's max_draft_len limit)."""
    tree = draft_tree_nodes(nodes, num_drafts, dflash2, what)
    if tree > MAX_EAGLE_DRAFT_LEN:
        raise DFlashTrtError(f"{what} {tree}: an EAGLE engine verifies at most {MAX_EAGLE_DRAFT_LEN} drafts")
    return tree


def verified_drafts(facts: CheckpointFacts, settings: EngineBuildSettings) -> int:
    """Drafts the engine verifies per request, its EAGLE max_draft_len: the chain's, or the draft tree's nodes."""
    dflash2 = facts.selector_top_k is not None
    return check_tree_nodes(settings.draft_tree, facts.max_draft_len, dflash2) or facts.max_draft_len


def chain_eagle_choices(max_draft_len: int) -> list[list[int]]:
    """EAGLE choices of one chain: [[0], [0, 0], ...], depth `max_draft_len` (the runtime checks depth == layers)."""
    return [[0] * depth for depth in range(1, max_draft_len + 1)]


def chain_draft_paths(max_draft_len: int) -> list[list[int]]:
    """The `draft_paths` rows a chain produces: row 0 visits every node, the other K rows are unused (-1)."""
    width = max_draft_len + 1
    return [list(range(width))] + [[-1] * width for _ in range(max_draft_len)]


def block_mask(block_size: int, causal: bool) -> list[list[bool]]:
    """Which block tokens each block query sees: all (DFlash full attention) or itself and earlier (causal)."""
    return [[(not causal) or key <= query for key in range(block_size)] for query in range(block_size)]


def pack_mask_rows(mask: list[list[bool]]) -> list[list[int]]:
    """Pack each row into int32 words, bit j of word w = key 32*w + j (the spec-decoding packed-mask layout)."""
    words = math.ceil(len(mask[0]) / 32)
    packed = []
    for row in mask:
        row_words = []
        for w in range(words):
            value = 0
            for bit in range(32):
                key = 32 * w + bit
                if key < len(row) and row[key]:
                    value |= 1 << bit
            row_words.append(value - (1 << 32) if value >= 1 << 31 else value)
        packed.append(row_words)
    return packed


def block_packed_mask(block_size: int, causal: bool) -> list[list[int]]:
    return pack_mask_rows(block_mask(block_size, causal))
