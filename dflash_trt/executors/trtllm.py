"""GPU executor: TensorRT-LLM 1.2.x's C++ executor (`tensorrt_llm.bindings.executor`), in this process.

Why the executor bindings and not the LLM API: the executor is the layer every TensorRT-LLM engine server drives
(Triton's `tensorrtllm` backend and `ModelRunnerCpp` both build exactly this `Executor`), it runs in our process,
so the plugin library we load with ctypes and the model class we register are there when the engine is
deserialized, and with `streaming=True` it answers every request once per decoding iteration in which the
request's token count grew (`LlmRequest::createResult`), each response holding only that iteration's new tokens:
the per-iteration acceptance source. The LLM API for TensorRT engines runs the same executor behind worker
processes and its own request objects, which would put the plugin, the registration and the per-iteration
responses one process away.

DFlash engines get `EagleConfig(chain eagle_choices from dflash_trt.json, greedy)` as `ModelRunnerCpp.from_dir`
builds it; AR engines get no decoding config; EAGLE engines the choices the sweep names (or the runtime's
default tree). Every symbol used here is recorded in tests/data/trtllm_api.json with the file it was read from;
this module was read against the 1.2.x sources and tested on CPU only against a scripted executor double.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from dflash_trt.decoding_modes import AR, DECODING_MODES, DFLASH, DecodingMode
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import (
    Deliver,
    Executor,
    FollowerRank,
    Request,
    Response,
    failed,
    threadsafe_deliver,
)
from dflash_trt.jsonfile import read_json_object
from dflash_trt.trtllm.engine_manifest import MANIFEST_NAME

POLL = timedelta(milliseconds=20)


@dataclass(frozen=True)
class EngineInfo:
    """What the backend needs from an engine directory, read and checked before TensorRT-LLM is imported."""

    engine_dir: Path
    mode: DecodingMode
    gpus: int
    vocab_size: int
    max_batch_size: int
    max_seq_len: int | None  # the engine's built max_seq_len (its KV window), when its config states one
    max_draft_len: int | None  # drafts per step it was built for (0 for an AR engine)
    max_position_embeddings: int | None  # the target's positions (default: the KV window)
    eos_token_ids: tuple[int, ...]  # the checkpoint's, as the engine config carries them

    @property
    def end_id(self) -> int | None:
        """The end id the runtime stops at: the first eos id."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    eagle_choices: list[list[int]] | None
    plugin_library: Path | None


