"""Safetensors files read through a memory map and written one tensor at a time.

Checkpoints can be larger than host RAM and come from strangers, so the reader validates the whole header
before touching data (no allocation sized by an untrusted field, no offset outside the file) and the writer
puts the header first and then streams tensor bytes, holding at most one tensor in memory.
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import os
import platform
import stat
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from dflash_trt.checkpoint.atomic import start_writeback
from dflash_trt.checkpoint.integrity import BackgroundDigest
from dflash_trt.errors import DFlashTrtError

# Largest JSON header accepted: far above any real checkpoint's, far below a harmful allocation.
MAX_HEADER_BYTES = 100 * 1024 * 1024
METADATA_KEY = "__metadata__"
# Real tensors have at most a handful of dimensions and far fewer than 2**64 bytes; anything beyond is a
# corrupt or hostile header (whose shape's full product could take unbounded time to compute).
MAX_DIMS = 16
_NBYTES_CAP = 1 << 64
_HEADER_ALIGNMENT = 8
_TENSOR_KEYS = frozenset({"dtype", "shape", "data_offsets"})
# Not exported by Python before 3.13; the value is Linux's on x86-64 and aarch64.
_MAP_NORESERVE = getattr(
    mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64") else 0
)
# Written bytes handed to the disk in steps of this size while the file is still being written.
WRITEBACK_BYTES = 32 << 20
WRITEBACK_ALIGNMENT = 1 << 20  # a multiple of any page size
# Elements tested per step when a tensor's sum is not finite: bounds that test's temporary memory.
_NONFINITE_CHUNK = 1 << 22

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
    "C64": torch.complex64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True, slots=True)
class _TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the start of the data section
    end: int


def brief(value: object, limit: int = 80) -> str:
    """repr() of a value read from an untrusted file, cut short so an error stays one readable line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {brief(key)}")
        result[key] = value
    return result


def _parse_non_negative_int(text: str) -> int:
    """Every number in a safetensors header is a size or offset; "-0" is refused like any negative one."""
    if text.startswith("-"):
        raise ValueError(f"negative integer {text}")
    return int(text)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SafetensorsFile:
    """One safetensors file opened read-only; each tensor is a view of its own private memory map.

    The map is copy-on-write: returned tensors may be modified in memory but the file never changes, and
    only the pages a caller touches are read from disk. As with any memory map, the file must not be
    truncated while tensors from it are in use.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        if sys.byteorder != "little":
            raise DFlashTrtError("safetensors data is little-endian and this host is big-endian.")
        try:
            # O_NONBLOCK: opening a FIFO planted under a weight file's name must not hang.
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise DFlashTrtError(f"cannot read {self.path}: {exc.strerror or exc}.") from exc
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise DFlashTrtError(f"{self.path} is not a regular file.")
            with open(fd, "rb", closefd=False) as handle:
                self._tensors, self.metadata, self._data_start = _read_header(self.path, handle, status.st_size)
        except OSError as exc:
            os.close(fd)
            raise DFlashTrtError(f"cannot read {self.path}: {exc.strerror or exc}.") from exc
        except BaseException:
            os.close(fd)
            raise
        # Each tensor gets its own map, released with the last tensor viewing it: one whole-file map would keep
        # every page a conversion touched resident until the reader closes (RSS would grow to the file size).
        self._fd = fd

    def names(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def _info(self, name: str) -> _TensorInfo:
        info = self._tensors.get(name)
        if info is None:
            raise DFlashTrtError(f"{self.path} has no tensor named {brief(name)}.")
        return info

    def dtype(self, name: str) -> torch.dtype:
        return self._info(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def nbytes(self, name: str) -> int:
        info = self._info(name)
        return info.end - info.begin

    def nbytes_total(self) -> int:
        return sum(info.end - info.begin for info in self._tensors.values())

    def get(self, name: str, copy: bool = False) -> torch.Tensor:
        """The tensor `name`; a view of the file's map unless `copy` (or its bytes are misaligned)."""
        info = self._info(name)
        if self._fd is None:
            raise DFlashTrtError(f"{self.path} is closed.")
        numel = math.prod(info.shape)
        if numel == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        region, offset = self._region(name, self._data_start + info.begin, info.end - info.begin)
        if offset % info.dtype.itemsize == 0:
            tensor = torch.frombuffer(region, dtype=info.dtype, count=numel, offset=offset).view(info.shape)
            return tensor.clone() if copy else tensor
        raw = torch.frombuffer(region, dtype=torch.uint8, count=info.end - info.begin, offset=offset)
        return raw.clone().view(info.dtype).view(info.shape)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of `name` (dim 0), mapping only their bytes: streaming a huge tensor block by block
        keeps just one block's pages resident."""
        info = self._info(name)
        if self._fd is None:
            raise DFlashTrtError(f"{self.path} is closed.")
        if not info.shape or not 0 <= start <= stop <= info.shape[0]:
            raise DFlashTrtError(f"rows {start}:{stop} are outside tensor {brief(name)} of shape {info.shape}.")
        row_bytes = (info.end - info.begin) // info.shape[0] if info.shape[0] else 0
        shape = (stop - start, *info.shape[1:])
        if stop == start or row_bytes == 0:
            return torch.empty(shape, dtype=info.dtype)
        nbytes = (stop - start) * row_bytes
        region, offset = self._region(name, self._data_start + info.begin + start * row_bytes, nbytes)
        if offset % info.dtype.itemsize == 0:
            return torch.frombuffer(region, dtype=info.dtype, count=math.prod(shape), offset=offset).view(shape)
        raw = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
        return raw.clone().view(info.dtype).view(shape)

    def _region(self, name: str, start: int, nbytes: int) -> tuple[mmap.mmap, int]:
        """A map holding bytes [start, start + nbytes) of the file, and where they begin in it."""
        map_start = start - start % mmap.ALLOCATIONGRANULARITY
        if self._fd is None:
            raise DFlashTrtError(f"{self.path} is closed.")
        try:
            region = _map_copy_on_write(self._fd, start + nbytes - map_start, map_start)
        except OSError as exc:
            raise DFlashTrtError(
                f"cannot map tensor {brief(name)} ({nbytes} bytes) of {self.path}: {exc.strerror or exc}."
            ) from exc
        return region, start - map_start

    def close(self) -> None:
        """Close the file; tensors already returned stay valid.

        Maps are never closed explicitly: `torch.frombuffer` tensors reference their mmap object without
        holding a buffer export, so closing it would leave them pointing at unmapped memory. Each mapping is
        released when the last tensor viewing it is freed.
        """
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _map_copy_on_write(fd: int, length: int, offset: int) -> mmap.mmap:
    """A private, writable map of a read-only file: tensors can be modified in memory, never on disk.

    MAP_NORESERVE stops Linux from charging the whole mapping against RAM + swap up front, which would
    refuse to map a file larger than memory even though only touched pages are ever read.
    """
    return mmap.mmap(
        fd, length, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset
    )


