"""Corrupt, lying or malicious checkpoints are refused with a DFlashTrtError, never another failure."""

from __future__ import annotations

import json
import os
import pickle
import struct
import tempfile
import tracemalloc
from pathlib import Path

import pytest
import safetensors.torch
import torch
from _hostile_files import entry, raw_safetensors, tensor_bytes, write_raw
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from dflash_trt.checkpoint.hf_reader import MAX_INDEX_BYTES, HFCheckpointReader
from dflash_trt.checkpoint.safetensors_io import MAX_HEADER_BYTES, SafetensorsFile, tensor_has_nonfinite
from dflash_trt.errors import DFlashTrtError

F32_PAIR = tensor_bytes(torch.tensor([1.0, 2.0]))


def _refused(path: Path, message: str) -> None:
    with pytest.raises(DFlashTrtError, match=message):
        SafetensorsFile(path)


# ---------------------------------------------------------------- single files


def test_empty_and_tiny_files(tmp_path: Path) -> None:
    (tmp_path / "empty.safetensors").write_bytes(b"")
    _refused(tmp_path / "empty.safetensors", "fewer than 8")
    (tmp_path / "tiny.safetensors").write_bytes(b"\x02\x00\x00")
    _refused(tmp_path / "tiny.safetensors", "fewer than 8")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    _refused(tmp_path / "nowhere.safetensors", "cannot read")
    _refused(tmp_path, "not a regular file")


