"""Triton `config.pbtxt` as data: small dataclasses rendered to protobuf text format.

Writing the text ourselves keeps repository generation free of `tritonclient`; the tests parse every rendered
file with Triton's own `model_config_pb2`, where an unknown field is an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: str  # a Triton DataType name, e.g. "TYPE_INT32"
    dims: tuple[int, ...]
    optional: bool = False
    reshape: tuple[int, ...] | None = None
    allow_ragged_batch: bool = False


@dataclass(frozen=True)
class EnsembleStep:
    model_name: str
    input_map: dict[str, str]  # step model input -> ensemble tensor
    output_map: dict[str, str]  # step model output -> ensemble tensor


@dataclass(frozen=True)
class ModelConfig:
    name: str
    max_batch_size: int
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    backend: str | None = None
    platform: str | None = None
    parameters: dict[str, str] = field(default_factory=dict)
    instance_count: int | None = None
    decoupled: bool | None = None
    dynamic_batching: bool = False
    max_queue_delay_microseconds: int = 0
    steps: tuple[EnsembleStep, ...] = ()


def _quote(text: str) -> str:
    # JSON string escaping is valid protobuf text-format escaping for the characters we emit.
    return json.dumps(text, ensure_ascii=False)


def _dims(dims: tuple[int, ...]) -> str:
    return "[ " + ", ".join(str(d) for d in dims) + " ]" if dims else "[ ]"


def _tensor(t: Tensor) -> list[str]:
    lines = ["  {", f"    name: {_quote(t.name)}", f"    data_type: {t.data_type}", f"    dims: {_dims(t.dims)}"]
    if t.reshape is not None:
        lines.append(f"    reshape: {{ shape: {_dims(t.reshape)} }}")
    if t.optional:
        lines.append("    optional: true")
    if t.allow_ragged_batch:
        lines.append("    allow_ragged_batch: true")
    lines.append("  }")
    return lines


def _tensor_list(keyword: str, tensors: tuple[Tensor, ...]) -> list[str]:
    body: list[str] = []
    for i, t in enumerate(tensors):
        block = _tensor(t)
        if i < len(tensors) - 1:
            block[-1] += ","
        body += block
    return [f"{keyword} ["] + body + ["]"]


def _step(step: EnsembleStep) -> list[str]:
    lines = ["    {", f"      model_name: {_quote(step.model_name)}", "      model_version: -1"]
    for kind, mapping in (("input_map", step.input_map), ("output_map", step.output_map)):
        for key, value in mapping.items():
            lines.append(f"      {kind} {{ key: {_quote(key)} value: {_quote(value)} }}")
    lines.append("    }")
    return lines


def render(config: ModelConfig) -> str:
    lines = [f"name: {_quote(config.name)}"]
    if config.backend:
        lines.append(f"backend: {_quote(config.backend)}")
    if config.platform:
        lines.append(f"platform: {_quote(config.platform)}")
    lines.append(f"max_batch_size: {config.max_batch_size}")
    if config.decoupled is not None:
        lines.append(f"model_transaction_policy {{ decoupled: {'true' if config.decoupled else 'false'} }}")
    if config.dynamic_batching:
        lines += [
            "dynamic_batching {",
            f"  preferred_batch_size: [ {config.max_batch_size} ]",
            f"  max_queue_delay_microseconds: {config.max_queue_delay_microseconds}",
            "}",
        ]
    lines += _tensor_list("input", config.inputs)
    lines += _tensor_list("output", config.outputs)
    if config.instance_count is not None:
        lines.append(f"instance_group [ {{ count: {config.instance_count} kind: KIND_CPU }} ]")
    for key, value in config.parameters.items():
        lines.append(f"parameters {{ key: {_quote(key)} value {{ string_value: {_quote(value)} }} }}")
    if config.steps:
        lines.append("ensemble_scheduling {")
        lines.append("  step [")
        for i, step in enumerate(config.steps):
            block = _step(step)
            if i < len(config.steps) - 1:
                block[-1] += ","
            lines += block
        lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"
