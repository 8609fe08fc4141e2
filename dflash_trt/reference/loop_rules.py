"""The engine loop's rules that every decoder of this toolkit shares: which requests it accepts, the output budget an
engine's runtime grants (`engine_output_budget`), how many new tokens a step may keep and where a stop ends a
request. Written once so the golden loop, the golden executor and the emulated executor cannot drift apart."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from dflash_trt.errors import DFlashTrtError


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


def engine_output_budget(
    index: int, prompt_len: int, max_new_tokens: int, max_seq_len: int, max_draft_len: int, max_input_len: int
) -> int:
    """The output budget a TensorRT-LLM 1.2.x executor grants a request of an engine whose built max_seq_len (after
    the builder's + 2K) is `max_seq_len`: a prompt longer than the runtime's `max_input_len` is refused, and the
    budget is clipped (a warning there, not an error) so that prompt + output + K fits `max_seq_len` [read:
    llmRequest.cpp `LlmRequest::validate`, executorImpl.cpp]. The runtime's max input length is max_seq_len - 1 with
    chunked context, else min(max_seq_len - 1, max_num_tokens) [read: trtGptModel.h]. A request left no budget by
    the clip is refused here (what the runtime then does was not read)."""
    if prompt_len > max_input_len:
        raise DFlashTrtError(
            f"prompt {index}: {prompt_len} tokens exceed the engine's maximum input length {max_input_len}"
        )
    room = max_seq_len - prompt_len - max_draft_len
    if room < 1:
        raise DFlashTrtError(
            f"prompt {index}: {prompt_len} tokens leave no output within the engine's max_seq_len {max_seq_len} "
            f"(prompt + output + {max_draft_len} drafts must fit it)"
        )
    return min(max_new_tokens, room)


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