@pytest.mark.parametrize("claimed", [1000, 2**40, 2**63, 2**64 - 1])
def test_header_length_beyond_the_file(tmp_path: Path, claimed: int) -> None:
    header = {"w": entry("F32", [2], 0, 8)}
    path = write_raw(tmp_path / "lie.safetensors", header, F32_PAIR, header_len=claimed)
    tracemalloc.start()
    try:
        with pytest.raises(DFlashTrtError, match="header"):
            SafetensorsFile(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"refusing a {claimed}-byte header claim allocated {peak} bytes"


def test_header_above_the_limit_is_refused_before_reading(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "huge.safetensors", b"{}", header_len=MAX_HEADER_BYTES + 1)
    with open(path, "r+b") as handle:  # sparse, so the file really is large enough to hold that header
        handle.truncate(MAX_HEADER_BYTES + 64)
    tracemalloc.start()
    try:
        _refused(path, "above the 104857600-byte limit")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_truncated_data(tmp_path: Path) -> None:
    path = tmp_path / "full.safetensors"
    save_file({"a": torch.randn(8, 8), "b": torch.randn(16)}, path)
    data = path.read_bytes()
    for cut in (1, 7, 64, 300):
        truncated = tmp_path / f"cut{cut}.safetensors"
        truncated.write_bytes(data[:-cut])
        _refused(truncated, "truncated or corrupt")


def test_truncated_inside_the_header(tmp_path: Path) -> None:
    path = tmp_path / "full.safetensors"
    save_file({"a": torch.randn(2)}, path)
    (tmp_path / "cut.safetensors").write_bytes(path.read_bytes()[:20])
    _refused(tmp_path / "cut.safetensors", "truncated or corrupt")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"{not json}", "not valid JSON"),
        (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}', "not valid JSON"),
        (b"\xff\xfe{}", "not a JSON object"),
        (b'{"\xff": 1}', "not UTF-8"),
        (b"[1, 2]", "not a JSON object"),
        (b" " + json.dumps({"w": entry("F32", [2], 0, 8)}).encode(), "not a JSON object"),
        (b"{" + b"[" * 200_000, "nested too deeply|not valid JSON"),
        (b'{"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "nested too deeply"),
        (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "w": 1}', "duplicate key 'w'"),
        (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [-0, 8]}}', "negative integer -0"),
    ],
)
def test_malformed_header_json(tmp_path: Path, header: bytes, message: str) -> None:
    _refused(write_raw(tmp_path / "bad.safetensors", header, F32_PAIR), message)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"__metadata__": {"k": 1}, "w": entry("F32", [2], 0, 8)}, "must map strings to strings"),
        ({"__metadata__": ["k"], "w": entry("F32", [2], 0, 8)}, "must map strings to strings"),
        ({"w": [0, 8]}, "exactly the keys"),
        ({"w": {"dtype": "F32", "shape": [2]}}, "exactly the keys"),
        ({"w": {**entry("F32", [2], 0, 8), "extra": 1}}, "exactly the keys"),
        ({"w": entry("F128", [2], 0, 8)}, "unsupported dtype 'F128'"),
        ({"w": entry(4, [2], 0, 8)}, "unsupported dtype 4"),
        ({"w": entry("F32", [-2], 0, 8)}, "negative integer -2"),
        ({"w": entry("F32", [2.0], 0, 8)}, "not a list of non-negative integers"),
        ({"w": entry("F32", [True, 2], 0, 8)}, "not a list of non-negative integers"),
        ({"w": entry("F32", "2", 0, 8)}, "not a list of non-negative integers"),
        ({"w": entry("F32", [2], 8, 0)}, "invalid data_offsets"),
        ({"w": entry("F32", [2], -8, 0)}, "negative integer -8"),
        ({"w": entry("F32", [2], 0, 8.0)}, "invalid data_offsets"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}}, "invalid data_offsets"),
        ({"w": entry("F32", [3], 0, 8)}, "needs 12 bytes but its data_offsets span 8"),
        ({"w": entry("BF16", [2], 0, 8)}, "needs 4 bytes but its data_offsets span 8"),
        ({"w": entry("F32", [2**62, 2**62], 0, 8)}, "needs more than 2..64 bytes but its data_offsets span 8"),
        ({"w": entry("F32", [2**62] * 200_000, 0, 8)}, "200000 dimensions, more than 16"),
        ({"w": entry("F32", [2**62] * 16, 0, 8)}, "needs more than 2..64 bytes but its data_offsets span 8"),
        ({"w": entry("F32", [2**62] * 15 + [0], 0, 0), "v": entry("F32", [2], 0, 8)}, None),
        ({"w": entry("F32", [1] * 16 + [2], 0, 8)}, "17 dimensions"),
        ({"w\n" * 10_000: entry("F32", [3], 0, 8)}, "needs 12 bytes"),
        ({"w": entry("F32", [2], 0, 8), "v": entry("F32", [1], 4, 8)}, "overlaps"),
        ({"w": entry("F32", [1], 0, 4), "v": entry("F32", [1], 4, 8), "u": entry("I8", [4], 2, 6)}, "overlaps"),
        ({"w": entry("F32", [1], 4, 8)}, "4 unreferenced bytes precede tensor 'w'"),
        ({"w": entry("F32", [1], 0, 4)}, "describes 4 data bytes but the file holds 8"),
        ({"w": entry("F32", [4], 0, 16)}, "truncated or corrupt: tensor 'w' ends at byte 16 of a 8-byte"),
        ({"w": entry("F32", [2], 2**70, 2**70 + 8)}, "unreferenced bytes"),
    ],
)
def test_lying_header_entries(tmp_path: Path, header: dict, message: str | None) -> None:
    path = write_raw(tmp_path / "bad.safetensors", header, F32_PAIR)
    if message is None:  # legal, if odd: checked here so the refusals above are not over-eager
        with SafetensorsFile(path) as reader:
            assert reader.shape("w") == (2**62,) * 15 + (0,)
            assert torch.equal(reader.get("v"), torch.tensor([1.0, 2.0]))
        return
    with pytest.raises(DFlashTrtError, match=message) as refusal:
        SafetensorsFile(path)
    assert len(str(refusal.value)) < 400, "errors quote untrusted values briefly"