def inspect_engine(
    engine_dir: str | Path,
    mode: DecodingMode = DFLASH,
    plugin_library: str | Path | None = None,
    eagle_choices: list[list[int]] | None = None,
) -> EngineInfo:
    """Check an engine directory: its config.json, and for DFlash its manifest and plugin library."""
    engine_dir = Path(engine_dir)
    if mode not in DECODING_MODES:
        raise DFlashTrtError(f"engine mode must be one of {', '.join(DECODING_MODES)}, got {mode!r}")
    if not engine_dir.is_dir():
        raise DFlashTrtError(f"engine directory {engine_dir} does not exist")
    config = read_json_object(engine_dir / "config.json", f"{engine_dir} holds no engine (no config.json)")
    pretrained = config.get("pretrained_config")
    build = config.get("build_config")
    if not isinstance(pretrained, dict) or not isinstance(build, dict):
        raise DFlashTrtError(f"{engine_dir / 'config.json'} lacks pretrained_config / build_config")
    mapping = pretrained.get("mapping") or {}
    library = None
    if mode == DFLASH:
        manifest = read_json_object(
            engine_dir / MANIFEST_NAME,
            f"{engine_dir} has no {MANIFEST_NAME}: not a DFlash engine built by `dflash-trt build` "
            "(benchmark AR or EAGLE engines as those kinds in a sweep)",
        )
        eagle_choices = manifest.get("eagle_choices")
        if not isinstance(eagle_choices, list) or not eagle_choices:
            raise DFlashTrtError(f"{engine_dir / MANIFEST_NAME} has no eagle_choices")
        library = Path(plugin_library or manifest.get("plugin_library") or "")
        if not library.is_file():
            raise DFlashTrtError(
                f"plugin library {library} not found: build plugins/ with CMake or pass --plugin_library"
            )
    eos = pretrained.get("eos_token_ids", pretrained.get("eos_token_id"))
    seq_len = _whole(build.get("max_seq_len"))
    return EngineInfo(
        engine_dir=engine_dir,
        mode=mode,
        gpus=int(mapping.get("world_size", mapping.get("tp_size", 1) * mapping.get("pp_size", 1))),
        vocab_size=int(pretrained.get("vocab_size", 0)),
        max_batch_size=int(build.get("max_batch_size", 1)),
        max_seq_len=seq_len,
        max_draft_len=_whole(build.get("max_draft_len", 0)),
        max_position_embeddings=_whole(pretrained.get("max_position_embeddings", seq_len)),
        eos_token_ids=tuple(int(i) for i in eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else (),
        eagle_choices=eagle_choices,
        plugin_library=library,
    )


def _whole(value: object) -> int | None:
    """An integer field of the engine's config.json, or None when it is missing or not an integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def executor_bindings() -> Any:
    """`tensorrt_llm.bindings.executor`, imported only when a GPU run starts."""
    from dflash_trt.trtllm.build import require_tensorrt_llm

    require_tensorrt_llm()
    import tensorrt_llm.bindings.executor as trtllm

    return trtllm


def prepare_process(info: EngineInfo) -> None:
    """Load the plugin library and register DFlashForCausalLM before the engine is deserialized."""
    if info.mode != DFLASH:
        return
    from dflash_trt.trtllm.plugin import load_plugin_library

    load_plugin_library(info.plugin_library)
    import dflash_trt.trtllm.model  # noqa: F401  (registers MODEL_MAP["DFlashForCausalLM"] for config parsing)


class TrtllmExecutor(Executor):
    """One in-process executor per run; requests carry our request id as the executor's client id."""

    def __init__(
        self,
        info: EngineInfo,
        *,
        max_batch_size: int | None = None,
        ignore_eos: bool = False,
        end_id: int | None = None,
        kv_cache_free_gpu_memory_fraction: float | None = None,
        enable_chunked_context: bool = False,
        trtllm: Any = None,
        prepare=prepare_process,
    ):
        self.info = info
        self.mode = info.mode
        self.gpus = info.gpus
        self.max_batch_size = min(max_batch_size or info.max_batch_size, info.max_batch_size)
        # -1 never matches a token (LlmRequest::validate accepts end ids from -1): requests run to max_tokens.
        end_id = info.end_id if end_id is None else end_id
        self.end_id = -1 if ignore_eos or end_id is None else end_id
        self.kv_fraction = kv_cache_free_gpu_memory_fraction
        self.enable_chunked_context = enable_chunked_context
        self.trtllm = trtllm
        self.prepare = prepare
        self.executor: Any = None
        self._executor_ids: dict[int, int] = {}  # our request id -> the executor's, for cancel_request
        self._stopping = threading.Event()
        self._poller: threading.Thread | None = None

    def executor_config(self) -> Any:
        trtllm = self.trtllm
        decoding = trtllm.DecodingConfig()
        if self.info.mode != AR and self.info.eagle_choices is not None:
            # Positional, as ModelRunnerCpp.from_dir passes it: choices, greedy_sampling, posterior_threshold,
            # use_dynamic_tree, dynamic_tree_max_topK. DFlash engines verify in-graph and ignore the greedy flag.
            decoding.eagle_config = trtllm.EagleConfig(self.info.eagle_choices, True, None, False, None)
        kv_cache = trtllm.KvCacheConfig(free_gpu_memory_fraction=self.kv_fraction, enable_block_reuse=False)
        return trtllm.ExecutorConfig(
            max_beam_width=1,
            max_batch_size=self.max_batch_size,
            kv_cache_config=kv_cache,
            decoding_config=decoding,
            enable_chunked_context=self.enable_chunked_context,
        )

    async def start(self, deliver: Deliver) -> None:
        if self.trtllm is None:
            self.trtllm = executor_bindings()
        trtllm = self.trtllm
        self.prepare(self.info)
        self.executor = trtllm.Executor(self.info.engine_dir, trtllm.ModelType.DECODER_ONLY, self.executor_config())
        if not self.executor.can_enqueue_requests():
            self.executor.shutdown()
            raise FollowerRank()
        self._stopping.clear()
        self._poller = threading.Thread(
            target=self._poll, args=(threadsafe_deliver(deliver),), daemon=True, name="trtllm-responses"
        )
        self._poller.start()

    def submit(self, request_id: int, request: Request) -> None:
        trtllm = self.trtllm
        sampling = request.sampling
        seed = {} if sampling.seed is None else {"seed": sampling.seed}
        self._executor_ids[request_id] = self.executor.enqueue_request(
            trtllm.Request(
                input_token_ids=request.input_ids,
                max_tokens=request.max_new_tokens,
                streaming=True,
                # Temperature 0 is sent explicitly: a request without one is sampled at the runtime's default 1.0.
                sampling_config=trtllm.SamplingConfig(beam_width=1, temperature=sampling.temperature, **seed),
                output_config=trtllm.OutputConfig(exclude_input_from_output=True),
                end_id=self.end_id,
                stop_words=[list(word) for word in request.stop_words] or None,
                pad_id=max(self.end_id, 0),
                client_id=request_id,
            )
        )

    def cancel(self, request_id: int) -> None:
        """`Executor.cancel_request(id)` with the id `enqueue_request` returned; the executor ends the request at
        its next iteration."""
        executor_id = self._executor_ids.pop(request_id, None)
        if executor_id is not None:
            self.executor.cancel_request(executor_id)

    def _poll(self, send: Deliver) -> None:
        while not self._stopping.is_set():
            batch = []
            for r in self.executor.await_responses(timeout=POLL):
                if r.has_error():
                    batch.append(failed(r.client_id, r.error_msg))
                    final = True
                else:
                    result = r.result
                    tokens = list(result.output_token_ids[0])
                    batch.append(Response(request_id=r.client_id, tokens=tokens, final=result.is_final))
                    final = result.is_final
                if final:
                    self._executor_ids.pop(r.client_id, None)
            if batch:
                send(batch)

    async def stop(self) -> None:
        self._stopping.set()
        if self._poller is not None:
            self._poller.join()
            self._poller = None
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
