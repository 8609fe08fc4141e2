"""Write a Triton model repository that serves a DFlash engine with the stock `tensorrtllm` backend.

The layout is the inflight-batcher one TensorRT-LLM users know: `ensemble` chains `preprocessing` (Python,
tokenizer) -> `tensorrt_llm` (C++ backend, the engine in EAGLE mode with one chain of drafts) -> `postprocessing`
(Python, detokenizer), and `tensorrt_llm_bls` offers the same request interface from one Python model. Every
value comes from the engine's manifest or a build profile, so no placeholder is left to fill by hand;
`launch_triton.sh` preloads the DFlash plugin library before the backend loads the engine.

For a converted checkpoint instead of an engine (a CPU-served repository), `tensorrt_llm` is a Python model with
the same tensors, batching and decoupling that runs the engine network under the emulation
(`emulated_llm.py`); every other model is the same.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from dflash_trt import chat, sampling_rules
from dflash_trt.checkpoint.atomic import InputPaths, atomic_directory
from dflash_trt.errors import DFlashTrtError
from dflash_trt.jsonfile import read_json_object, strict_json
from dflash_trt.reference.loop_rules import built_engine_longest_request, longest_request
from dflash_trt.sampling_rules import ENGINE_SAMPLING
from dflash_trt.tokenizer import load_tokenizer
from dflash_trt.triton import processing as P
from dflash_trt.triton.pbtxt import EnsembleStep, ModelConfig, Tensor, render
from dflash_trt.triton.serving import ServingSettings, override_serving
from dflash_trt.trtllm.checkpoint_facts import read_checkpoint_facts
from dflash_trt.trtllm.eagle_layout import chain_eagle_choices, check_tree_nodes
from dflash_trt.trtllm.engine_manifest import MANIFEST_NAME
from dflash_trt.trtllm.plugin import LIBRARY_ENV

ENSEMBLE = "ensemble"
PREPROCESSING = "preprocessing"
TENSORRT_LLM = "tensorrt_llm"
POSTPROCESSING = "postprocessing"
BLS = "tensorrt_llm_bls"
SETTINGS_FILE = "dflash_triton.json"
LAUNCH_SCRIPT = "launch_triton.sh"
CLIENT_FILE = "client.py"
PROCESSING_FILE = "dflash_processing.py"
SAMPLING_RULES_FILE = "dflash_sampling_rules.py"
CHAT_FILE = "dflash_chat.py"
# tensorrt_llm's parameter placing each replica (model instance) on its GPUs.
GPU_DEVICE_IDS = "gpu_device_ids"
# A stub in a Python model's folder replaces the backend's own (python_backend `StubLauncher::Launch` [read]).
PYTHON_STUB_FILE = "triton_python_backend_stub"
# Makes libdflash_trt_plugins.so register its creators when it is loaded (plugins/src/pluginRegistration.cpp):
# the tensorrtllm backend never calls initDflashTrtPlugins itself.
REGISTER_ON_LOAD_ENV = "DFLASH_TRT_LOAD_PLUGINS"

# Outputs the tensorrtllm backend writes when a request sets return_perf_metrics: all must be declared, or the
# backend fails while filling the response.
PERF_OUTPUTS = (
    ("kv_cache_alloc_new_blocks", "TYPE_INT32"),
    ("kv_cache_reused_blocks", "TYPE_INT32"),
    ("kv_cache_alloc_total_blocks", "TYPE_INT32"),
    ("arrival_time_ns", "TYPE_INT64"),
    ("first_scheduled_time_ns", "TYPE_INT64"),
    ("first_token_time_ns", "TYPE_INT64"),
    ("last_token_time_ns", "TYPE_INT64"),
    ("acceptance_rate", "TYPE_FP32"),
    ("total_accepted_draft_tokens", "TYPE_INT32"),
    ("total_draft_tokens", "TYPE_INT32"),
)


SERVING_DEFAULTS = ServingSettings()
DEFAULT_CPU_MAX_SEQ_LEN = 2048


@dataclass(frozen=True)
class RepositorySettings:
    """Everything the repository depends on; written to dflash_triton.json for review.

    The serving knobs mirror `ServingSettings` (build them from one with `serving_fields`). Paths are made
    absolute here: the tensorrtllm backend refuses a relative `gpt_model_path` (with a misleading "both encoder
    and decoder model paths are empty"), and Triton does not start in the directory the repository was written from.
    """

    engine_dir: str  # "" for a CPU-served repository
    tokenizer_dir: str
    plugin_library: str  # "" for a CPU-served repository
    max_batch_size: int
    max_input_len: int
    max_draft_len: int  # drafts verified per request: the chain's, or a draft tree's nodes
    world_size: int
    max_temperature: float
    max_seq_len: int  # the longest request (prompt + output) the engine holds; the preprocessing and BLS refuse more
    # The engine's draft-length table (its manifest's `draft_len_schedule`): drafts per step vary with the load
    # unless `none` (recorded for review; the client counts verify steps, so it needs no drafts per step).
    draft_len_schedule: str = "none"
    kv_cache_free_gpu_mem_fraction: float = SERVING_DEFAULTS.kv_cache_free_gpu_mem_fraction
    batch_scheduler_policy: str = SERVING_DEFAULTS.batch_scheduler_policy
    enable_chunked_context: bool = SERVING_DEFAULTS.enable_chunked_context
    enable_kv_cache_reuse: bool = SERVING_DEFAULTS.enable_kv_cache_reuse
    max_queue_delay_microseconds: int = SERVING_DEFAULTS.max_queue_delay_microseconds
    instance_count: int = SERVING_DEFAULTS.instance_count
    max_attention_window_size: int | None = SERVING_DEFAULTS.max_attention_window_size
    replicas: int = SERVING_DEFAULTS.replicas
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    eagle_depth: int | None = None  # the EAGLE choices' depth, a draft tree's positions; None: max_draft_len
    chat_template_kwargs: str = "{}"  # JSON for {"messages": [...]} queries (dflash_trt.chat)
    # A CPU-served repository: the converted checkpoint the emulated engine loads, its page size.
    checkpoint_dir: str = ""
    tokens_per_block: int = 32

    def __post_init__(self) -> None:
        if bool(self.engine_dir) == bool(self.checkpoint_dir):
            raise DFlashTrtError("a Triton repository serves either an engine or a converted checkpoint")
        if self.max_seq_len < 2:
            raise DFlashTrtError(f"a Triton repository's longest request must be >= 2 tokens, got {self.max_seq_len}")
        if any(c in self.plugin_library for c in LD_PRELOAD_SEPARATORS):
            raise DFlashTrtError(
                f"--plugin_library {self.plugin_library!r}: the dynamic loader splits LD_PRELOAD at spaces and colons "
                "and would silently skip it; move the library to a path without them"
            )
        for name in PATH_FIELDS:
            if getattr(self, name):
                object.__setattr__(self, name, os.path.abspath(getattr(self, name)))
        # Whoever builds the settings, the serving knobs obey the profile schema (block reuse stays off, ...).
        override_serving(SERVING_DEFAULTS, {name: getattr(self, name) for name in ServingSettings.model_fields})


LD_PRELOAD_SEPARATORS = (" ", ":", "\t", "\n")
# The settings that name files; every one is written into a config or script as an absolute path.
PATH_FIELDS = ("engine_dir", "tokenizer_dir", "plugin_library", "checkpoint_dir")


def relocated(s: RepositorySettings, path_map: list[tuple[str, str]]) -> RepositorySettings:
    """The settings with every path under a mapped prefix rewritten: the repository is written here, validated
    against the files here, and served on a host that mounts them elsewhere (`--path_map HERE=THERE`)."""
    changes = {}
    for name in PATH_FIELDS:
        path = getattr(s, name)
        for old, new in path_map:
            if path and (path == old or path.startswith(old.rstrip("/") + "/")):
                changes[name] = new.rstrip("/") + path[len(old.rstrip("/")) :]
                break
    return replace(s, **changes)


def serving_fields(serving: ServingSettings) -> dict:
    """RepositorySettings keyword arguments for validated serving knobs (the field names are the same)."""
    return serving.model_dump()


def eagle_choices_parameter(max_draft_len: int) -> str:
    """The chain as the backend's `eagle_choices` string: "{0}, {0, 0}, ..." (braces delimit each path)."""
    return ", ".join("{" + ", ".join(str(i) for i in path) + "}" for path in chain_eagle_choices(max_draft_len))


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _scalar(name: str, dtype: str, optional: bool = False) -> Tensor:
    return Tensor(name, dtype, (1,), optional=optional)


def _backend_scalar(name: str, dtype: str, optional: bool = True) -> Tensor:
    # The C++ backend reads scalars per request without the [1] dimension.
    return Tensor(name, dtype, (1,), optional=optional, reshape=())


def preprocessing_config(s: RepositorySettings) -> ModelConfig:
    return ModelConfig(
        name=PREPROCESSING,
        backend="python",
        max_batch_size=s.max_batch_size,
        inputs=(
            _scalar(P.QUERY, "TYPE_STRING"),
            _scalar(P.REQUEST_OUTPUT_LEN, "TYPE_INT32"),
            _scalar(P.TEMPERATURE, "TYPE_FP32", optional=True),
            _scalar(P.END_ID, "TYPE_INT32", optional=True),
            _scalar(P.PAD_ID, "TYPE_INT32", optional=True),
            Tensor(P.STOP_WORDS, "TYPE_STRING", (-1,), optional=True),
            Tensor(P.BAD_WORDS, "TYPE_STRING", (-1,), optional=True),
            *(_scalar(name, dtype, optional=True) for name, dtype in P.SAMPLING_INPUTS.items()),
        ),
        outputs=(
            Tensor(P.INPUT_ID, "TYPE_INT32", (-1,)),
            _scalar(P.REQUEST_INPUT_LEN, "TYPE_INT32"),
            _scalar(P.OUT_REQUEST_OUTPUT_LEN, "TYPE_INT32"),
            Tensor(P.STOP_WORDS_IDS, "TYPE_INT32", (2, -1)),
            Tensor(P.BAD_WORDS_IDS, "TYPE_INT32", (2, -1)),
            _scalar(P.OUT_END_ID, "TYPE_INT32"),
            _scalar(P.OUT_PAD_ID, "TYPE_INT32"),
            _scalar(P.OUT_TEMPERATURE, "TYPE_FP32"),
        ),
        instance_count=s.instance_count,
        parameters={
            "tokenizer_dir": s.tokenizer_dir,
            "add_special_tokens": _flag(s.add_special_tokens),
            "max_input_len": str(s.max_input_len),
            "max_seq_len": str(s.max_seq_len),
            "max_temperature": repr(float(s.max_temperature)),
            "chat_template_kwargs": s.chat_template_kwargs,
        },
    )


def postprocessing_config(s: RepositorySettings) -> ModelConfig:
    """One instance and no dynamic batching: the incomplete characters it holds back between a request's streamed
    responses live in that instance's memory, and Triton runs one instance's requests in arrival order."""
    return ModelConfig(
        name=POSTPROCESSING,
        backend="python",
        max_batch_size=s.max_batch_size,
        inputs=(Tensor(P.TOKENS_BATCH, "TYPE_INT32", (-1, -1)), Tensor(P.SEQUENCE_LENGTH, "TYPE_INT32", (-1,))),
        outputs=(Tensor(P.OUTPUT, "TYPE_STRING", (-1,)),),
        instance_count=1,
        parameters={"tokenizer_dir": s.tokenizer_dir, "skip_special_tokens": _flag(s.skip_special_tokens)},
    )


def tensorrt_llm_config(s: RepositorySettings) -> ModelConfig:
    """The C++ backend over the engine, or for a checkpoint the Python model with the same I/O over the emulation."""
    return ModelConfig(
        name=TENSORRT_LLM,
        backend="python" if s.checkpoint_dir else "tensorrtllm",
        max_batch_size=s.max_batch_size,
        decoupled=True,
        dynamic_batching=True,
        max_queue_delay_microseconds=s.max_queue_delay_microseconds,
        inputs=(
            Tensor(P.LLM_INPUT_IDS, "TYPE_INT32", (-1,), allow_ragged_batch=True),
            _backend_scalar(P.LLM_INPUT_LENGTHS, "TYPE_INT32", optional=False),
            _backend_scalar(P.LLM_REQUEST_OUTPUT_LEN, "TYPE_INT32", optional=False),
            _backend_scalar(P.LLM_END_ID, "TYPE_INT32"),
            _backend_scalar(P.LLM_PAD_ID, "TYPE_INT32"),
            Tensor(P.LLM_STOP_WORDS, "TYPE_INT32", (2, -1), optional=True, allow_ragged_batch=True),
            Tensor(P.LLM_BAD_WORDS, "TYPE_INT32", (2, -1), optional=True, allow_ragged_batch=True),
            _backend_scalar(P.LLM_TEMPERATURE, "TYPE_FP32"),
            _backend_scalar(P.LLM_RANDOM_SEED, "TYPE_UINT64"),
            _backend_scalar(P.LLM_STREAMING, "TYPE_BOOL"),
            _backend_scalar(P.LLM_STOP, "TYPE_BOOL"),
            _backend_scalar(P.LLM_RETURN_PERF_METRICS, "TYPE_BOOL"),
        ),
        outputs=(
            Tensor(P.LLM_OUTPUT_IDS, "TYPE_INT32", (-1, -1)),
            Tensor(P.LLM_SEQUENCE_LENGTH, "TYPE_INT32", (-1,)),
            *(_scalar(name, dtype) for name, dtype in PERF_OUTPUTS),
        ),
        instance_count=s.replicas,
        parameters=emulated_llm_parameters(s) if s.checkpoint_dir else tensorrtllm_parameters(s),
    )


def replica_device_ids(replicas: int, world_size: int) -> str:
    """The backend's `gpu_device_ids`: one `;`-separated group of `world_size` GPUs per model instance (instance i
    takes group i; model_state.cc / model_instance_state.cc [read])."""
    return ";".join(",".join(str(gpu) for gpu in range(r * world_size, (r + 1) * world_size)) for r in range(replicas))


def replica_gpus(device_ids: str) -> tuple[int, int]:
    """(replicas, GPUs) of a served `gpu_device_ids` value: how a client learns the node behind a server."""
    groups = [group for group in device_ids.split(";") if group.strip()]
    try:
        gpus = {int(gpu) for group in groups for gpu in group.split(",")}
    except ValueError:
        raise DFlashTrtError(f"{GPU_DEVICE_IDS} {device_ids!r} is not ';'-separated groups of GPU numbers") from None
    return len(groups), len(gpus)


def emulated_llm_parameters(s: RepositorySettings) -> dict[str, str]:
    """What `emulated_llm.Server.from_parameters` reads; `draft_tree` only for a tree engine (its nodes)."""
    tree = {} if s.eagle_depth in (None, s.max_draft_len) else {"draft_tree": str(s.max_draft_len)}
    return {
        "checkpoint_dir": s.checkpoint_dir,
        "max_batch_size": str(s.max_batch_size),
        "max_seq_len": str(s.max_seq_len),
        "tokens_per_block": str(s.tokens_per_block),
        **tree,
    }


def tensorrtllm_parameters(s: RepositorySettings) -> dict[str, str]:
    return {
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": s.engine_dir,
        "max_beam_width": "1",
        "decoding_mode": "eagle",
        "eagle_choices": eagle_choices_parameter(s.eagle_depth or s.max_draft_len),
        "batch_scheduler_policy": s.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": repr(s.kv_cache_free_gpu_mem_fraction),
        "enable_chunked_context": _flag(s.enable_chunked_context),
        "enable_kv_cache_reuse": _flag(s.enable_kv_cache_reuse),
        "exclude_input_in_output": "true",
        # The backend looks these three up unconditionally; empty values leave guided decoding off.
        "tokenizer_dir": s.tokenizer_dir,
        "guided_decoding_backend": "",
        "xgrammar_tokenizer_info_path": "",
        **({GPU_DEVICE_IDS: replica_device_ids(s.replicas, s.world_size)} if s.replicas > 1 else {}),
    }


# The request interface shared by `ensemble` and `tensorrt_llm_bls`.
REQUEST_INPUTS = (
    _scalar(P.TEXT_INPUT, "TYPE_STRING"),
    _scalar(P.MAX_TOKENS, "TYPE_INT32"),
    _scalar(P.STREAM, "TYPE_BOOL", optional=True),
    _scalar(P.REQUEST_TEMPERATURE, "TYPE_FP32", optional=True),
    _scalar(P.REQUEST_END_ID, "TYPE_INT32", optional=True),
    _scalar(P.REQUEST_PAD_ID, "TYPE_INT32", optional=True),
    Tensor(P.REQUEST_STOP_WORDS, "TYPE_STRING", (-1,), optional=True),
    Tensor(P.REQUEST_BAD_WORDS, "TYPE_STRING", (-1,), optional=True),
    _scalar(P.REQUEST_PERF_METRICS, "TYPE_BOOL", optional=True),
    _scalar(P.REQUEST_RANDOM_SEED, "TYPE_UINT64", optional=True),
    *(_scalar(name, dtype, optional=True) for name, dtype in P.SAMPLING_INPUTS.items()),
)
REQUEST_OUTPUTS = (
    Tensor(P.TEXT_OUTPUT, "TYPE_STRING", (-1,)),
    *(_scalar(name, dtype) for name, dtype in PERF_OUTPUTS if name in P.SPEC_METRICS),
)


def _intermediate(name: str) -> str:
    return "_" + name


def ensemble_config(s: RepositorySettings) -> ModelConfig:
    return ModelConfig(
        name=ENSEMBLE,
        platform="ensemble",
        max_batch_size=s.max_batch_size,
        inputs=REQUEST_INPUTS,
        outputs=REQUEST_OUTPUTS,
        steps=(
            EnsembleStep(
                PREPROCESSING,
                input_map={pre: request for request, pre in P.REQUEST_TO_PRE.items()},
                output_map={pre: _intermediate(pre) for pre in P.PRE_TO_LLM},
            ),
            EnsembleStep(
                TENSORRT_LLM,
                input_map={
                    **{llm: _intermediate(pre) for pre, llm in P.PRE_TO_LLM.items()},
                    **{llm: request for request, llm in P.REQUEST_TO_LLM.items()},
                },
                output_map={
                    P.LLM_OUTPUT_IDS: _intermediate(P.TOKENS_BATCH),
                    P.LLM_SEQUENCE_LENGTH: _intermediate(P.SEQUENCE_LENGTH),
                    **{name: name for name in P.SPEC_METRICS},
                },
            ),
            EnsembleStep(
                POSTPROCESSING,
                input_map={name: _intermediate(name) for name in (P.TOKENS_BATCH, P.SEQUENCE_LENGTH)},
                output_map={P.OUTPUT: P.TEXT_OUTPUT},
            ),
        ),
    )


def bls_config(s: RepositorySettings) -> ModelConfig:
    """One Python model doing pre-processing, the tensorrt_llm call and streaming detokenization that never splits
    a character. Its `execute` is a coroutine serving many requests at once, so `instance_count` instances fill
    the engine's batch as the ensemble does, without the `max_batch_size` stubs (each importing transformers) that
    one-request-per-instance models need."""
    return ModelConfig(
        name=BLS,
        backend="python",
        max_batch_size=s.max_batch_size,
        decoupled=True,
        inputs=REQUEST_INPUTS,
        outputs=REQUEST_OUTPUTS,
        instance_count=s.instance_count,
        parameters={
            "tokenizer_dir": s.tokenizer_dir,
            "add_special_tokens": _flag(s.add_special_tokens),
            "skip_special_tokens": _flag(s.skip_special_tokens),
            "max_input_len": str(s.max_input_len),
            "max_seq_len": str(s.max_seq_len),
            "max_temperature": repr(float(s.max_temperature)),
            "chat_template_kwargs": s.chat_template_kwargs,
            "tensorrt_llm_model_name": TENSORRT_LLM,
        },
    )


def model_configs(s: RepositorySettings) -> dict[str, ModelConfig]:
    return {
        ENSEMBLE: ensemble_config(s),
        PREPROCESSING: preprocessing_config(s),
        TENSORRT_LLM: tensorrt_llm_config(s),
        POSTPROCESSING: postprocessing_config(s),
        BLS: bls_config(s),
    }


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def cpu_launch_script() -> str:
    """Bash launcher of a CPU-served repository: no engine, so no plugin library and one server process."""
    return """#!/usr/bin/env bash
# Start Triton on this CPU-served DFlash repository (tensorrt_llm runs the emulated engine in a Python model, whose
# environment must have dflash_trt installed). Extra arguments go to tritonserver (e.g. --grpc-port 9001).
# Environment override: TRITONSERVER (server binary).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${TRITONSERVER:-tritonserver}" --model-repository="$HERE" --disable-auto-complete-config "$@"
"""


def launch_script(s: RepositorySettings) -> str:
    """Bash launcher: preload the plugin library, then one tritonserver (or one MPI rank per GPU for TP > 1)."""
    if s.checkpoint_dir:
        return cpu_launch_script()
    return f"""#!/usr/bin/env bash
# Start Triton on this DFlash repository. The engine's layers reference the DFlash plugins, so their library is
# preloaded into every server process, and told to register its plugins on load, before the tensorrtllm backend
# deserializes the engine. Extra arguments go to tritonserver (e.g. --grpc-port 9001).
# Environment overrides: {LIBRARY_ENV} (plugin library), TRITONSERVER (server binary), MPIRUN (world size > 1).
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
DEFAULT_PLUGIN={_sh_quote(s.plugin_library)}
PLUGIN="${{{LIBRARY_ENV}:-$DEFAULT_PLUGIN}}"
WORLD_SIZE={s.world_size}
REPLICAS={s.replicas}
TRITONSERVER="${{TRITONSERVER:-tritonserver}}"
MPIRUN="${{MPIRUN:-mpirun}}"
if [[ ! -f "$PLUGIN" ]]; then
  echo "launch_triton.sh: DFlash plugin library $PLUGIN not found; build plugins/ or set {LIBRARY_ENV}" >&2
  exit 1
fi
PRELOAD="$PLUGIN${{LD_PRELOAD:+:$LD_PRELOAD}}"
SERVER_ARGS=(--model-repository="$HERE" --disable-auto-complete-config)
if (( REPLICAS > 1 )); then
  # One tensorrt_llm instance per replica, each on its own GPUs (gpu_device_ids): the backend's orchestrator mode
  # spawns the executor workers (which inherit the preload), so one server process and no mpirun.
  LD_PRELOAD="$PRELOAD" {REGISTER_ON_LOAD_ENV}=1 TRTLLM_ORCHESTRATOR=1 exec "$TRITONSERVER" "${{SERVER_ARGS[@]}}" "$@"
fi
if (( WORLD_SIZE == 1 )); then
  LD_PRELOAD="$PRELOAD" {REGISTER_ON_LOAD_ENV}=1 exec "$TRITONSERVER" "${{SERVER_ARGS[@]}}" "$@"
fi
# One rank per GPU, each preloading the plugin: rank 0 serves every model and the endpoints, the other ranks only
# host tensorrt_llm's workers.
CMD=("$MPIRUN" --allow-run-as-root -x "LD_PRELOAD=$PRELOAD" -x {REGISTER_ON_LOAD_ENV}=1)
for (( rank = 0; rank < WORLD_SIZE; rank++ )); do
  (( rank > 0 )) && CMD+=(:)
  CMD+=(-n 1 "$TRITONSERVER" "${{SERVER_ARGS[@]}}" "--backend-config=python,shm-region-prefix-name=prefix${{rank}}_")
  if (( rank == 0 )); then
    CMD+=("$@")
  else
    CMD+=(--model-control-mode=explicit --load-model=tensorrt_llm --allow-http=false --allow-grpc=false
          --allow-metrics=false)
  fi
done
exec "${{CMD[@]}}"
"""


def python_stub_wrapper() -> str:
    """The stub each Python model of the repository starts through: the backend's own stub, without the plugin.

    launch_triton.sh preloads the plugin library (and with it TensorRT and CUDA) for the server, and the python
    backend starts every stub from the server, with its environment: without this wrapper every stub would map
    the library and register the plugins. The backend runs the stub as `bash -c "exec STUB MODEL_PATH SHM_REGION
    SHM_SIZE SHM_GROWTH PARENT_PID PYTHON_LIB IPC_HANDLE NAME"` and first once without arguments, expecting exit
    status 1 (otherwise it makes the file execute-only, which a script cannot survive); the real stub is
    `PYTHON_LIB/triton_python_backend_stub` [read: python_backend src/stub_launcher.cc, not run against 2.51's
    tensorrtllm container]. The two short-lived shells before the stub still start with the preload.
    """
    return f"""#!/usr/bin/env bash
# Starts Triton's python backend stub without the DFlash plugin preload; see dflash_trt/triton/repository.py.
(( $# >= 6 )) || exit 1
unset LD_PRELOAD {REGISTER_ON_LOAD_ENV}
exec "$6/{PYTHON_STUB_FILE}" "$@"
"""


def _source(name: str) -> Path:
    return Path(__file__).with_name(name)


def write_repository(
    s: RepositorySettings, output_dir: str | Path, overwrite: bool = False, inputs: InputPaths | None = None
) -> Path:
    """Write the whole repository atomically (nothing appears under `output_dir` unless all of it is written).

    The engine, tokenizer and plugin library it serves, and any further `inputs`, must lie outside `output_dir`.
    """
    python_models = {PREPROCESSING: "preprocessing.py", POSTPROCESSING: "postprocessing.py", BLS: "bls.py"}
    if s.checkpoint_dir:
        python_models[TENSORRT_LLM] = "tensorrt_llm.py"
    served = {
        "--engine_dir": s.engine_dir,
        "--checkpoint_dir": s.checkpoint_dir,
        "--tokenizer_dir": s.tokenizer_dir,
        "--plugin_library": s.plugin_library,
    }
    served = {flag: path for flag, path in served.items() if path}
    with atomic_directory(output_dir, "triton", overwrite, {**served, **(inputs or {})}) as staging:
        for name, config in model_configs(s).items():
            version_dir = staging / name / "1"
            version_dir.mkdir(parents=True)
            (staging / name / "config.pbtxt").write_text(render(config))
            if name in python_models:
                stub = staging / name / PYTHON_STUB_FILE
                stub.write_text(python_stub_wrapper())
                stub.chmod(0o755)
                shutil.copyfile(_source("models") / python_models[name], version_dir / "model.py")
                shutil.copyfile(_source("processing.py"), version_dir / PROCESSING_FILE)
                shutil.copyfile(Path(sampling_rules.__file__), version_dir / SAMPLING_RULES_FILE)
                shutil.copyfile(Path(chat.__file__), version_dir / CHAT_FILE)
        script = staging / LAUNCH_SCRIPT
        script.write_text(launch_script(s))
        script.chmod(0o755)
        shutil.copyfile(_source("client.py"), staging / CLIENT_FILE)
        (staging / SETTINGS_FILE).write_text(strict_json(asdict(s), indent=2) + "\n")
    return Path(output_dir)


def check_tokenizer(tokenizer_dir: str | Path, vocab_size: int, served: str) -> None:
    """Refuse a tokenizer the repository's Python models could not load, or one of another model: more tokens
    than the served vocabulary, or no end-of-sequence token to stop on."""
    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer is None:
        raise DFlashTrtError(f"--tokenizer_dir {tokenizer_dir} holds no tokenizer (tokenizer.json or vocab.json)")
    if len(tokenizer) > vocab_size:
        raise DFlashTrtError(
            f"--tokenizer_dir {tokenizer_dir}: {len(tokenizer)} tokens, more than the {vocab_size} of {served}; "
            "it belongs to another model"
        )
    if tokenizer.eos_token_id is None:
        raise DFlashTrtError(f"--tokenizer_dir {tokenizer_dir}: the tokenizer defines no eos token to stop on")


def max_temperature_for_sampling(sampling: str | None) -> float:
    """Engines that verify by exact-match sampling take any temperature; older greedy-only engines none above 0."""
    return math.inf if sampling == ENGINE_SAMPLING else 0.0


def _read_json(path: Path, what: str) -> dict:
    return read_json_object(path, f"{path.parent} is not a DFlash engine directory: {what} {path.name} is missing")


def _engine_longest_request(engine_dir: Path, build: dict, pretrained: dict, manifest: dict) -> int:
    """The longest request the engine holds (`built_engine_longest_request`: its KV window and positions less what
    its last step reaches past a request's last token), so the preprocessing refuses what would read positions past
    the table; a draft tree verifies max_draft_len nodes over its EAGLE choices' depth."""
    nodes = int(manifest["max_draft_len"])
    depth = len(manifest.get("eagle_choices") or []) or nodes
    window = int(build["max_seq_len"])
    positions = int(pretrained.get("max_position_embeddings", window))
    longest = built_engine_longest_request(window, positions, depth, nodes)
    if longest < 2:
        raise DFlashTrtError(f"{engine_dir}: max_seq_len {window} leaves no room for a request past two draft blocks")
    return longest


def settings_from_engine(
    engine_dir: str | Path, tokenizer_dir: str | Path, serving: ServingSettings | None = None
) -> RepositorySettings:
    """Settings for a built engine: sizes from its config.json and DFlash manifest, serving knobs as given."""
    engine_dir = Path(engine_dir).absolute()
    manifest = _read_json(engine_dir / MANIFEST_NAME, "the DFlash manifest")
    engine_config = _read_json(engine_dir / "config.json", "TensorRT-LLM's engine config")
    build = engine_config.get("build_config") or {}
    pretrained = engine_config.get("pretrained_config") or {}
    vocab_size = pretrained.get("vocab_size")
    if isinstance(vocab_size, int):
        check_tokenizer(tokenizer_dir, vocab_size, f"the engine {engine_dir}")
    try:
        return RepositorySettings(
            engine_dir=str(engine_dir),
            tokenizer_dir=str(tokenizer_dir),
            plugin_library=str(manifest["plugin_library"]),
            max_batch_size=int(build.get("max_batch_size", manifest["max_batch_size"])),
            max_input_len=int(build["max_input_len"]),
            max_draft_len=int(manifest["max_draft_len"]),
            eagle_depth=len(manifest.get("eagle_choices") or []) or None,
            world_size=int(manifest.get("tp_size", 1)),
            max_temperature=max_temperature_for_sampling(manifest.get("sampling")),
            max_seq_len=_engine_longest_request(engine_dir, build, pretrained, manifest),
            draft_len_schedule=str(manifest.get("draft_len_schedule", "none")),
            **serving_fields(serving or ServingSettings()),
        )
    except KeyError as exc:
        raise DFlashTrtError(
            f"{engine_dir}: engine metadata lacks {exc.args[0]!r}; rebuild with dflash-trt build"
        ) from None


def _checkpoint_tree(checkpoint_dir: Path, draft_tree: int | None) -> int | None:
    """The nodes of the draft tree the CPU-served engine verifies (the build's rule, `check_tree_nodes`); None for
    the chain."""
    if draft_tree is None:
        return None
    facts = read_checkpoint_facts(checkpoint_dir)
    return check_tree_nodes(draft_tree, facts.max_draft_len, facts.selector_top_k is not None) or None


def settings_from_checkpoint(
    checkpoint_dir: str | Path,
    tokenizer_dir: str | Path,
    max_batch_size: int,
    max_seq_len: int | None = None,
    serving: ServingSettings | None = None,
    draft_tree: int | None = None,
) -> RepositorySettings:
    """Settings for a CPU-served repository over a converted (TP 1) checkpoint, its engine verifying the chain or
    draft trees of `draft_tree` nodes (as `build --draft_tree` builds it); `max_seq_len` defaults to the longest
    request the target's context holds (`longest_request`, by the draft positions, a tree's depth), capped at
    DEFAULT_CPU_MAX_SEQ_LEN so the KV pool stays small on a laptop."""
    checkpoint_dir = Path(checkpoint_dir).absolute()
    config = read_json_object(
        checkpoint_dir / "config.json", f"{checkpoint_dir} is not a converted checkpoint: config.json is missing"
    )
    try:
        mapping = config.get("mapping") or {}
        if int(mapping.get("tp_size", 1)) != 1 or int(mapping.get("pp_size", 1)) != 1:
            raise DFlashTrtError(f"{checkpoint_dir}: the CPU-served engine runs one rank; convert with --tp_size 1")
        longest = int(config["max_position_embeddings"])
        max_draft_len = int(config["max_draft_len"])
        vocab_size = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DFlashTrtError(f"{checkpoint_dir}/config.json is not a DFlash checkpoint config: {exc}") from None
    if max_batch_size < 1:
        raise DFlashTrtError(f"--max_batch_size must be >= 1, got {max_batch_size}")
    check_tokenizer(tokenizer_dir, vocab_size, f"the checkpoint {checkpoint_dir}")
    tree = _checkpoint_tree(checkpoint_dir, draft_tree)
    longest = longest_request(longest, max_draft_len)
    seq_len = min(longest, DEFAULT_CPU_MAX_SEQ_LEN) if max_seq_len is None else max_seq_len
    if not 2 <= seq_len <= longest:
        raise DFlashTrtError(
            f"--max_seq_len must be in 2..{longest} (the target's context less the two draft blocks the engine's "
            f"last step reaches past a request's last token), got {seq_len}"
        )
    return RepositorySettings(
        engine_dir="",
        tokenizer_dir=str(tokenizer_dir),
        plugin_library="",
        max_batch_size=max_batch_size,
        max_input_len=seq_len - 1,
        max_draft_len=tree or max_draft_len,
        eagle_depth=max_draft_len if tree else None,
        world_size=1,
        max_temperature=math.inf,
        checkpoint_dir=str(checkpoint_dir),
        max_seq_len=seq_len,
        **serving_fields(serving or ServingSettings()),
    )
