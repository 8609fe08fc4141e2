"""The engine loop's rules that every decoder of this toolkit shares: which requests it accepts (and how long a
request the engine holds), how many new tokens a step may keep (the output budget) and where a stop ends a request.
Written once so the golden loop, the golden executor and the emulated executor cannot drift apart."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from dflash_trt.errors import DFlashTrtError


def longest_request(positions: int, depth: int) -> int:
    """The most tokens (prompt + output) one request may hold on an engine with `positions` positions (the target's
    max_position_embeddings, or fewer when its KV cache is shorter) and `depth` draft positions per step (the chain's
    K drafts; a draft tree's deepest node, which is K too: its N nodes sit at the anchor's position plus their depth).

    The engine verifies a whole block `[anchor, d1..dK]` (or tree) whatever is left of the output budget and, in the
    same step, drafts the next block from the bonus token, which can lie K+1 past the anchor: a request's last step,
    anchored on its last-but-one token, reaches 2K positions past its last token (docs/engine.md §4). Every admission
    check (serve's targets, the Triton repository, bench and emulate, the executors) uses this rule.
    """
    return positions - 2 * depth


def built_engine_longest_request(kv_window: int, positions: int, depth: int, nodes: int) -> int:
    """The longest request of a built engine verifying `nodes` drafts per step over `depth` positions (a chain:
    nodes = depth = K; a draft tree: N nodes, depth K): what its positions hold (`longest_request`) and what its KV
    window (build_config.max_seq_len, which the builder widened by N + K) holds: the next block's K/V, 2K slots past
    the last token, and the executor's own clip, prompt + output + N <= window, which also covers the verify step's
    N + 1 slots from the anchor before the rewind (docs/engine.md §6.1) [read: llmRequest.cpp `validate`]."""
    return min(longest_request(positions, depth), kv_window - max(2 * depth, nodes))


def check_request(
    index: int, prompt: Sequence[int], max_new_tokens: int, vocab_size: int, max_seq_len: int | None = None
) -> None:
    """Refuse, in one line naming the prompt, what the engine refuses: an empty prompt, token ids outside the
    vocabulary, no output budget, or (when the engine has one) a sequence longer than its max_seq_len."""
    if not prompt:
        raise DFlashTrtError(f"prompt {index} is empty")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise DFlashTrtError(f"prompt {index} has token ids outside the vocabulary (0..{vocab_size - 1})")
    if max_new_tokens < 1:
        raise DFlashTrtError(f"max_new_tokens must be >= 1, got {max_new_tokens} for prompt {index}")
    if max_seq_len is not None and len(prompt) + max_new_tokens > max_seq_len:
        raise DFlashTrtError(
            f"prompt {index}: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds "
            f"max_seq_len {max_seq_len}"
        )


@dataclass(frozen=True)
class Kept:
    """What a step adds to a request: the tokens kept and whether a stop ended the request with them."""

    tokens: list[int]
    stopped: bool


def keep_tokens(
    new: Sequence[int],
    room: int,
    stops: Collection[int],
    ends_stop_word: Callable[[list[int]], bool] | None = None,
) -> Kept:
    """Clip a step's tokens to the `room` left in the output budget, then cut them after the first stop token (or,
    when `ends_stop_word` is given, after the first token that completes a stop word)."""
    kept = list(new[:room])
    for i, token in enumerate(kept):
        if token in stops or (ends_stop_word is not None and ends_stop_word(kept[: i + 1])):
            return Kept(kept[: i + 1], True)
    return Kept(kept, False)
