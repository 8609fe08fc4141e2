"""What the two host-simulation test files share: the plugins' host drivers compiled with g++ into a ctypes library,
the drivers' dtype codes (the kernels' `DataType` enums) and ctypes shorthands."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
CUDA_INCLUDE = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
INPUT_TYPES = {torch.float16: 0, torch.bfloat16: 1}
CACHE_TYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
I32, I64, F32, P = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def compile_host_driver(out_dir: Path, driver: str) -> ctypes.CDLL:
    """`plugins/tests/<driver>.cpp` built as a shared library and loaded (skips without g++ or the CUDA headers the
    kernels' fp8 types come from); the caller declares the entry points it calls."""
    compiler = shutil.which("g++")
    if compiler is None or not (CUDA_INCLUDE / "cuda_fp8.h").is_file():
        pytest.skip("needs g++ and the CUDA toolkit headers (cuda_fp8.h)")
    out = out_dir / f"lib{driver}.so"
    cmd = [compiler, "-std=c++17", "-O2", "-shared", "-fPIC", "-Wall", "-Werror", f"-I{PLUGINS / 'include'}"]
    source = PLUGINS / "tests" / f"{driver}.cpp"
    subprocess.run([*cmd, f"-I{CUDA_INCLUDE}", str(source), "-o", str(out)], check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(out))


def pointer(t: torch.Tensor | None) -> int | None:
    """A contiguous tensor's address for the driver (None stays a null pointer)."""
    if t is None:
        return None
    assert t.is_contiguous()
    return t.data_ptr()