def _read_header(path: Path, handle, file_size: int) -> tuple[dict[str, _TensorInfo], dict[str, str], int]:
    """Parse and validate the header; returns (tensors in data order, metadata, data section start)."""
    if file_size < 8:
        raise DFlashTrtError(f"{path} is not a safetensors file: it has {file_size} bytes, fewer than 8.")
    (header_len,) = struct.unpack("<Q", handle.read(8))
    if header_len > MAX_HEADER_BYTES:
        raise DFlashTrtError(f"{path} declares a {header_len}-byte header, above the {MAX_HEADER_BYTES}-byte limit.")
    if header_len > file_size - 8:
        raise DFlashTrtError(
            f"{path} is truncated or corrupt: its header claims {header_len} bytes but only {file_size - 8} follow."
        )
    raw = handle.read(header_len)
    if len(raw) != header_len:
        raise DFlashTrtError(f"{path} changed size while being read.")
    header = _parse_header_json(path, raw)
    data_size = file_size - 8 - header_len
    metadata = _parse_metadata(path, header.pop(METADATA_KEY, None))
    tensors = {name: _parse_entry(path, name, entry) for name, entry in header.items()}
    ordered = dict(sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)))
    position = 0
    for name, info in ordered.items():
        if info.begin < position:
            raise DFlashTrtError(f"{path}: tensor {brief(name)} overlaps the tensor stored before it.")
        if info.begin > position:
            raise DFlashTrtError(f"{path}: {info.begin - position} unreferenced bytes precede tensor {brief(name)}.")
        if info.end > data_size:
            raise DFlashTrtError(
                f"{path} is truncated or corrupt: tensor {brief(name)} ends at byte {info.end} of a "
                f"{data_size}-byte data section."
            )
        position = info.end
    if position != data_size:
        raise DFlashTrtError(f"{path}: the header describes {position} data bytes but the file holds {data_size}.")
    return ordered, metadata, 8 + header_len


def _parse_header_json(path: Path, raw: bytes) -> dict[str, object]:
    if not raw.startswith(b"{"):
        raise DFlashTrtError(f"{path} is not a safetensors file: its header is not a JSON object.")
    try:
        header = json.loads(
            raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys, parse_int=_parse_non_negative_int
        )
    except UnicodeDecodeError as exc:
        raise DFlashTrtError(f"{path} has a header that is not UTF-8 text: {exc.reason}.") from exc
    except RecursionError as exc:
        raise DFlashTrtError(f"{path} has a header nested too deeply to be a safetensors header.") from exc
    except ValueError as exc:
        raise DFlashTrtError(f"{path} has a header that is not valid JSON ({exc}).") from exc
    if not isinstance(header, dict):
        raise DFlashTrtError(f"{path} is not a safetensors file: its header is not a JSON object.")
    return header


