"""The registry of emulated TensorRT / TensorRT-LLM 1.2.x symbols, and the loader that runs our unmodified
`dflash_trt/trtllm/model.py` against them.

`load_engine_module()` installs the stand-in modules in `sys.modules` only while it executes fresh copies of
`dflash_trt/trtllm/plugin.py`, `verify.py` and `model.py` (their `import tensorrt` / `from tensorrt_llm... import`
lines then bind the stand-ins), and restores `sys.modules` afterwards, so nothing else in the process sees a fake
TensorRT-LLM. The one substitution outside the stand-ins is the plugin library loader: dlopen of the CUDA library
becomes the registration of the emulated plugin creator.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_trt.emulation import functional, layers, models, plugins, trt
from dflash_trt.emulation.functional import EmulationError
from dflash_trt.emulation.module import Module, ModuleList, Parameter


class KVCacheType(enum.IntEnum):
    CONTINUOUS = 0
    PAGED = 1
    DISABLED = 2


def pad_vocab_size(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


# Exactly the symbols the engine's sources take from tensorrt / tensorrt_llm (tests/emulation/test_emulation.py
# checks it).
REGISTRY: dict[str, dict[str, Any]] = {
    "tensorrt": {
        name: getattr(trt, name)
        for name in (
            "float32",
            "int32",
            "PluginField",
            "PluginFieldCollection",
            "PluginFieldType",
            "TensorRTPhase",
            "TopKOperation",
            "UnaryOperation",
            "get_plugin_registry",
        )
    },
    "tensorrt_llm": {},
    "tensorrt_llm._common": {"default_net": functional.default_net, "default_trtnet": functional.default_trtnet},
    "tensorrt_llm._utils": {"pad_vocab_size": pad_vocab_size},
    "tensorrt_llm.bindings": {"KVCacheType": KVCacheType},
    "tensorrt_llm.functional": {
        name: getattr(functional, name)
        for name in (
            "Tensor",
            "Conditional",
            "LayerNormType",
            "_create_tensor",
            "constant",
            "eq",
            "minimum",
            "where",
            "cast",
            "div",
            "tanh",
            "exp",
            "unary",
            "shape",
            "unsqueeze",
            "concat",
            "slice",
            "expand",
            "gather",
            "index_select",
            "arange",
            "cumsum",
            "sum",
            "max",
            "argmax",
            "gather_last_token_logits",
        )
    },
    "tensorrt_llm.layers": {
        name: getattr(layers, name)
        for name in (
            "Attention",
            "ColumnLinear",
            "Embedding",
            "GatedMLP",
            "RmsNorm",
            "KeyValueCacheParams",
            "SpecDecodingParams",
        )
    }
    | {"AttentionMaskType": functional.AttentionMaskType},
    "tensorrt_llm.models": {"MODEL_MAP": models.MODEL_MAP},
    "tensorrt_llm.models.generation_mixin": {"GenerationMixin": models.GenerationMixin},
    "tensorrt_llm.models.llama": {},
    "tensorrt_llm.models.llama.config": {"LLaMAConfig": models.LLaMAConfig},
    "tensorrt_llm.models.llama.model": {"LLaMADecoderLayer": models.LLaMADecoderLayer},
    "tensorrt_llm.models.modeling_utils": {
        "DecoderModelForCausalLM": models.DecoderModelForCausalLM,
        "PretrainedConfig": models.PretrainedConfig,
    },
    "tensorrt_llm.models.qwen": {},
    "tensorrt_llm.models.qwen.config": {"QWenConfig": models.QWenConfig},
    "tensorrt_llm.models.qwen.model": {"QWenDecoderLayer": models.QWenDecoderLayer},
    "tensorrt_llm.module": {"Module": Module, "ModuleList": ModuleList},
    "tensorrt_llm.quantization": {},
    "tensorrt_llm.quantization.functional": {"dequantize": functional.dequantize},
    "tensorrt_llm.parameter": {"Parameter": Parameter},
}
ENGINE_PACKAGE = Path(__file__).resolve().parents[1] / "trtllm"
# The engine's sources that import TensorRT-LLM, in the order they are executed (model.py imports the others).
ENGINE_SOURCES = ("plugin", "verify", "drafting", "tree", "generation_attention", "model")
_engine_modules: dict[str, types.ModuleType] = {}


def _stand_in_modules() -> dict[str, types.ModuleType]:
    modules = {}
    for name, symbols in REGISTRY.items():
        module = types.ModuleType(name, "emulated TensorRT-LLM 1.2.x symbol subset (dflash_trt.emulation)")
        module.__dict__.update(symbols)
        module.__path__ = []  # a package, so submodule imports resolve through sys.modules
        modules[name] = module
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules


_STAND_INS = _stand_in_modules()


def _exec_source(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise EmulationError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def stand_ins_installed(extra: tuple[str, ...] = ()) -> Iterator[None]:
    """`tensorrt` / `tensorrt_llm` resolve to the stand-ins inside; `sys.modules` is restored on exit.

    Also needed around every forward: `kv_injection_layer` imports TensorRT inside the function.
    """
    replaced = [*REGISTRY, *extra]
    saved = {name: sys.modules[name] for name in replaced if name in sys.modules}
    try:
        sys.modules.update(_STAND_INS)
        yield
    finally:
        for name in replaced:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def engine_source(source: str) -> types.ModuleType:
    """One of the engine's sources (`ENGINE_SOURCES`), executed (once per process) against the stand-ins."""
    if not _engine_modules:
        import dflash_trt.trtllm.build_plan  # noqa: F401  (its modules bound to the real plugin, not the fresh copy)

        names = tuple(f"dflash_trt.trtllm.{name}" for name in ENGINE_SOURCES)
        with stand_ins_installed(names):
            fresh = {name: _exec_source(name, ENGINE_PACKAGE / f"{name.rpartition('.')[2]}.py") for name in names}
        plugin = fresh["dflash_trt.trtllm.plugin"]
        setattr(plugin, "load_plugin_library", plugins.load_emulated_plugin_library)  # noqa: B010
        _engine_modules.update({name.rpartition(".")[2]: module for name, module in fresh.items()})
    return _engine_modules[source]


def load_engine_module() -> types.ModuleType:
    """`dflash_trt/trtllm/model.py`, executed (once per process) against the stand-ins."""
    return engine_source("model")
