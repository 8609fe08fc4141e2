"""SafetensorsFile / StreamingSafetensorsWriter round trips, checked against the `safetensors` package."""

from __future__ import annotations

import errno
import gc
import json
import math
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from _hostile_files import entry, tensor_bytes, write_raw
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_trt.checkpoint import safetensors_io
from dflash_trt.checkpoint.safetensors_io import (
    SafetensorsFile,
    StreamingSafetensorsWriter,
    tensor_has_nonfinite,
)
from dflash_trt.errors import DFlashTrtError


def _sample_tensors() -> dict[str, torch.Tensor]:
    """One tensor per dtype both libraries support, odd sizes so a plain concatenation is misaligned."""
    gen = torch.Generator().manual_seed(0)
    floats = torch.randn(3, 5, generator=gen) * 10
    return {
        "model.embed.weight": floats,
        "bytes.u8": torch.randint(0, 256, (7,), dtype=torch.uint8, generator=gen),
        "half.f16": floats[:, :3].to(torch.float16),
        "brain.bf16": floats.reshape(-1)[:5].to(torch.bfloat16),
        "scalar.f64": torch.tensor(2.5, dtype=torch.float64),
        "ints.i64": torch.tensor([-(2**40), 3, 2**62], dtype=torch.int64),
        "ints.i32": torch.tensor([[1, -2], [3, -4]], dtype=torch.int32),
        "ints.i16": torch.tensor([-300], dtype=torch.int16),
        "ints.i8": torch.tensor([-1, 2, -3], dtype=torch.int8),
        "mask.bool": torch.tensor([True, False, True]),
        "fp8.e4m3": (floats[0] / 4).to(torch.float8_e4m3fn),
        "fp8.e5m2": (floats[1] / 4).to(torch.float8_e5m2),
        "empty.f32": torch.zeros(0, 4),
        "u16": torch.tensor([65535, 1], dtype=torch.uint16),
        "u32": torch.tensor([2**32 - 1], dtype=torch.uint32),
        "u64": torch.tensor([2**63 + 5], dtype=torch.uint64),
        "c64": torch.tensor([1 + 2j, -3.5j], dtype=torch.complex64),
    }


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert tuple(actual.shape) == tuple(expected.shape)
    assert tensor_bytes(actual) == tensor_bytes(expected)


def _entries(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()}


def test_reader_matches_safetensors_written_file(tmp_path: Path) -> None:
    tensors = _sample_tensors()
    path = tmp_path / "in.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "note": "ünïcode"})
    oracle = load_file(path)
    with SafetensorsFile(path) as reader:
        assert sorted(reader.names()) == sorted(oracle)
        assert reader.metadata == {"format": "pt", "note": "ünïcode"}
        for name, expected in oracle.items():
            assert reader.dtype(name) == expected.dtype
            assert reader.shape(name) == tuple(expected.shape)
            assert reader.nbytes(name) == expected.numel() * expected.element_size()
            _assert_same(reader.get(name), expected)
            _assert_same(reader.get(name, copy=True), expected)
        assert reader.nbytes_total() == path.stat().st_size - 8 - struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_writer_output_loads_with_safetensors(tmp_path: Path) -> None:
    tensors = _sample_tensors()
    path = tmp_path / "out.safetensors"
    with StreamingSafetensorsWriter(path, _entries(tensors), metadata={"format": "pt"}) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    loaded = load_file(path)
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        _assert_same(loaded[name], tensor)
    with safe_open(path, framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        _assert_same(handle.get_tensor("brain.bf16"), tensors["brain.bf16"])
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert (8 + header_len) % 8 == 0
    with SafetensorsFile(path) as reader:
        assert reader.names() == list(tensors), "data must be laid out in entry order"
        for name, tensor in tensors.items():
            _assert_same(reader.get(name), tensor)


def test_writer_digest_is_the_files(tmp_path: Path) -> None:
    """Hashed while written (full blocks on the writer's thread, the last on the caller's): the digest is blake3's of
    the finished file, the bytes are safetensors'."""
    from blake3 import blake3

    gen = torch.Generator().manual_seed(1)
    tensors = {
        "small": torch.randn(3, 5, generator=gen),
        "large": torch.randn(1000, 1031, generator=gen).to(torch.bfloat16),  # ~2 MB: full blocks on the thread
        "odd": torch.randint(0, 256, ((1 << 20) + 3,), dtype=torch.uint8, generator=gen),
    }
    path = tmp_path / "hashed.safetensors"
    writer = StreamingSafetensorsWriter(path, _entries(tensors), fsync=False, digest=True)
    with writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
        with pytest.raises(DFlashTrtError, match="no digest"):
            writer.hexdigest()
    assert writer.hexdigest() == blake3(path.read_bytes()).hexdigest()
    loaded = load_file(path)
    for name, tensor in tensors.items():
        _assert_same(loaded[name], tensor)


def _direct_io_here(directory: Path) -> bool:
    """Whether the file system of `directory` takes direct I/O (tmpfs before Linux 6.6 does not, for one)."""
    import fcntl

    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / "probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


class _RecordedWrites:
    """Stands in for `os.pwrite`: records each write's size, offset and whether it went with direct I/O."""

    def __init__(self) -> None:
        self.real_pwrite, self.writes = os.pwrite, []

    def __call__(self, fd: int, data, offset: int) -> int:
        import fcntl

        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))
        self.writes.append((memoryview(data).nbytes, offset, direct))
        return self.real_pwrite(fd, data, offset)


