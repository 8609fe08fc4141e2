"""Shared fixtures, and the markers `gpu` and `trtllm`, which skip with a reason where CUDA or TensorRT-LLM 1.2.x is
absent.

Tests run torch single-threaded: their tensors are tiny, and intra-op threads only add synchronisation cost
(tens of times slower when the cores are busy).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from dflash_trt.checkpoint.integrity import INTEGRITY_FILE

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


@pytest.fixture(scope="session")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The default random Qwen3 target (written by HF) and DFlash drafter (written by the `dflash` package).

    Shared by every module, so never modify it: edit a copy (`edited_copy`)."""
    from _pairs import make_pair  # imports transformers and dflash: only for the tests that use a pair

    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="session")
def converted(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pair` converted in float32 at tp 1 (shared like `pair`: never modify it)."""
    from dflash_trt.conversion.convert import convert_checkpoint

    out = tmp_path_factory.mktemp("converted") / "ckpt"
    convert_checkpoint(*pair, out, dtype="float32")
    return out


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded trained pair converted in float32 at tp 1: a drafter accepted for long stretches. Shared by
    every module that serves or emulates it, so never modify it."""
    from dflash_trt.conversion.convert import convert_checkpoint
    from dflash_trt.tiny.heldout import draft_dir, target_dir

    out = tmp_path_factory.mktemp("tiny") / "ckpt"
    convert_checkpoint(target_dir(), draft_dir(), out, dtype="float32")
    return out


@pytest.fixture(scope="session")
def poisoned_tiny(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny` with one token's embedding NaN (`_poisoned.py`): a request holding it fails in the engine."""
    from _poisoned import poisoned_copy

    return poisoned_copy(tiny, tmp_path_factory.mktemp("poisoned") / "ckpt")


EditConfig = Callable[[dict], object]


@pytest.fixture
def edited_copy(tmp_path: Path) -> Callable[..., Path]:
    """`edited_copy(source_dir, edit=None, name=None)`: a copy of a checkpoint directory under tmp_path, with
    `edit(config)` applied to its parsed config.json before it is written back. An edited copy carries no
    integrity record: it stands for what a faulty converter would have written and recorded."""

    def copy(source: Path, edit: EditConfig | None = None, name: str | None = None) -> Path:
        destination = Path(shutil.copytree(source, tmp_path / (name or source.name)))
        if edit is not None:
            config_path = destination / "config.json"
            config = json.loads(config_path.read_text())
            edit(config)
            config_path.write_text(json.dumps(config))
            (destination / INTEGRITY_FILE).unlink(missing_ok=True)
        return destination

    return copy
