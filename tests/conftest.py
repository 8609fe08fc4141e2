"""Markers `gpu` and `trtllm` skip with a reason where CUDA or TensorRT-LLM 1.2.x is absent.

Tests run torch single-threaded: their tensors are tiny, and intra-op threads only add synchronisation cost
(tens of times slower when the cores are busy).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import settings

torch.set_num_threads(1)
# Property tests draw the same examples on every run, so CI cannot pass or fail by luck.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")


def _trtllm_available() -> bool:
    return importlib.util.find_spec("tensorrt_llm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible to torch on this machine)")
    no_trtllm = pytest.mark.skip(reason="needs tensorrt_llm 1.2.x (not installable on CPU-only machines)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "trtllm" in item.keywords and not _trtllm_available():
            item.add_marker(no_trtllm)