def test_error_names_the_file(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "named-shard.safetensors", {"w": entry("F32", [3], 0, 8)}, F32_PAIR)
    with pytest.raises(DFlashTrtError, match="named-shard.safetensors"):
        SafetensorsFile(path)


def test_nan_and_inf_weights_are_detected(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    poisoned = torch.zeros(64, 64, dtype=torch.float16)
    poisoned[63, 63] = float("inf")
    save_file({"good": torch.ones(4), "nan": torch.tensor([0.0, float("nan")]), "inf": poisoned}, path)
    with HFCheckpointReader(tmp_path) as reader:
        flagged = {name for name in reader.names() if tensor_has_nonfinite(reader.get(name))}
    assert flagged == {"nan", "inf"}


# ---------------------------------------------------------- fuzzing a real file

_FIXTURE_TENSORS = {
    "model.layers.0.self_attn.q_proj.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "model.norm.weight": torch.tensor([1.5, -2.0, 0.25], dtype=torch.bfloat16),
    "lm_head.weight": torch.arange(6, dtype=torch.int8).reshape(2, 3),
}
_FIXTURE = safetensors.torch.save(_FIXTURE_TENSORS, metadata={"format": "pt"})
_HEADER_END = 8 + struct.unpack("<Q", _FIXTURE[:8])[0]


def _load_ours(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]] | None:
    try:
        with SafetensorsFile(path) as reader:
            return {name: _describe(reader.get(name)) for name in reader.names()}
    except DFlashTrtError:
        return None


def _load_oracle(data: bytes) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]] | None:
    try:
        return {name: _describe(tensor) for name, tensor in safetensors.torch.load(data).items()}
    except Exception:  # the oracle's own rejection, whatever form it takes
        return None


def _describe(tensor: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], bytes]:
    return tensor.dtype, tuple(tensor.shape), tensor_bytes(tensor)


def _check_mutant(data: bytes) -> None:
    """Ours refuses with DFlashTrtError or loads exactly what the safetensors package loads."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mutant.safetensors"
        path.write_bytes(data)
        tracemalloc.start()
        try:
            ours = _load_ours(path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < (1 << 20) + 16 * len(data), f"{peak} bytes allocated for a {len(data)}-byte file"
    if ours is not None:
        assert ours == _load_oracle(data)


def test_unmodified_fixture_loads_like_the_oracle() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fixture.safetensors"
        path.write_bytes(_FIXTURE)
        assert _load_ours(path) == _load_oracle(_FIXTURE) is not None


_FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(
    st.lists(
        st.tuples(st.integers(0, _HEADER_END - 1), st.integers(0, 255)),
        min_size=1,
        max_size=4,
    )
)
def test_mutated_header_bytes(mutations: list[tuple[int, int]]) -> None:
    data = bytearray(_FIXTURE)
    for position, value in mutations:
        data[position] = value
    _check_mutant(bytes(data))


_HEADER_TEXT = _FIXTURE[8:_HEADER_END]
_JSON_BYTES = st.sampled_from([bytes([c]) for c in b'{}[]",:0123456789- ']) | st.binary(min_size=1, max_size=3)


@_FUZZ
@given(st.integers(0, len(_HEADER_TEXT)), st.integers(0, 8), _JSON_BYTES, st.booleans())
def test_spliced_header_text(start: int, deleted: int, inserted: bytes, fix_length: bool) -> None:
    """Edits that change the header's length, with and without a matching length prefix."""
    text = _HEADER_TEXT[:start] + inserted + _HEADER_TEXT[start + deleted :]
    header_len = len(text) if fix_length else len(_HEADER_TEXT)
    _check_mutant(raw_safetensors(text, _FIXTURE[_HEADER_END:], header_len=header_len))


@_FUZZ
@given(st.integers(0, 2**64 - 1) | st.integers(0, 2 * len(_FIXTURE)))
def test_any_header_length_prefix(header_len: int) -> None:
    _check_mutant(struct.pack("<Q", header_len) + _FIXTURE[8:])