BLOCK = safetensors_io.WRITE_BLOCK_BYTES


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("sizes", [[1, 4095, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7], [BLOCK + 5] * 4])
def test_writer_keeps_order_and_digest(tmp_path: Path, monkeypatch, sizes: list[int], direct: bool) -> None:
    """Pieces of any size are gathered into blocks, each hashed in order and written (several at once) on the writer's
    threads while the next fills: in either order of sizes the file holds the pieces in order, the digest is
    blake3's of it, and every write is a whole block at its offset but the last (with `direct` where the file system
    allows it, the last through the page cache)."""
    from blake3 import blake3

    pieces = [random.Random(index).randbytes(size) for index, size in enumerate(sizes)]
    path = tmp_path / "blocks.safetensors"
    for order in (pieces, pieces[::-1]):
        path.unlink(missing_ok=True)
        recorded = _RecordedWrites()
        monkeypatch.setattr(os, "pwrite", recorded)
        with StreamingSafetensorsWriter(path, {"a": ("U8", (sum(sizes),))}, digest=True, direct=direct) as writer:
            writer.start("a")
            for index, piece in enumerate(order):
                writer.append(memoryview(piece) if index % 2 else piece)
            writer.finish()
        monkeypatch.undo()
        data = path.read_bytes()
        assert data.endswith(b"".join(order)) and writer.hexdigest() == blake3(data).hexdigest()
        whole, writes = len(data) // BLOCK, sorted(recorded.writes, key=lambda write: write[1])
        assert [(size, offset) for size, offset, _ in writes] == [
            *((BLOCK, i * BLOCK) for i in range(whole)),
            (len(data) % BLOCK, whole * BLOCK),
        ]
        expected = direct and _direct_io_here(tmp_path)
        assert [went for _, _, went in writes] == [expected] * whole + [False]


def test_writer_falls_back_to_the_page_cache_where_direct_io_is_refused(tmp_path: Path, monkeypatch) -> None:
    """A disk that refuses a direct write (EINVAL: other alignment) gets the same bytes through the page cache."""
    if not _direct_io_here(tmp_path):
        pytest.skip("this file system takes no direct I/O")
    real_pwrite, refused = os.pwrite, []

    def refusing(fd: int, data, offset: int) -> int:
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing)
    data = random.Random(0).randbytes(3 * BLOCK + 11)
    path = tmp_path / "fallback.safetensors"
    with StreamingSafetensorsWriter(path, {"a": ("U8", (len(data),))}, direct=True) as writer:
        writer.start("a")
        writer.append(data)
        writer.finish()
    assert refused == [0] and path.read_bytes().endswith(data)


