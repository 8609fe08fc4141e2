"""Hostile inputs end to end: `dflash-trt convert` on damaged copies of real fixture checkpoints.

Every case must end with exit code 2, exactly one line on stderr, no traceback and nothing written: no output
directory, no staging directory, nothing wherever a hostile name points. A fuzzer corrupts header bytes of the real
files and requires either a clean refusal or a conversion that `verify` accepts — never any other exception.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import pickle
import re
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from _hostile_files import raw_safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_trt.cli import main
from dflash_trt.conversion.verify import verify_checkpoint

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _read(path: Path) -> tuple[dict, bytes]:
    """(header dict, data section) of a safetensors file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _write(path: Path, header: dict, data: bytes) -> None:
    path.write_bytes(raw_safetensors(header, data))


def _by_offset(header: dict) -> list[str]:
    return sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])


def _poke_float(path: Path, name: str, index: int, value: float) -> None:
    """Overwrite element `index` of float32 tensor `name` in place."""
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    assert header[name]["dtype"] == "F32"
    at = 8 + length + header[name]["data_offsets"][0] + 4 * index
    raw[at : at + 4] = struct.pack("<f", value)
    path.write_bytes(bytes(raw))


# Each edit damages (target_dir, draft_dir) copies in place; the expected message is a regex on stderr.


def _truncate_data(t: Path, d: Path) -> None:
    raw = (t / WEIGHTS).read_bytes()
    (t / WEIGHTS).write_bytes(raw[:-100])


