"""What a benchmark point runs against, and the executor that serves it: one place for `bench` and `sweep`.

A target is an engine directory (TensorRT-LLM executor), a converted checkpoint (CPU golden model; mode "ar" runs
its target alone), a Triton endpoint or an OpenAI endpoint (`dflash-trt serve`), with its decoding mode ("dflash", "ar",
"eagle3"). Bad targets are refused before anything runs: a missing engine, a DFlash engine without
`dflash_trt.json` or plugin library, an unreachable server (when the first point starts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from dflash_trt.bench.workload import Workload
from dflash_trt.decoding_modes import AR, DECODING_MODES, EAGLE3, DecodingMode
from dflash_trt.draft_schedule import FIXED, DraftLenSchedule
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import Executor
from dflash_trt.inputs import draft_tree_nodes
from dflash_trt.reference.loop_rules import longest_request

ExecutorFactory = Callable[[int], Executor]  # max requests in flight -> a fresh executor for one point


@dataclass(frozen=True)
class Target:
    mode: DecodingMode
    engine_dir: str | None = None
    checkpoint_dir: str | None = None
    triton_url: str | None = None
    openai_url: str | None = None
    plugin_library: str | None = None
    eagle_choices: tuple[tuple[int, ...], ...] | None = None
    triton_model: str = "tensorrt_llm"
    triton_protocol: str = "grpc"  # "http": a text model over HTTP generate_stream, triton_url the HTTP port
    gpus: int | None = None  # behind a server; None: a Triton server's gpu_device_ids say, else 1; an OpenAI
    # server does not say, so without it its points are not per GPU (gpus 0)
    end_id: int | None = None
    vocab_size: int | None = None  # a server's token range, when known: its responses are checked against it
    tokenizer_dir: str | None = None  # the served model's tokenizer: text models take and return text
    # The golden model's drafts by load; an engine's schedule is built into it (`build --draft_len_schedule`).
    draft_len_schedule: DraftLenSchedule = FIXED
    # A checkpoint's draft trees of N nodes, decoded by the emulated engine (the golden executor verifies chains);
    # an engine's tree is built into it (`build --draft_tree`).
    draft_tree: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in DECODING_MODES:
            raise DFlashTrtError(f"mode must be one of {', '.join(DECODING_MODES)}, got {self.mode!r}")
        given = [x for x in (self.engine_dir, self.checkpoint_dir, self.triton_url, self.openai_url) if x]
        if len(given) != 1:
            raise DFlashTrtError(
                "a benchmark target is exactly one of engine_dir, checkpoint_dir, triton_url and openai_url"
            )
        if self.checkpoint_dir and self.mode == EAGLE3:
            raise DFlashTrtError("a converted DFlash checkpoint runs as kind 'dflash' or 'ar', not 'eagle3'")
        if not self.checkpoint_dir and not self.draft_len_schedule.is_none:
            raise DFlashTrtError(
                "a draft-length schedule is given to the golden model of a checkpoint; an engine's is built into it "
                "(dflash-trt build --draft_len_schedule)"
            )
        if self.draft_tree is not None and not self.checkpoint_dir:
            raise DFlashTrtError(
                "a draft tree is given to a checkpoint's emulated engine; an engine's is built into it "
                "(dflash-trt build --draft_tree)"
            )

    @property
    def location(self) -> tuple[str, str]:
        """Which of engine_dir, checkpoint_dir, triton_url and openai_url this target is, and its value."""
        where = {
            "engine_dir": self.engine_dir,
            "checkpoint_dir": self.checkpoint_dir,
            "triton_url": self.triton_url,
            "openai_url": self.openai_url,
        }
        return next((name, value) for name, value in where.items() if value)


# What results.json's provenance calls the executor behind each kind of target.
PROVENANCE_BACKEND = {
    "engine_dir": "trtllm",
    "checkpoint_dir": "golden",
    "triton_url": "triton",
    "openai_url": "openai",
}


@lru_cache(maxsize=4)
def _golden_model(checkpoint_dir: str):
    import torch

    from dflash_trt.reference.model import load_golden_model

    # Small CPU matrices: intra-op threads only add synchronisation (many times slower on busy cores).
    torch.set_num_threads(1)
    return load_golden_model(checkpoint_dir)


def _engine_info(target: Target):
    from dflash_trt.executors.trtllm import inspect_engine

    choices = None if target.eagle_choices is None else [list(c) for c in target.eagle_choices]
    return inspect_engine(str(target.engine_dir), target.mode, target.plugin_library, choices)


def check_target(target: Target) -> None:
    """Refuse what cannot run before a sweep starts (engines and checkpoints; servers are checked on connect)."""
    if target.engine_dir:
        _engine_info(target)
    elif target.checkpoint_dir and not (Path(target.checkpoint_dir) / "config.json").is_file():
        raise DFlashTrtError(f"{target.checkpoint_dir} is not a converted checkpoint (no config.json)")
    elif target.checkpoint_dir and (target.draft_tree is not None or not target.draft_len_schedule.is_none):
        draft = _golden_model(target.checkpoint_dir).draft.spec
        nodes = draft_tree_nodes(target.draft_tree, draft.block_size - 1, draft.dflash2 is not None)
        # One schedule contract: a tree's values are node budgets, up to its nodes (draft_schedule.py).
        target.draft_len_schedule.fitted_to(nodes or draft.block_size - 1)


def vocab_size(target: Target) -> int | None:
    """The token range synthetic prompts may use; for a server, what the user said (None: it does not say)."""
    if target.checkpoint_dir:
        return _golden_model(target.checkpoint_dir).target.spec.vocab_size
    if target.engine_dir:
        return _engine_info(target).vocab_size
    return target.vocab_size


def max_positions(target: Target) -> int | None:
    """The longest request (prompt + output) the target serves (`longest_request`: what the engine it stands for
    holds); None for an engine or a server, which refuse a longer request themselves."""
    if target.checkpoint_dir:
        model = _golden_model(target.checkpoint_dir)
        drafts = 0 if target.mode == AR else model.draft.spec.block_size - 1
        return longest_request(model.target.spec.max_position_embeddings, drafts)
    return None


def executor_factory(
    target: Target,
    workload: Workload,
    max_batch_size: int | None = None,
    kv_cache_free_gpu_mem_fraction: float | None = None,
) -> ExecutorFactory:
    if target.checkpoint_dir and target.draft_tree is not None:
        return _tree_executor_factory(target, workload, max_batch_size)
    if target.checkpoint_dir:
        from dflash_trt.executors.golden import GoldenExecutor

        model = _golden_model(target.checkpoint_dir)
        stops = [] if workload.ignore_eos else list(model.target.spec.eos_token_ids)
        block = 1 if target.mode == AR else None
        # Never more slots than requests: the CPU executor allocates its caches for every slot.
        requests = len(workload.requests)
        return lambda in_flight: GoldenExecutor(
            model,
            max_batch_size or min(in_flight, requests),
            workload.max_seq_len,
            block_size=block,
            stop_token_ids=stops,
            draft_len_schedule=target.draft_len_schedule,
        )
    if target.engine_dir:
        from dflash_trt.executors.trtllm import TrtllmExecutor

        info = _engine_info(target)
        return lambda in_flight: TrtllmExecutor(
            info,
            max_batch_size=max_batch_size,
            ignore_eos=workload.ignore_eos,
            end_id=target.end_id,
            kv_cache_free_gpu_memory_fraction=kv_cache_free_gpu_mem_fraction,
        )
    if target.openai_url:
        from dflash_trt.clients.openai_http import OpenAIExecutor

        url = target.openai_url
        return lambda in_flight: OpenAIExecutor(
            url, mode=target.mode, gpus=target.gpus or 0, ignore_eos=workload.ignore_eos
        )
    from dflash_trt.clients.triton import TEXT_MODELS, TritonExecutor

    tokenizer = None
    if target.triton_model in TEXT_MODELS and target.tokenizer_dir:
        from dflash_trt.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(target.tokenizer_dir)
    end_id = -1 if workload.ignore_eos else target.end_id
    if target.triton_protocol == "http":
        from dflash_trt.clients.triton_http import TritonHttpExecutor

        url = f"http://{target.triton_url}"
        return lambda in_flight: TritonHttpExecutor(
            url, model=target.triton_model, tokenizer=tokenizer, mode=target.mode, gpus=target.gpus or 1, end_id=end_id
        )
    return lambda in_flight: TritonExecutor(
        str(target.triton_url),
        model=target.triton_model,
        mode=target.mode,
        gpus=target.gpus,
        end_id=end_id,
        vocab_size=target.vocab_size,
        tokenizer=tokenizer,
    )


def _tree_executor_factory(target: Target, workload: Workload, max_batch_size: int | None) -> ExecutorFactory:
    """The engine's network with draft trees (node budgets by load under the target's schedule) under the emulated
    runtime: its responses carry each iteration's verified node count (`Response.draft_len`)."""
    from dflash_trt.emulation.engine import EmulatedEngine
    from dflash_trt.executors.emulated import EmulatedExecutor

    assert target.checkpoint_dir is not None and target.draft_tree is not None
    checkpoint_dir, nodes, requests = target.checkpoint_dir, target.draft_tree, len(workload.requests)
    schedule = target.draft_len_schedule

    def build(in_flight: int) -> Executor:
        slots = max_batch_size or min(in_flight, requests)
        engine = EmulatedEngine(checkpoint_dir, slots, draft_len_schedule=schedule, draft_tree=nodes)
        stops = [] if workload.ignore_eos else list(engine.eos_token_ids)
        return EmulatedExecutor(engine, workload.max_seq_len, stop_token_ids=stops)

    return build


def provenance(target: Target) -> dict[str, Any]:
    """`results.json`'s provenance of a run against `target` starting now."""
    from dflash_trt.bench.provenance import collect

    kind, value = target.location
    place = str(Path(value).resolve()) if kind in ("engine_dir", "checkpoint_dir") else value
    return collect(PROVENANCE_BACKEND[kind], place)


def describe(target: Target) -> dict[str, Any]:
    kind, value = target.location
    schedule = {"draft_len_schedule": target.draft_len_schedule.text()} if target.checkpoint_dir else {}
    tree = {"draft_tree": target.draft_tree} if target.draft_tree is not None else {}
    return {"kind": target.mode, kind: value, **schedule, **tree}
