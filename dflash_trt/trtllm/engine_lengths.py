"""The engine's lengths (`EngineLengths`) and their arithmetic, the bound the target's RoPE tables put on them
(`check_positions`), and the lengths a build derives when none are given (`fit_lengths`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.loop_rules import longest_request
from dflash_trt.trtllm.build_limits import DEFAULT_MAX_INPUT_LEN, DEFAULT_MAX_SEQ_LEN
from dflash_trt.trtllm.build_settings import EngineBuildSettings
from dflash_trt.trtllm.checkpoint_facts import CheckpointFacts, read_checkpoint_facts
from dflash_trt.trtllm.eagle_layout import verified_drafts


@dataclass(frozen=True)
class EngineLengths:
    """How the max_seq_len a build is given becomes the lengths its engine records and runs, so a dry run can say why
    the engine's config.json holds more than was asked for [read: builder.py `build`, llmRequest.cpp `validate`]."""

    max_seq_len: int  # the build's --max_seq_len
    max_draft_len: int  # K, the draft positions per step (a draft tree's depth)
    draft_nodes: int  # the drafts verified per step, the engine's EAGLE max_draft_len: K for a chain, N for a tree
    positions: int | None  # the target's RoPE rows every request must stay within; None: not known yet

    @property
    def engine_max_seq_len(self) -> int:
        """What config.json and dflash_trt.json record."""
        return built_max_seq_len(self.max_seq_len, self.draft_nodes, self.max_draft_len)

    @property
    def longest_request(self) -> int:
        return engine_longest_request(self.max_seq_len, self.max_draft_len)

    @property
    def last_position(self) -> int:
        """The largest position the longest request's last step reaches: its next draft block, 2K past its end."""
        return self.longest_request + 2 * self.max_draft_len - 1

    @property
    def last_slot(self) -> int:
        """The largest KV slot the longest request's last step writes: its next draft block's, or (a tree's) the
        verified nodes', N past its anchor (its last-but-one token) before the rewind."""
        return max(self.last_position, self.longest_request - 2 + self.draft_nodes)

    def explanation(self) -> str:
        k, n = self.max_draft_len, self.draft_nodes
        added = f"2 x {k}" if n == k else f"{n} + {k}"
        tree = "" if n == k else f" a draft tree of {n} nodes over {k} positions:"
        text = (
            f"--max_seq_len {self.max_seq_len}:{tree} the engine records max_seq_len {self.engine_max_seq_len} = "
            f"{self.max_seq_len} + {added} (TensorRT-LLM 1.2.x's builder adds max_draft_len, and num_eagle_layers for "
            f"EAGLE); its executor runs requests of up to {self.longest_request} tokens (prompt + output + {n} drafts "
            f"<= {self.engine_max_seq_len}), whose last step reaches position {self.last_position}"
        )
        if n != k:
            text += f" and KV slot {self.last_slot} (the verified tree, before the rewind)"

        if self.positions is None:
            return text
        return f"{text} (the target's max_position_embeddings RoPE tables hold positions 0..{self.positions - 1})"

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "engine_max_seq_len": self.engine_max_seq_len,
            "longest_request": self.longest_request,
            "last_position": self.last_position,
            "last_slot": self.last_slot,
            "explanation": self.explanation(),
        }


def built_max_seq_len(max_seq_len: int, draft_nodes: int, num_eagle_layers: int) -> int:
    """builder.build() adds max_draft_len (any speculative mode: the drafts verified per step, N for a draft tree)
    and num_eagle_layers (EAGLE: our K draft positions) to max_seq_len [read: builder.py `build`]."""
    return max_seq_len + draft_nodes + num_eagle_layers


def engine_longest_request(max_seq_len: int, max_draft_len: int) -> int:
    """The longest request (prompt + output) TensorRT-LLM 1.2.x's executor runs on an engine built with `max_seq_len`:
    builder.build() makes the engine's own max_seq_len L = max_seq_len + N + K (`built_max_seq_len`; N = K for a
    chain), and `LlmRequest::validate` clips a request's output so that prompt + output + N <= L (its maxDraftLen is
    the engine's, N) [read: builder.py `build`, llmRequest.cpp `validate`], so a tree's N cancels."""
    return max_seq_len + max_draft_len