def _parse_metadata(path: Path, metadata: object) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise DFlashTrtError(f"{path}: {METADATA_KEY} must map strings to strings.")
    return metadata


def _parse_entry(path: Path, name: str, entry: object) -> _TensorInfo:
    if not isinstance(entry, dict) or set(entry) != _TENSOR_KEYS:
        raise DFlashTrtError(
            f"{path}: the header entry of tensor {brief(name)} must have exactly the keys dtype, shape, data_offsets."
        )
    dtype_name = entry["dtype"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise DFlashTrtError(f"{path}: tensor {brief(name)} has unsupported dtype {brief(dtype_name)}.")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_int(dim) and dim >= 0 for dim in shape):
        raise DFlashTrtError(
            f"{path}: tensor {brief(name)} has shape {brief(shape)}, not a list of non-negative integers."
        )
    if len(shape) > MAX_DIMS:
        raise DFlashTrtError(f"{path}: tensor {brief(name)} has {len(shape)} dimensions, more than {MAX_DIMS}.")
    offsets = entry["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(offset) for offset in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise DFlashTrtError(f"{path}: tensor {brief(name)} has invalid data_offsets {brief(offsets)}.")
    dtype = DTYPES[dtype_name]
    span = offsets[1] - offsets[0]
    expected = _nbytes_capped(shape, dtype.itemsize, _NBYTES_CAP)
    if expected != span:
        needs = "more than 2**64" if expected > _NBYTES_CAP else str(expected)
        raise DFlashTrtError(
            f"{path}: tensor {brief(name)} ({dtype_name} {brief(shape)}) needs {needs} bytes but its data_offsets "
            f"span {span}."
        )
    return _TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])


def _nbytes_capped(shape: list[int], itemsize: int, cap: int) -> int:
    """prod(shape) * itemsize, or cap + 1 as soon as the running product exceeds cap."""
    if 0 in shape:
        return 0
    nbytes = itemsize
    for dim in shape:
        nbytes *= dim
        if nbytes > cap:
            return cap + 1
    return nbytes


