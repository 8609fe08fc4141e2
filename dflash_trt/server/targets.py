"""What `serve` runs on: an executor, with the limits and end-of-sequence ids each kind of target states.

A TensorRT-LLM engine directory (the in-process executor, GPU host), a Triton endpoint (its `tensorrt_llm` model
over gRPC streaming), or a converted checkpoint under the emulated engine (CPU). The executor stops a request at the
engine's end id; the server also stops at every other EOS id the model lists. With --ignore_eos the engine never
stops at EOS and the server stops each request at EOS unless the request sends `ignore_eos`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_trt.decoding_modes import DFLASH
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import Executor
from dflash_trt.reference.loop_rules import built_engine_longest_request, longest_request
from dflash_trt.server.params import Limits

if TYPE_CHECKING:
    from dflash_trt.executors.trtllm import EngineInfo

DEFAULT_TRITON_BATCH = 64  # requests sent to a Triton server at once when --max_batch_size is not given


@dataclass
class ServeTarget:
    executor: Executor
    max_batch_size: int
    limits: Limits
    eos_token_ids: frozenset[int]  # the model's
    engine_stops_at_eos: bool  # False with --ignore_eos: the server stops requests at EOS unless they ignore it


def engine_longest_request(info: EngineInfo) -> int:
    """The longest request of a built engine (`built_engine_longest_request`): its KV window and the target's
    positions, less what its last step reaches past the last token; a draft tree's depth is its EAGLE choices'."""
    config, window, nodes = info.engine_dir / "config.json", info.max_seq_len, info.max_draft_len
    if window is None or nodes is None or info.max_position_embeddings is None:
        raise DFlashTrtError(f"{config} has no build_config.max_seq_len / max_draft_len")
    depth = len(info.eagle_choices) if info.eagle_choices else nodes
    longest = built_engine_longest_request(window, info.max_position_embeddings, depth, nodes)
    if longest < 2:
        raise DFlashTrtError(f"{config}: max_seq_len {window} leaves no room for a request past two draft blocks")
    return longest


def checkpoint_target(
    checkpoint_dir: str,
    max_batch_size: int | None,
    max_seq_len: int | None,
    ignore_eos: bool,
    draft_tree: int | None = None,
) -> ServeTarget:
    """The emulated engine over a converted checkpoint, verifying the chain or draft trees of `draft_tree` nodes as
    the engine `build --draft_tree` makes; requests up to what its positions hold (`longest_request`)."""
    from dflash_trt.emulation.engine import DEFAULT_MAX_BATCH_SIZE, EmulatedEngine
    from dflash_trt.executors.emulated import EmulatedExecutor

    engine = EmulatedEngine(checkpoint_dir, max_batch_size or DEFAULT_MAX_BATCH_SIZE, draft_tree=draft_tree)
    longest = longest_request(engine.max_position_embeddings, engine.depth)
    if max_seq_len is not None and max_seq_len > longest:
        raise DFlashTrtError(
            f"--max_seq_len must be <= {longest}: the target's max_position_embeddings "
            f"({engine.max_position_embeddings}) less two draft blocks of {engine.depth}, which the engine's last step "
            "reaches past a request's last token"
        )
    seq_len = max_seq_len or longest
    eos = frozenset(engine.eos_token_ids)
    executor = EmulatedExecutor(engine, seq_len, [] if ignore_eos else sorted(eos))
    return ServeTarget(
        executor=executor,
        max_batch_size=engine.max_batch_size,
        limits=Limits(max_seq_len=seq_len, vocab_size=engine.vocab_size),
        eos_token_ids=eos,
        engine_stops_at_eos=not ignore_eos,
    )


def engine_target(
    engine_dir: str, plugin_library: str | None, max_batch_size: int | None, max_seq_len: int | None, ignore_eos: bool
) -> ServeTarget:
    """TensorRT-LLM's executor over a DFlash engine; requests up to what its positions and KV window hold."""
    from dflash_trt.executors.trtllm import TrtllmExecutor, inspect_engine

    info = inspect_engine(engine_dir, DFLASH, plugin_library)
    longest = engine_longest_request(info)
    if max_seq_len is not None and max_seq_len > longest:
        raise DFlashTrtError(
            f"--max_seq_len must be <= {longest}: the engine's positions and KV window less two draft blocks"
        )
    executor = TrtllmExecutor(info, max_batch_size=max_batch_size, ignore_eos=ignore_eos)
    return ServeTarget(
        executor=executor,
        max_batch_size=executor.max_batch_size,
        limits=Limits(max_seq_len=max_seq_len or longest, vocab_size=info.vocab_size or None),
        eos_token_ids=frozenset(info.eos_token_ids),
        engine_stops_at_eos=not ignore_eos,
    )


def triton_target(
    url: str,
    model: str,
    max_batch_size: int | None,
    max_seq_len: int | None,
    eos_token_ids: list[int],
    ignore_eos: bool,
    vocab_size: int,
) -> ServeTarget:
    """A Triton server's `tensorrt_llm` model; it does not say its limits, so --max_seq_len is required, and prompt
    ids are checked against the tokenizer's vocabulary (`dflash-trt triton` refuses a tokenizer larger than the
    engine's), so an id Triton would refuse is a 400 here instead of the model's error."""
    from dflash_trt.clients.triton import TritonExecutor

    if max_seq_len is None:
        raise DFlashTrtError(
            "--triton_url needs --max_seq_len (the longest request the engine holds: the max_seq_len `dflash-trt "
            "build` was given, at most the target's max_position_embeddings less two draft blocks; Triton does not say)"
        )
    end_id = -1 if ignore_eos or not eos_token_ids else eos_token_ids[0]
    return ServeTarget(
        executor=TritonExecutor(url, model=model, end_id=end_id),
        max_batch_size=max_batch_size or DEFAULT_TRITON_BATCH,
        limits=Limits(max_seq_len=max_seq_len, vocab_size=vocab_size),
        eos_token_ids=frozenset(eos_token_ids),
        engine_stops_at_eos=not ignore_eos,
    )