def test_writer_on_a_file_system_without_direct_io_goes_through_the_page_cache(tmp_path: Path, monkeypatch) -> None:
    """Where turning direct I/O on is refused (tmpfs before Linux 6.6, some network file systems), every block is
    written through the page cache, with the same bytes."""
    import fcntl

    real_fcntl = fcntl.fcntl

    def refusing(fd: int, command: int, arg: int = 0) -> int:
        if command == fcntl.F_SETFL and arg & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_fcntl(fd, command, arg)

    monkeypatch.setattr(fcntl, "fcntl", refusing)
    recorded = _RecordedWrites()
    monkeypatch.setattr(os, "pwrite", recorded)
    data = random.Random(1).randbytes(2 * BLOCK + 5)
    path = tmp_path / "cached.safetensors"
    with StreamingSafetensorsWriter(path, {"a": ("U8", (len(data),))}, direct=True) as writer:
        writer.start("a")
        writer.append(data)
        writer.finish()
    assert path.read_bytes().endswith(data) and len(recorded.writes) == 3
    assert not any(went for _, _, went in recorded.writes)


def test_writer_failing_on_its_thread_is_one_error_and_removes_the_file(tmp_path: Path, monkeypatch) -> None:
    """A write failing on the writer's thread (a full disk) surfaces at the next block as this file's error."""

    def full(fd: int, data, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    path = tmp_path / "full.safetensors"
    blocks = 2 * (safetensors_io.WRITES_IN_FLIGHT + 1)  # more than the writer holds in flight
    writer = StreamingSafetensorsWriter(path, {"a": ("U8", (blocks * BLOCK,))}, direct=True)
    writer.start("a")
    with pytest.raises(DFlashTrtError, match="cannot write .*No space left on device"):
        for _ in range(blocks):
            writer.append(bytes(BLOCK))
    assert not path.exists()


def test_writer_accepts_non_contiguous_tensor(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    transposed = base.t()
    column = base[:, 1]
    path = tmp_path / "nc.safetensors"
    with StreamingSafetensorsWriter(path, _entries({"t": transposed, "c": column})) as writer:
        writer.write("t", transposed)
        writer.write("c", column)
    loaded = load_file(path)
    assert torch.equal(loaded["t"], transposed)
    assert torch.equal(loaded["c"], column)


def test_writer_without_metadata_has_no_metadata(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    with StreamingSafetensorsWriter(path, {"x": (torch.float32, (2,))}) as writer:
        writer.write("x", torch.tensor([1.0, 2.0]))
    with safe_open(path, framework="pt") as handle:
        assert handle.metadata() is None
        assert torch.equal(handle.get_tensor("x"), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize(
    ("name", "tensor", "message"),
    [
        ("b", torch.zeros(2), "expected tensor 'a' next"),
        ("a", torch.zeros(2, dtype=torch.float64), "declared F32"),
        ("a", torch.zeros(3), "declared F32 (2,)"),
    ],
)
def test_writer_rejects_wrong_tensor(tmp_path: Path, name: str, tensor: torch.Tensor, message: str) -> None:
    path = tmp_path / "w.safetensors"
    writer = StreamingSafetensorsWriter(path, {"a": (torch.float32, (2,)), "b": (torch.float32, (2,))})
    with pytest.raises(DFlashTrtError, match=message.replace("(", r"\(").replace(")", r"\)")):
        writer.write(name, tensor)
    writer.abort()
    assert not path.exists()


def test_writer_close_before_all_tensors_raises_and_deletes(tmp_path: Path) -> None:
    path = tmp_path / "partial.safetensors"
    writer = StreamingSafetensorsWriter(path, {"a": (torch.float32, (2,)), "b": (torch.int8, (1,))})
    writer.write("a", torch.ones(2))
    with pytest.raises(DFlashTrtError, match="'b' is missing"):
        writer.close()
    assert not path.exists()


def test_writer_rejects_extra_write(tmp_path: Path) -> None:
    path = tmp_path / "extra.safetensors"
    with StreamingSafetensorsWriter(path, {"a": (torch.float32, (1,))}) as writer:
        writer.write("a", torch.ones(1))
        with pytest.raises(DFlashTrtError, match="written twice"):
            writer.write("a", torch.ones(1))
    assert torch.equal(load_file(path)["a"], torch.ones(1))


def test_writer_deletes_file_when_with_block_fails(tmp_path: Path) -> None:
    path = tmp_path / "failed.safetensors"
    with pytest.raises(RuntimeError, match="boom"):
        with StreamingSafetensorsWriter(path, {"a": (torch.float32, (1,))}):
            raise RuntimeError("boom")
    assert not path.exists()


def test_writer_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "exists.safetensors"
    path.write_bytes(b"precious")
    with pytest.raises(DFlashTrtError, match="refusing to overwrite"):
        StreamingSafetensorsWriter(path, {"a": (torch.float32, (1,))})
    assert path.read_bytes() == b"precious"


@pytest.mark.parametrize(
    ("entries", "metadata", "message"),
    [
        ({"__metadata__": (torch.float32, (1,))}, None, "cannot be a tensor name"),
        ({"a": (torch.complex128, (1,))}, None, "safetensors cannot store"),
        ({"a": (torch.float32, (-1,))}, None, "invalid shape"),
        ({"a": (torch.float32, (1,))}, {"k": 1}, "map strings to strings"),
    ],
)
def test_writer_rejects_bad_declarations(tmp_path: Path, entries: dict, metadata: dict, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    with pytest.raises(DFlashTrtError, match=message):
        StreamingSafetensorsWriter(path, entries, metadata)
    assert not path.exists()


_FILL_THE_DISK = """
import resource, signal, sys
import torch
from dflash_trt.checkpoint.safetensors_io import StreamingSafetensorsWriter
from dflash_trt.errors import DFlashTrtError

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a full file then fails the write() instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
path = sys.argv[1]
try:
    with StreamingSafetensorsWriter(path, {"a": (torch.float32, (1024,)), "b": (torch.float32, (1 << 20,))}) as w:
        w.write("a", torch.ones(1024))
        w.write("b", torch.ones(1 << 20))
except DFlashTrtError as exc:
    print(exc)
    sys.exit(3)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs POSIX file-size limits")
def test_write_failure_is_a_clear_error_and_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "full.safetensors"
    repo_root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", _FILL_THE_DISK, str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(repo_root)},
        timeout=120,
    )
    assert result.returncode == 3, result.stderr
    assert result.stdout.startswith(f"cannot write {path}: File too large"), result.stdout
    assert not path.exists()


def test_get_is_a_view_of_a_private_map_that_never_touches_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cow.safetensors"
    save_file({"w": torch.arange(6, dtype=torch.float32)}, path)
    before = path.read_bytes()
    with SafetensorsFile(path) as reader:
        first, second = reader.get("w"), reader.get("w")
        copied = reader.get("w", copy=True)
        first += 100
        # Every get maps its tensor privately: writes to one view reach neither the file nor another view.
        assert torch.equal(first, torch.arange(6, dtype=torch.float32) + 100)
        assert torch.equal(second, torch.arange(6, dtype=torch.float32))
        assert torch.equal(copied, torch.arange(6, dtype=torch.float32))
    assert path.read_bytes() == before


def test_tensors_outlive_close_and_get_after_close_fails(tmp_path: Path) -> None:
    path = tmp_path / "close.safetensors"
    save_file({"w": torch.arange(4, dtype=torch.int32)}, path)
    reader = SafetensorsFile(path)
    view = reader.get("w")
    reader.close()
    with pytest.raises(DFlashTrtError, match="closed"):
        reader.get("w")
    del reader
    gc.collect()
    assert torch.equal(view, torch.arange(4, dtype=torch.int32))


def test_unknown_name_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "one.safetensors"
    save_file({"w": torch.zeros(1)}, path)
    with SafetensorsFile(path) as reader, pytest.raises(DFlashTrtError, match="no tensor named 'v'"):
        reader.get("v")


def _resident_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("VmRSS not found")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc to read resident memory")
def test_get_does_not_make_the_file_resident(tmp_path: Path) -> None:
    size = 256 * 1024 * 1024
    path = write_raw(tmp_path / "big.safetensors", {"big": entry("U8", [size], 0, size)})
    with open(path, "r+b") as handle:  # sparse: the data costs no disk and no page cache until read
        handle.truncate(path.stat().st_size + size)
    with SafetensorsFile(path) as reader:
        before = _resident_kib()
        big = reader.get("big")
        assert int(big[size // 2]) == 0
        grown_mib = (_resident_kib() - before) / 1024
    assert grown_mib < 32, f"reading one byte of a 256 MiB tensor made {grown_mib:.0f} MiB resident"


def _sparse_file_with(tmp_path: Path, tensors: dict[str, torch.Tensor], big_bytes: int) -> Path:
    """`tensors` followed by a U8 tensor "big" of `big_bytes` zero bytes that occupy no disk."""
    header, data, offset = {}, b"", 0
    for name, tensor in tensors.items():
        payload = tensor_bytes(tensor)
        dtype = {torch.uint8: "U8", torch.float32: "F32", torch.bfloat16: "BF16"}[tensor.dtype]
        header[name] = entry(dtype, list(tensor.shape), offset, offset + len(payload))
        data, offset = data + payload, offset + len(payload)
    header["big"] = entry("U8", [big_bytes], offset, offset + big_bytes)
    path = write_raw(tmp_path / "sparse.safetensors", header, data)
    try:
        os.truncate(path, path.stat().st_size + big_bytes)
    except OSError as exc:
        pytest.skip(f"this filesystem cannot hold a sparse file of {big_bytes} bytes ({exc.strerror})")
    return path


_ODD_LAYOUT = {
    "head": torch.arange(4, dtype=torch.uint8),
    "mid": torch.linspace(-1, 1, 1000),
    "odd": torch.tensor([7], dtype=torch.uint8),
    "tail": torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16),
}


def test_file_larger_than_memory_opens_and_reads(tmp_path: Path) -> None:
    path = _sparse_file_with(tmp_path, _ODD_LAYOUT, 1 << 40)
    with SafetensorsFile(path) as reader:
        for name, expected in _ODD_LAYOUT.items():
            _assert_same(reader.get(name), expected)
        big = reader.get("big")
        assert big.numel() == 1 << 40
        assert int(big[-1]) == 0


_MAP_UNDER_ADDRESS_LIMIT = """
import json, resource, sys
import torch
from dflash_trt.checkpoint.safetensors_io import SafetensorsFile
from dflash_trt.errors import DFlashTrtError

vm_kib = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:"))
limit = vm_kib * 1024 + (512 << 20)  # the 2 GiB file can no longer be mapped whole
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
reader = SafetensorsFile(sys.argv[1])
result = {name: reader.get(name).float().tolist() for name in ("head", "mid", "odd", "tail")}
try:
    reader.get("big")
except DFlashTrtError as exc:
    result["big_error"] = str(exc)
reader.close()
print(json.dumps(result))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc and address-space limits")
def test_tensors_are_mapped_one_by_one_when_the_whole_file_cannot_be(tmp_path: Path) -> None:
    path = _sparse_file_with(tmp_path, _ODD_LAYOUT, 2 << 30)
    repo_root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", _MAP_UNDER_ADDRESS_LIMIT, str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(repo_root)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout)
    for name, expected in _ODD_LAYOUT.items():
        assert loaded[name] == expected.float().tolist(), name
    assert loaded["big_error"].startswith("cannot map tensor 'big' (2147483648 bytes)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e5m2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_detected_in_any_chunk(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, bad: float) -> None:
    monkeypatch.setattr(safetensors_io, "_NONFINITE_CHUNK", 7)
    values = torch.linspace(-3, 3, 50)
    assert not tensor_has_nonfinite(values.to(dtype).reshape(5, 10))
    for position in (0, 23, 49):
        poisoned = values.clone()
        poisoned[position] = bad
        assert tensor_has_nonfinite(poisoned.to(dtype).reshape(5, 10)), position


def test_nonfinite_e4m3_nan_and_integers() -> None:
    e4m3 = torch.tensor([1.0, 448.0, -448.0]).to(torch.float8_e4m3fn)
    assert not tensor_has_nonfinite(e4m3)
    assert tensor_has_nonfinite(torch.tensor([0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn))
    assert not tensor_has_nonfinite(torch.tensor([2**31 - 1, -(2**31)], dtype=torch.int32))
    assert not tensor_has_nonfinite(torch.tensor([True, False]))
    assert tensor_has_nonfinite(torch.tensor([complex(float("nan"), 0.0)], dtype=torch.complex64))


def test_nonfinite_found_in_tensor_read_from_file(tmp_path: Path) -> None:
    path = tmp_path / "nan.safetensors"
    weights = torch.ones(4, 4, dtype=torch.bfloat16)
    weights[3, 2] = float("nan")
    save_file({"ok": torch.ones(3, dtype=torch.bfloat16), "bad": weights}, path)
    with SafetensorsFile(path) as reader:
        assert not tensor_has_nonfinite(reader.get("ok"))
        assert tensor_has_nonfinite(reader.get("bad"))


# NaN/Inf encodings of the 8-bit float formats, from their definitions (OCP FP8, fnuz, E8M0).
_NONFINITE_BYTES = {
    torch.float8_e4m3fn: {0x7F, 0xFF},
    torch.float8_e5m2: {0x7C, 0x7D, 0x7E, 0x7F, 0xFC, 0xFD, 0xFE, 0xFF},
    torch.float8_e4m3fnuz: {0x80},
    torch.float8_e5m2fnuz: {0x80},
    torch.float8_e8m0fnu: {0xFF},
}


@pytest.mark.parametrize("dtype", list(_NONFINITE_BYTES))
def test_nonfinite_every_8bit_encoding(dtype: torch.dtype) -> None:
    for byte in range(256):
        encoded = torch.tensor([0, byte, 0], dtype=torch.uint8).view(dtype)
        assert tensor_has_nonfinite(encoded) == (byte in _NONFINITE_BYTES[dtype]), hex(byte)


@pytest.mark.parametrize(("dtype", "large"), [(torch.float16, 60000.0), (torch.bfloat16, 3e38), (torch.float32, 3e38)])
def test_nonfinite_not_fooled_by_an_overflowing_sum(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, large: float
) -> None:
    monkeypatch.setattr(safetensors_io, "_NONFINITE_CHUNK", 64)
    values = torch.full((1000,), large, dtype=dtype)
    assert not torch.isfinite(values.sum()), "the fixture must overflow a plain sum"
    assert not tensor_has_nonfinite(values)
    values[-1] = float("nan")
    assert tensor_has_nonfinite(values)
    assert tensor_has_nonfinite(values.reshape(10, 100).t()), "non-contiguous views are checked too"


_ROUND_TRIP_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.bool, torch.uint8]


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(_ROUND_TRIP_DTYPES), st.lists(st.integers(0, 5), max_size=3)),
        min_size=1,
        max_size=6,
    ),
    st.randoms(use_true_random=False),
)
def test_any_layout_round_trips_through_writer_reader_and_safetensors(
    specs: list[tuple[torch.dtype, list[int]]], rng: random.Random
) -> None:
    """Any dtypes, shapes (0-dim and empty included) and order: all three views of the file agree."""
    tensors = {}
    for index, (dtype, shape) in enumerate(specs):
        raw = torch.tensor([rng.randrange(256) for _ in range(math.prod(shape) * dtype.itemsize)], dtype=torch.uint8)
        tensors[f"t{index}.weight"] = raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rt.safetensors"
        with StreamingSafetensorsWriter(path, _entries(tensors)) as writer:
            for name, tensor in tensors.items():
                writer.write(name, tensor)
        oracle = load_file(path)
        with SafetensorsFile(path) as reader:
            assert reader.names() == list(tensors)
            for name, tensor in tensors.items():
                _assert_same(oracle[name], tensor)
                _assert_same(reader.get(name), tensor)


def test_writer_fsync_failure_is_one_error_and_removes_the_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "w.safetensors"
    writer = StreamingSafetensorsWriter(path, {"a": ("U8", (4,))})
    writer.start("a")
    writer.append(b"abcd")
    writer.finish()

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(DFlashTrtError, match="cannot write .*Input/output error"):
        writer.close()
    assert not path.exists()
