"""The stand-in `tensorrt` module: the few TensorRT Python symbols our engine code and the stand-in layers touch.

`DataType` keeps TensorRT 10's enum values (`NvInferRuntimeBase.h`), because plugin fields carry `int(dtype)` as
`type_id`. The plugin registry holds the creators the emulation registers (our KV-injection plugin when the
emulated plugin library is "loaded").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch


class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9
    FP4 = 10


float32, float16, int8, int32, bool, uint8, fp8, bfloat16, int64, fp4 = (  # noqa: A001 (TensorRT's own names)
    DataType.FLOAT,
    DataType.HALF,
    DataType.INT8,
    DataType.INT32,
    DataType.BOOL,
    DataType.UINT8,
    DataType.FP8,
    DataType.BF16,
    DataType.INT64,
    DataType.FP4,
)

TORCH_DTYPES = {
    DataType.FLOAT: torch.float32,
    DataType.HALF: torch.float16,
    DataType.BF16: torch.bfloat16,
    DataType.INT32: torch.int32,
    DataType.INT64: torch.int64,
    DataType.BOOL: torch.bool,
    DataType.INT8: torch.int8,
    DataType.UINT8: torch.uint8,
    DataType.FP8: torch.float8_e4m3fn,
}
FROM_TORCH = {v: k for k, v in TORCH_DTYPES.items()}
# tensorrt_llm/_utils.py `_str_to_trt_dtype_dict`.
STR_DTYPES = {
    "float32": DataType.FLOAT,
    "float16": DataType.HALF,
    "bfloat16": DataType.BF16,
    "int32": DataType.INT32,
    "int64": DataType.INT64,
    "bool": DataType.BOOL,
    "int8": DataType.INT8,
    "fp8": DataType.FP8,
}


class TopKOperation(enum.IntEnum):
    MAX = 0
    MIN = 1


class UnaryOperation(enum.IntEnum):
    """The members the network uses, with TensorRT 10's values (`NvInfer.h` `UnaryOperation`)."""

    EXP = 0
    LOG = 1


class PluginFieldType(enum.IntEnum):
    FLOAT16 = 0
    FLOAT32 = 1
    FLOAT64 = 2
    INT8 = 3
    INT16 = 4
    INT32 = 5
    CHAR = 6
    DIMS = 7
    UNKNOWN = 8


class TensorRTPhase(enum.IntEnum):
    BUILD = 0
    RUNTIME = 1


class TensorLocation(enum.IntEnum):
    DEVICE = 0
    HOST = 1


@dataclass
class PluginField:
    name: str
    data: Any
    type: PluginFieldType


class PluginFieldCollection(list):
    """A list of PluginField, as TensorRT's Python binding accepts it."""


class PluginRegistry:
    """`trt.get_plugin_registry()`: creators by (name, version, namespace)."""

    def __init__(self) -> None:
        self._creators: dict[tuple[str, str, str], Any] = {}

    def register_creator(self, creator: Any, namespace: str) -> None:
        self._creators[(creator.name, creator.version, namespace)] = creator

    def get_creator(self, name: str, version: str, namespace: str = "") -> Any:
        return self._creators.get((name, version, namespace))


_REGISTRY = PluginRegistry()


def get_plugin_registry() -> PluginRegistry:
    return _REGISTRY