def longest_max_seq_len(positions: int, max_draft_len: int) -> int:
    """The largest max_seq_len whose engine runs only requests `positions` positions hold (`loop_rules.longest_request`:
    a request's last step reaches 2K positions past its last token): positions - 3K."""
    return longest_request(positions, max_draft_len) - max_draft_len


def engine_lengths(facts: CheckpointFacts, settings: EngineBuildSettings) -> EngineLengths:
    """The lengths an engine built with these settings records and runs, and the positions they must stay within
    (the target's RoPE tables; a sliding-window drafter's window is applied by DFlashAttention, so it bounds
    nothing)."""
    return EngineLengths(
        max_seq_len=settings.max_seq_len,
        max_draft_len=facts.max_draft_len,
        draft_nodes=verified_drafts(facts, settings),
        positions=facts.max_position_embeddings,
    )


def engine_max_seq_len(facts: CheckpointFacts, settings: EngineBuildSettings) -> int:
    """The engine's own max_seq_len (`built_max_seq_len`)."""
    return engine_lengths(facts, settings).engine_max_seq_len


def longest_buildable(facts: CheckpointFacts) -> int:
    """The largest max_seq_len this checkpoint allows: the one whose requests its positions hold."""
    return longest_max_seq_len(facts.max_position_embeddings, facts.max_draft_len)


def check_positions(facts: CheckpointFacts, max_seq_len: int) -> None:
    """Every position the engine uses must have a row in the RoPE tables: the attention plugin reads the cos/sin table
    of `max_position_embeddings` rows at the token's position with no bound check [read: functional.py
    `RopeEmbeddingUtils.create_sinusoidal_positions_for_attention_plugin`, unfusedAttentionKernels
    `applyBiasRopeUpdateKVCacheV2`], so a position past it reads other memory. The requests the executor runs on the
    engine (`engine_longest_request`) must be ones the tables hold (`loop_rules.longest_request`)."""
    k = facts.max_draft_len
    runs = engine_longest_request(max_seq_len, k)
    if runs > longest_request(facts.max_position_embeddings, k):
        raise DFlashTrtError(
            f"max_seq_len {max_seq_len} lets the executor run requests of {runs} tokens (`engine_longest_request`: "
            f"max_seq_len + {k}), whose last step reaches position {runs + 2 * k - 1}, past the "
            f"{facts.max_position_embeddings} rows of the target's max_position_embeddings RoPE tables: build with "
            f"--max_seq_len <= {longest_max_seq_len(facts.max_position_embeddings, k)}"
        )


def fit_lengths(
    checkpoint_dir: str | Path,
    settings: EngineBuildSettings,
    max_seq_len: int | None,
    max_input_len: int | None,
    max_num_tokens: int | None,
) -> EngineBuildSettings:
    """`settings` with the lengths not given derived from the model, as trtllm-build derives max_seq_len:
    max_seq_len = min(8192, what the checkpoint allows), max_input_len = min(4096, max_seq_len); and
    max_num_tokens not given written out as the builder clips it, min(its default, max_seq_len x max_batch_size), so
    the plan leaves the builder nothing to change (a value given above that is refused by `check_settings`)."""
    facts = read_checkpoint_facts(checkpoint_dir)
    seq_len = max_seq_len if max_seq_len is not None else min(DEFAULT_MAX_SEQ_LEN, max(1, longest_buildable(facts)))
    input_len = max_input_len if max_input_len is not None else min(DEFAULT_MAX_INPUT_LEN, seq_len)
    num_tokens = max_num_tokens
    if num_tokens is None:
        num_tokens = min(settings.max_num_tokens, seq_len * settings.max_batch_size)
    return replace(settings, max_seq_len=seq_len, max_input_len=input_len, max_num_tokens=num_tokens)