class StreamingSafetensorsWriter:
    """Writes a safetensors file whose layout is fixed up front: header first, then tensors in entry order.

    Only the tensor being written is in memory. The file is created exclusively (never overwrites) and is
    deleted again if the writer is closed before every tensor was written or a `with` block fails.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        entries: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        fsync: bool = True,
        sha256: bool = False,
    ) -> None:
        """`fsync`: make the file durable at close (leave it False when the caller fsyncs at publish);
        `sha256`: hash every byte as it is written (`hexdigest()` once closed), for an integrity record."""
        self.path = Path(path)
        self._order = list(entries)
        self._entries = {name: (dtype, tuple(shape)) for name, (dtype, shape) in entries.items()}
        self._next = 0
        self._fsync = fsync
        self._digest = BackgroundDigest() if sha256 else None
        self._hexdigest: str | None = None
        self._written = 0
        self._writeback_from = 0  # bytes before this were handed to the disk already
        header = _build_header(self.path, self._entries, metadata)
        try:
            self._handle = open(self.path, "xb")
        except FileExistsError as exc:
            raise DFlashTrtError(f"{self.path} already exists; refusing to overwrite it.") from exc
        except OSError as exc:
            raise DFlashTrtError(f"cannot create {self.path}: {exc.strerror or exc}.") from exc
        self._write(struct.pack("<Q", len(header)) + header)

    def _write(self, data: bytes | memoryview) -> None:
        if self._digest is not None:
            self._digest.update(data)  # hashed on another thread while the bytes are written
        try:
            self._handle.write(data)
            self._written += len(data)
            # Whole aligned blocks only: a page under writeback can stall the next write() that touches it.
            ready = self._written - self._written % WRITEBACK_ALIGNMENT
            if ready - self._writeback_from >= WRITEBACK_BYTES:
                self._handle.flush()
                start_writeback(self._handle.fileno(), self._writeback_from, ready - self._writeback_from)
                self._writeback_from = ready
        except OSError as exc:
            self.abort()
            raise DFlashTrtError(f"cannot write {self.path}: {exc.strerror or exc}.") from exc

    def _next_entry(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        if self._handle.closed:
            raise DFlashTrtError(f"{self.path} is already closed.")
        if self._next >= len(self._order):
            raise DFlashTrtError(f"{self.path}: tensor {name!r} was not declared or is written twice.")
        expected_name = self._order[self._next]
        if name != expected_name:
            raise DFlashTrtError(f"{self.path}: expected tensor {expected_name!r} next, got {name!r}.")
        return self._entries[name]

    def _append(self, tensor: torch.Tensor) -> None:
        if tensor.numel() > 0:
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            self._write(memoryview(data.numpy().data))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append `tensor`, which must be the next entry and match its declared dtype and shape."""
        dtype, shape = self._next_entry(name)
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise DFlashTrtError(
                f"{self.path}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, declared {dtype} {shape}."
            )
        self._append(tensor)
        self._next += 1

    def write_rows(self, name: str, blocks: Iterable[torch.Tensor]) -> None:
        """Append the next entry as consecutive blocks of rows (dim 0): a large tensor is never whole in memory."""
        dtype, shape = self._next_entry(name)
        rows = 0
        for block in blocks:
            if block.dtype != dtype or tuple(block.shape[1:]) != shape[1:] or rows + block.shape[0] > shape[0]:
                self.abort()
                raise DFlashTrtError(
                    f"{self.path}: a row block of {name!r} is {block.dtype} {tuple(block.shape)} after {rows} rows, "
                    f"declared {dtype} {shape}."
                )
            self._append(block)
            rows += block.shape[0]
        if rows != shape[0]:
            self.abort()
            raise DFlashTrtError(f"{self.path}: {name!r} got {rows} of its {shape[0]} rows.")
        self._next += 1

    def close(self) -> None:
        """Flush (and fsync if asked); raises (and deletes the file) if some declared tensor was never written."""
        if self._handle.closed:
            return
        if self._next != len(self._order):
            missing = self._order[self._next]
            self.abort()
            raise DFlashTrtError(
                f"{self.path}: closed after {self._next} of {len(self._order)} tensors; {missing!r} is missing."
            )
        try:
            self._handle.flush()
            if self._fsync:
                os.fsync(self._handle.fileno())
            self._handle.close()
        except OSError as exc:
            self.abort()
            raise DFlashTrtError(f"cannot write {self.path}: {exc.strerror or exc}.") from exc
        if self._digest is not None:
            self._hexdigest = self._digest.hexdigest()

    def hexdigest(self) -> str:
        """sha256 of the whole file as written (a writer opened with `sha256=True`, once closed)."""
        if self._hexdigest is None:
            raise DFlashTrtError(f"{self.path}: no digest (not hashed, or not closed yet).")
        return self._hexdigest

    def abort(self) -> None:
        """Close and delete the partial file."""
        if not self._handle.closed:
            self._handle.close()
        if self._digest is not None:
            self._digest.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _build_header(
    path: Path, entries: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None
) -> bytes:
    """JSON header with offsets in entry order, padded with spaces so the data section starts 8-aligned."""
    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()):
            raise DFlashTrtError(f"{path}: safetensors metadata must map strings to strings.")
        header[METADATA_KEY] = dict(metadata)
    offset = 0
    for name, (dtype, shape) in entries.items():
        if not isinstance(name, str) or name == METADATA_KEY:
            raise DFlashTrtError(f"{path}: {name!r} cannot be a tensor name.")
        if dtype not in DTYPE_NAMES:
            raise DFlashTrtError(f"{path}: tensor {name!r} has dtype {dtype}, which safetensors cannot store.")
        if not all(_is_int(dim) and dim >= 0 for dim in shape):
            raise DFlashTrtError(f"{path}: tensor {name!r} has invalid shape {shape!r}.")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return encoded + b" " * (-(8 + len(encoded)) % _HEADER_ALIGNMENT)


def tensor_has_nonfinite(tensor: torch.Tensor) -> bool:
    """True if a floating or complex tensor holds NaN or +-Inf, in bounded extra memory.

    A sum is non-finite whenever an element is, and one reduction with no temporary is far faster than an
    elementwise test; only when the sum is not finite (a NaN/Inf, or finite values that overflowed) are the
    elements tested, chunk by chunk. 8-bit floats have no fast CPU sum: counting their 256 bit patterns is.
    """
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return False
    flat = tensor.detach().reshape(-1)
    if flat.element_size() == 1:
        counts = torch.bincount(flat.view(torch.uint8), minlength=256)
        return bool(counts[_nonfinite_byte_patterns(flat.dtype)].any())
    if bool(torch.isfinite(flat.sum())):
        return False
    return any(
        not bool(torch.isfinite(flat[start : start + _NONFINITE_CHUNK]).all())
        for start in range(0, flat.numel(), _NONFINITE_CHUNK)
    )


@functools.cache
def _nonfinite_byte_patterns(dtype: torch.dtype) -> torch.Tensor:
    """Mask over the 256 encodings of an 8-bit float type: True where torch decodes NaN or +-Inf."""
    return ~torch.isfinite(torch.arange(256, dtype=torch.uint8).view(dtype).float())