def _truncate_header(t: Path, d: Path) -> None:
    raw = (d / WEIGHTS).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    (d / WEIGHTS).write_bytes(raw[: 8 + length // 2])


def _header_length(value: int) -> Callable[[Path, Path], None]:
    def edit(t: Path, d: Path) -> None:
        raw = (t / WEIGHTS).read_bytes()
        (t / WEIGHTS).write_bytes(struct.pack("<Q", value) + raw[8:])

    return edit


def _overlap(t: Path, d: Path) -> None:
    header, data = _read(d / WEIGHTS)
    header["layers.1.post_attention_layernorm.weight"]["data_offsets"] = list(
        header["layers.0.input_layernorm.weight"]["data_offsets"]
    )
    _write(d / WEIGHTS, header, data)


def _out_of_range(t: Path, d: Path) -> None:
    header, data = _read(t / WEIGHTS)
    last = _by_offset(header)[-1]
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + 2**40, end + 2**40]
    _write(t / WEIGHTS, header, data)


def _retype(name: str, dtype: str) -> Callable[[Path, Path], None]:
    def edit(t: Path, d: Path) -> None:
        header, data = _read(t / WEIGHTS)
        header[name]["dtype"] = dtype
        _write(t / WEIGHTS, header, data)

    return edit


def _reshape(t: Path, d: Path) -> None:
    header, data = _read(t / WEIGHTS)
    header["model.layers.3.mlp.up_proj.weight"]["shape"] = [64, 96]  # config: intermediate 96 x hidden 64
    _write(t / WEIGHTS, header, data)


def _poke(which: str, name: str, index: int, value: float) -> Callable[[Path, Path], None]:
    def edit(t: Path, d: Path) -> None:
        _poke_float((t if which == "target" else d) / WEIGHTS, name, index, value)

    return edit


def _shard(t: Path, duplicate: str | None = None, shard_name_of: Callable[[str], str] | None = None) -> None:
    """Split the target's weights into two shard files plus an index, optionally storing one tensor twice."""
    header, data = _read(t / WEIGHTS)
    names = _by_offset(header)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    if duplicate is not None:
        halves["model-00001-of-00002.safetensors"].append(duplicate)
        halves["model-00002-of-00002.safetensors"].append(duplicate)
    weight_map = {}
    for file_name, members in halves.items():
        sub_header, chunks, offset = {}, [], 0
        for name in dict.fromkeys(members):
            begin, end = header[name]["data_offsets"]
            sub_header[name] = {**header[name], "data_offsets": [offset, offset + end - begin]}
            chunks.append(data[begin:end])
            offset += end - begin
            weight_map[name] = shard_name_of(file_name) if shard_name_of else file_name
        _write(t / file_name, sub_header, b"".join(chunks))
    (t / WEIGHTS).unlink()
    (t / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _duplicate_across_shards(t: Path, d: Path) -> None:
    _shard(t, duplicate="model.norm.weight")


def _shard_outside_the_directory(t: Path, d: Path) -> None:
    _shard(t, shard_name_of=lambda file_name: f"../{file_name}")


def _extra_tensor(name: str) -> Callable[[Path, Path], None]:
    def edit(t: Path, d: Path) -> None:
        header, data = _read(d / WEIGHTS)
        header[name] = {"dtype": "F32", "shape": [2], "data_offsets": [len(data), len(data) + 8]}
        _write(d / WEIGHTS, header, data + struct.pack("<2f", 1.0, 2.0))

    return edit


class _Tripwire:
    """Unpickling this creates a marker file: proof that a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _pickle_only(t: Path, d: Path) -> None:
    (d / WEIGHTS).unlink()
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(_Tripwire(d.parent / "unpickled")))


CASES = {
    "truncated data": (_truncate_data, [], r"model\.safetensors is truncated or corrupt"),
    "truncated header": (_truncate_header, [], r"truncated or corrupt: its header claims"),
    "header length beyond the file": (_header_length(10**6), [], r"truncated or corrupt: its header claims"),
    "absurd header length": (_header_length(2**63 + 5), [], r"header, above the 104857600-byte limit"),
    "overlapping offsets": (_overlap, [], r"overlaps the tensor stored before it"),
    "out-of-range offsets": (_out_of_range, [], r"model\.safetensors: 1099511627776 unreferenced bytes precede"),
    "integer dtype": (
        _retype("model.layers.0.mlp.down_proj.weight", "I32"),
        [],
        r"target tensor 'model\.layers\.0\.mlp\.down_proj\.weight' has dtype I32 \(int32\)",
    ),
    "dtype with another size": (
        _retype("model.norm.weight", "F16"),
        [],
        r"'model\.norm\.weight' \(F16 \[64\]\) needs 128 bytes but its data_offsets span 256",
    ),
    "shape against config": (
        _reshape,
        [],
        r"target tensor 'model\.layers\.3\.mlp\.up_proj\.weight' has shape \(64, 96\), "
        r"expected \(96, 64\)",
    ),
    "NaN in a target weight": (
        _poke("target", "model.layers.1.self_attn.k_proj.weight", 77, math.nan),
        [],
        r"target tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' contains NaN or Inf",
    ),
    "Inf in a drafter weight": (
        _poke("draft", "layers.1.mlp.down_proj.weight", 5, math.inf),
        ["--tp_size", "2"],
        r"drafter tensor 'layers\.1\.mlp\.down_proj\.weight' contains NaN or Inf",
    ),
    "-Inf in lm_head at tp 2": (
        _poke("target", "lm_head.weight", 96 * 64 - 1, -math.inf),
        ["--tp_size", "2"],
        r"target tensor 'lm_head\.weight' contains NaN or Inf",
    ),
    "duplicate across shards": (_duplicate_across_shards, [], r"tensor 'model\.norm\.weight' is stored twice"),
    "shard outside the directory": (_shard_outside_the_directory, [], r"which is not a file name in that directory"),
    "tensor name escaping upward": (_extra_tensor("../x"), [], r"drafter checkpoint has unexpected tensor '\.\./x'"),
    "tensor name with an absolute path": (_extra_tensor("/tmp/x/../../etc/x"), [], r"unexpected tensor '/tmp/x/"),
    "tensor name with a newline": (
        _extra_tensor("../y\nTraceback (most recent call last):"),
        [],
        r"unexpected tensor '\.\./y\\nTraceback",
    ),
    "pickle-only weights": (_pickle_only, [], r"only pickle weights \(pytorch_model\.bin\).*never loaded"),
}


def _copy_pair(pair: tuple[Path, Path], root: Path) -> tuple[Path, Path]:
    target_dir, draft_dir = pair
    return shutil.copytree(target_dir, root / "target"), shutil.copytree(draft_dir, root / "draft")


def _run_convert(target: Path, draft: Path, out: Path, extra: list[str]) -> tuple[int, str]:
    """Exit code and stderr of `dflash-trt convert`; any exception other than a refusal escapes and fails the test."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = main(
            ["convert", "--model_dir", str(target), "--dflash_model_dir", str(draft), "--output_dir", str(out), *extra]
        )
    return code, stderr.getvalue()


def _assert_refused_cleanly(code: int, err: str, out: Path) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.endswith("\n") and err.startswith("dflash-trt convert: error: "), err
    assert not any(line.startswith("Traceback") for line in err.splitlines()), err
    assert not out.exists()
    assert not out.parent.exists() or not any(out.parent.iterdir()), list(out.parent.iterdir())


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_input_is_refused_end_to_end(pair, tmp_path, case):
    edit, extra, message = CASES[case]
    target, draft = _copy_pair(pair, tmp_path / "in")
    edit(target, draft)
    out = tmp_path / "outroot" / "ckpt"
    code, err = _run_convert(target, draft, out, extra)
    _assert_refused_cleanly(code, err, out)
    assert re.search(message, err), err
    assert not (tmp_path / "in" / "unpickled").exists()
    assert not (tmp_path / "in" / "x").exists() and not (tmp_path / "x").exists()


def test_the_undamaged_copies_convert(pair, tmp_path):
    """The cases above fail because of their damage: the same copies, undamaged, convert and verify."""
    target, draft = _copy_pair(pair, tmp_path / "in")
    _shard(target)
    code, err = _run_convert(target, draft, tmp_path / "ckpt", ["--tp_size", "2"])
    assert code == 0, err
    assert verify_checkpoint(tmp_path / "ckpt", target, draft).ok


_FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(
    st.sampled_from(["target", "draft"]),
    st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_corrupted_header_bytes_are_refused_or_convert_correctly(pair, which, mutations):
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = _copy_pair(pair, Path(tmp))
        path = (target if which == "target" else draft) / WEIGHTS
        raw = bytearray(path.read_bytes())
        (length,) = struct.unpack("<Q", raw[:8])
        for where, value in mutations:
            raw[int(where * (8 + length))] = value
        path.write_bytes(bytes(raw))
        out = Path(tmp) / "outroot" / "ckpt"
        code, err = _run_convert(target, draft, out, [])
        if code == 0:
            assert verify_checkpoint(out, target, draft).ok
        else:
            _assert_refused_cleanly(code, err, out)
