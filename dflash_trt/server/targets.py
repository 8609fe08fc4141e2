"""What `serve` runs on: bench's backends, with the limits and end-of-sequence ids each kind of target states.

A TensorRT-LLM engine directory (the in-process executor, GPU host), a Triton endpoint (its `tensorrt_llm` model
over gRPC streaming), or a converted checkpoint under the emulated engine (CPU). The backend stops a request at the
engine's end id; the server also stops at every other EOS id the model lists. With --ignore_eos the engine never
stops at EOS and the server stops each request at EOS unless the request sends `ignore_eos`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_trt.bench.driver import Backend
from dflash_trt.decoding_modes import DFLASH
from dflash_trt.errors import DFlashTrtError
from dflash_trt.jsonfile import read_json_object
from dflash_trt.reference.loop_rules import longest_request
from dflash_trt.server.params import Limits

DEFAULT_TRITON_BATCH = 64  # requests sent to a Triton server at once when --max_batch_size is not given


@dataclass
class ServeTarget:
    backend: Backend
    max_batch_size: int
    limits: Limits
    eos_token_ids: frozenset[int]  # the model's
    engine_stops_at_eos: bool  # False with --ignore_eos: the server stops requests at EOS unless they ignore it


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise DFlashTrtError(f"{flag} must be >= 1, got {value}")


def engine_longest_request(config: dict, path: Path) -> int:
    """The longest request of a built engine: its KV window (build_config.max_seq_len, which the builder widened
    by 2K) and the target's positions, less the two draft blocks its last step reaches past the last token."""
    build, pretrained = config.get("build_config") or {}, config.get("pretrained_config") or {}
    window, draft_len = build.get("max_seq_len"), build.get("max_draft_len", 0)
    positions = pretrained.get("max_position_embeddings", window)
    if not isinstance(window, int) or not isinstance(draft_len, int) or not isinstance(positions, int):
        raise DFlashTrtError(f"{path} has no build_config.max_seq_len / max_draft_len")
    longest = longest_request(min(window, positions), draft_len)
    if longest < 2:
        raise DFlashTrtError(f"{path}: max_seq_len {window} leaves no room for a request past two draft blocks")
    return longest


def checkpoint_target(
    checkpoint_dir: str, max_batch_size: int | None, max_seq_len: int | None, ignore_eos: bool
) -> ServeTarget:
    """The emulated engine over a converted checkpoint; requests up to what its positions hold (`longest_request`)."""
    from dflash_trt.bench.backends.emulated import EmulatedBackend
    from dflash_trt.emulation.engine import EmulatedEngine

    _positive(max_batch_size, "--max_batch_size")
    _positive(max_seq_len, "--max_seq_len")
    engine = EmulatedEngine(checkpoint_dir, max_batch_size or 8)
    longest = longest_request(engine.max_position_embeddings, engine.k)
    if max_seq_len is not None and max_seq_len > longest:
        raise DFlashTrtError(
            f"--max_seq_len must be <= {longest}: the target's max_position_embeddings "
            f"({engine.max_position_embeddings}) less two draft blocks of {engine.k}, which the engine's last step "
            "reaches past a request's last token"
        )
    seq_len = max_seq_len or longest
    eos = frozenset(engine.eos_token_ids)
    backend = EmulatedBackend(engine, seq_len, [] if ignore_eos else sorted(eos))
    return ServeTarget(backend, engine.max_batch_size, Limits(seq_len, engine.vocab_size), eos, not ignore_eos)


def engine_target(
    engine_dir: str, plugin_library: str | None, max_batch_size: int | None, max_seq_len: int | None, ignore_eos: bool
) -> ServeTarget:
    """TensorRT-LLM's executor over a DFlash engine; requests up to what its positions and KV window hold."""
    from dflash_trt.bench.backends.trtllm import TrtllmBackend, inspect_engine

    _positive(max_batch_size, "--max_batch_size")
    _positive(max_seq_len, "--max_seq_len")
    info = inspect_engine(engine_dir, DFLASH, plugin_library)
    config = read_json_object(Path(engine_dir) / "config.json", f"{engine_dir} holds no engine (no config.json)")
    seq_len = engine_longest_request(config, Path(engine_dir) / "config.json")
    if max_seq_len is not None and max_seq_len > seq_len:
        raise DFlashTrtError(
            f"--max_seq_len must be <= {seq_len}: the engine's positions and KV window less two draft blocks"
        )
    seq_len = max_seq_len or seq_len
    listed = config["pretrained_config"].get("eos_token_ids", config["pretrained_config"].get("eos_token_id"))
    eos_ids = listed if isinstance(listed, list) else [] if listed is None else [listed]
    eos = frozenset(int(i) for i in eos_ids)
    backend = TrtllmBackend(info, max_batch_size=max_batch_size, ignore_eos=ignore_eos)
    limits = Limits(seq_len, info.vocab_size or None)
    return ServeTarget(backend, backend.max_batch_size, limits, eos, not ignore_eos)


def triton_target(
    url: str,
    model: str,
    max_batch_size: int | None,
    max_seq_len: int | None,
    eos_token_ids: list[int],
    ignore_eos: bool,
) -> ServeTarget:
    """A Triton server's `tensorrt_llm` model; it does not say its limits, so --max_seq_len is required."""
    from dflash_trt.bench.backends.triton import TritonBackend

    _positive(max_batch_size, "--max_batch_size")
    _positive(max_seq_len, "--max_seq_len")
    if max_seq_len is None:
        raise DFlashTrtError(
            "--triton_url needs --max_seq_len (the longest request the engine holds: the max_seq_len `dflash-trt "
            "build` was given, at most the target's max_position_embeddings less two draft blocks; Triton does not say)"
        )
    end_id = -1 if ignore_eos or not eos_token_ids else eos_token_ids[0]
    backend = TritonBackend(url, model=model, end_id=end_id)
    limits = Limits(max_seq_len, None)
    return ServeTarget(
        backend, max_batch_size or DEFAULT_TRITON_BATCH, limits, frozenset(eos_token_ids), not ignore_eos
    )
