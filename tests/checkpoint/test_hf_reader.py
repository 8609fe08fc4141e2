"""HFCheckpointReader on directories written by HF transformers and the safetensors package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_trt.checkpoint.hf_reader import HFCheckpointReader
from dflash_trt.errors import DFlashTrtError


@pytest.fixture(scope="module")
def sharded_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 saved by transformers itself, split into several shards."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("qwen3") / "model"
    model.save_pretrained(out, max_shard_size="20KB")
    return out


def _expected_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    expected: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        expected.update(load_file(shard))
    return expected


def test_sharded_transformers_checkpoint_reads_every_tensor(sharded_qwen3: Path) -> None:
    index = json.loads((sharded_qwen3 / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "the fixture must really be sharded"
    expected = _expected_tensors(sharded_qwen3)
    with HFCheckpointReader(sharded_qwen3) as reader:
        assert sorted(reader.names()) == sorted(index["weight_map"]) == sorted(expected)
        assert len(reader) == len(expected)
        for name, tensor in expected.items():
            assert reader.dtype(name) == tensor.dtype == torch.bfloat16
            assert reader.shape(name) == tuple(tensor.shape)
            assert reader.nbytes(name) == tensor.numel() * 2
            assert torch.equal(reader.get(name), tensor)
            assert torch.equal(reader.get(name, copy=True), tensor)
        assert reader.nbytes_total() == sum(t.numel() * t.element_size() for t in expected.values())


def test_sharded_checkpoint_matches_the_model_state_dict(sharded_qwen3: Path) -> None:
    model = Qwen3ForCausalLM.from_pretrained(sharded_qwen3, dtype=torch.bfloat16)
    state = model.state_dict()
    with HFCheckpointReader(sharded_qwen3) as reader:
        assert sorted(reader.names()) == sorted(state)
        for name in reader.names():
            assert torch.equal(reader.get(name), state[name]), name


def test_single_model_safetensors(tmp_path: Path) -> None:
    tensors = {"fc.weight": torch.randn(4, 8), "norm.weight": torch.ones(4, dtype=torch.bfloat16)}
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "pytorch_model.bin").write_bytes(b"ignored when safetensors exist")
    with HFCheckpointReader(tmp_path) as reader:
        assert sorted(reader.names()) == sorted(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(reader.get(name), tensor)


def test_single_file_with_another_name(tmp_path: Path) -> None:
    save_file({"fc.weight": torch.arange(6.0).reshape(2, 3)}, tmp_path / "drafter.safetensors")
    with HFCheckpointReader(tmp_path) as reader:
        assert reader.names() == ["fc.weight"]
        assert torch.equal(reader.get("fc.weight"), torch.arange(6.0).reshape(2, 3))


def test_index_wins_over_stray_unreferenced_files(sharded_qwen3: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "copy"
    model_dir.mkdir()
    for path in sharded_qwen3.iterdir():
        (model_dir / path.name).write_bytes(path.read_bytes())
    save_file({"unrelated": torch.zeros(1)}, model_dir / "optimizer_leftover.safetensors")
    with HFCheckpointReader(model_dir) as reader:
        assert "unrelated" not in reader
        assert sorted(reader.names()) == sorted(_expected_tensors(sharded_qwen3))


def test_symlinked_shards_are_followed(sharded_qwen3: Path, tmp_path: Path) -> None:
    """Hub caches store shards as symlinks into a blob directory."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for path in sharded_qwen3.iterdir():
        blob = blobs / f"blob-{path.name}"
        blob.write_bytes(path.read_bytes())
        (snapshot / path.name).symlink_to(blob)
    with HFCheckpointReader(snapshot) as reader:
        expected = _expected_tensors(sharded_qwen3)
        assert sorted(reader.names()) == sorted(expected)
        name = next(iter(expected))
        assert torch.equal(reader.get(name), expected[name])


def test_unknown_tensor_name(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(1)}, tmp_path / "model.safetensors")
    with HFCheckpointReader(tmp_path) as reader, pytest.raises(DFlashTrtError, match="no tensor named 'b'"):
        reader.shape("b")