@_FUZZ
@given(st.integers(0, len(_FIXTURE) - 1))
def test_any_truncation(length: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "short.safetensors"
        path.write_bytes(_FIXTURE[:length])
        with pytest.raises(DFlashTrtError):
            SafetensorsFile(path)


# ------------------------------------------------------------- HF directories


class _Tripwire:
    """Unpickling this creates a marker file: proof that a pickle was (wrongly) loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _write_tripwire(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(_Tripwire(marker)))


@pytest.mark.parametrize("file_name", ["pytorch_model.bin", "model.pt", "weights.pth", "last.ckpt"])
def test_pickle_only_directory_is_refused_without_unpickling(tmp_path: Path, file_name: str) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    marker = tmp_path / "unpickled"
    _write_tripwire(model_dir / file_name, marker)
    assert not marker.exists()
    with pytest.raises(DFlashTrtError, match=f"only pickle weights \\({file_name}\\).*never loaded"):
        HFCheckpointReader(model_dir)
    assert not marker.exists()


def test_pickle_next_to_safetensors_is_never_touched(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    marker = tmp_path / "unpickled"
    _write_tripwire(model_dir / "pytorch_model.bin", marker)
    save_file({"w": torch.ones(2)}, model_dir / "model.safetensors")
    with HFCheckpointReader(model_dir) as reader:
        assert torch.equal(reader.get("w"), torch.ones(2))
    assert not marker.exists()


def test_no_weights_and_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DFlashTrtError, match="no model weights"):
        HFCheckpointReader(tmp_path)
    with pytest.raises(DFlashTrtError, match="is not a directory"):
        HFCheckpointReader(tmp_path / "config.json")


def test_several_safetensors_without_index(tmp_path: Path) -> None:
    save_file({"a": torch.ones(1)}, tmp_path / "part-1.safetensors")
    save_file({"b": torch.ones(1)}, tmp_path / "part-2.safetensors")
    with pytest.raises(DFlashTrtError, match="2 safetensors files but no model.safetensors.index.json"):
        HFCheckpointReader(tmp_path)


def _sharded(model_dir: Path, shards: dict[str, dict[str, torch.Tensor]], weight_map: dict[str, str]) -> Path:
    model_dir.mkdir(exist_ok=True)
    for file_name, tensors in shards.items():
        save_file(tensors, model_dir / file_name)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return model_dir


def test_index_referencing_a_missing_shard(tmp_path: Path) -> None:
    model_dir = _sharded(
        tmp_path / "m", {"s1.safetensors": {"a": torch.ones(1)}}, {"a": "s1.safetensors", "b": "s2.safetensors"}
    )
    with pytest.raises(DFlashTrtError, match="references shard 's2.safetensors', which does not exist"):
        HFCheckpointReader(model_dir)


def test_index_pointing_at_the_wrong_shard(tmp_path: Path) -> None:
    shards = {"s1.safetensors": {"a": torch.ones(1)}, "s2.safetensors": {"b": torch.ones(1)}}
    model_dir = _sharded(tmp_path / "m", shards, {"a": "s2.safetensors", "b": "s2.safetensors"})
    with pytest.raises(DFlashTrtError, match="places tensor 'a' in 's2.safetensors', which does not hold it"):
        HFCheckpointReader(model_dir)


def test_duplicate_tensor_across_shards(tmp_path: Path) -> None:
    shards = {"s1.safetensors": {"a": torch.ones(1)}, "s2.safetensors": {"a": torch.zeros(1), "b": torch.ones(1)}}
    model_dir = _sharded(tmp_path / "m", shards, {"a": "s1.safetensors", "b": "s2.safetensors"})
    with pytest.raises(DFlashTrtError, match="'a' is stored twice, in 's1.safetensors' and in 's2.safetensors'"):
        HFCheckpointReader(model_dir)


def test_shard_tensor_missing_from_index(tmp_path: Path) -> None:
    shards = {"s1.safetensors": {"a": torch.ones(1), "hidden": torch.ones(1)}}
    model_dir = _sharded(tmp_path / "m", shards, {"a": "s1.safetensors"})
    with pytest.raises(DFlashTrtError, match="holds tensor 'hidden', which model.safetensors.index.json does not"):
        HFCheckpointReader(model_dir)


@pytest.mark.parametrize(
    "shard_name", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/s1.safetensors", "..", "", "a\\b"]
)
def test_index_cannot_reach_outside_the_directory(tmp_path: Path, shard_name: str) -> None:
    save_file({"a": torch.ones(1)}, tmp_path / "outside.safetensors")
    (tmp_path / "m" / "sub").mkdir(parents=True)
    save_file({"a": torch.ones(1)}, tmp_path / "m" / "sub" / "s1.safetensors")
    model_dir = _sharded(tmp_path / "m", {}, {"a": shard_name})
    with pytest.raises(DFlashTrtError, match="not a file name in that directory"):
        HFCheckpointReader(model_dir)


@pytest.mark.parametrize(
    ("index_text", "message"),
    [
        ("{", "not a readable JSON file"),
        ("[]", "no weight_map"),
        ('{"weight_map": {}}', "no weight_map"),
        ('{"weight_map": ["a"]}', "no weight_map"),
        ('{"weight_map": {"a": 3}}', "not a file name"),
        ("[" * 100_000, "not a readable JSON file"),
    ],
)
def test_malformed_index(tmp_path: Path, index_text: str, message: str) -> None:
    save_file({"a": torch.ones(1)}, tmp_path / "s1.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(index_text)
    with pytest.raises(DFlashTrtError, match=message):
        HFCheckpointReader(tmp_path)


def test_corrupt_shard_is_named(tmp_path: Path) -> None:
    model_dir = _sharded(
        tmp_path / "m",
        {"s1.safetensors": {"a": torch.ones(4)}, "s2.safetensors": {"b": torch.ones(4)}},
        {"a": "s1.safetensors", "b": "s2.safetensors"},
    )
    shard = model_dir / "s2.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(DFlashTrtError, match="s2.safetensors is truncated or corrupt"):
        HFCheckpointReader(model_dir)


def test_single_file_and_index_together_are_ambiguous(tmp_path: Path) -> None:
    model_dir = _sharded(tmp_path / "m", {"s1.safetensors": {"a": torch.ones(1)}}, {"a": "s1.safetensors"})
    save_file({"a": torch.zeros(1)}, model_dir / "model.safetensors")
    with pytest.raises(DFlashTrtError, match="both model.safetensors and model.safetensors.index.json"):
        HFCheckpointReader(model_dir)


def test_fifo_in_place_of_a_weight_file_does_not_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    _refused(fifo, "not a regular file")


def test_oversized_index_is_refused_unread(tmp_path: Path) -> None:
    save_file({"a": torch.ones(1)}, tmp_path / "s1.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(b"{")
    os.truncate(index, MAX_INDEX_BYTES + 1)
    with pytest.raises(DFlashTrtError, match="larger than 67108864 bytes"):
        HFCheckpointReader(tmp_path)


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs Linux /proc to count open files")
def test_refusals_and_closed_readers_leak_no_file_descriptors(tmp_path: Path) -> None:
    bad = write_raw(tmp_path / "bad.safetensors", {"w": entry("F32", [3], 0, 8)}, F32_PAIR)
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(2)}, good)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        for path in (bad, tmp_path, tmp_path / "missing"):
            with pytest.raises(DFlashTrtError):
                SafetensorsFile(path)
        with SafetensorsFile(good) as reader:
            reader.get("w")
    assert len(os.listdir("/proc/self/fd")) <= before
