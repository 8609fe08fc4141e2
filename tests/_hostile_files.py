"""Builders of safetensors bytes with arbitrary (possibly lying) headers, for hostile-input tests."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch


def raw_safetensors(header: dict | bytes, data: bytes = b"", header_len: int | None = None) -> bytes:
    """The bytes of a safetensors file with `header` (a dict is JSON-encoded) followed by `data`.

    `header_len` overrides the 8-byte length prefix so it can disagree with the header actually written.
    """
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode("utf-8")
    length = len(encoded) if header_len is None else header_len
    return struct.pack("<Q", length) + encoded + data


def write_raw(path: Path, header: dict | bytes, data: bytes = b"", header_len: int | None = None) -> Path:
    path.write_bytes(raw_safetensors(header, data, header_len))
    return path


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a contiguous CPU tensor (any dtype, 0-dim included)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
