"""Safetensors files read through a memory map and written one tensor at a time.

Checkpoints can be larger than host RAM and come from strangers, so the reader validates the whole header
before touching data (no allocation sized by an untrusted field, no offset outside the file) and the writer
puts the header first and then streams tensor bytes, holding at most one tensor in memory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import mmap
import os
import platform
import stat
import struct
import sys
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np

from dflash_trt.checkpoint.atomic import start_writeback
from dflash_trt.checkpoint.integrity import new_record_digest
from dflash_trt.errors import DFlashTrtError

if TYPE_CHECKING:
    import torch

# Largest JSON header accepted: far above any real checkpoint's, far below a harmful allocation.
MAX_HEADER_BYTES = 100 * 1024 * 1024
METADATA_KEY = "__metadata__"
# Real tensors have at most a handful of dimensions and far fewer than 2**64 bytes; anything beyond is a
# corrupt or hostile header (whose shape's full product could take unbounded time to compute).
MAX_DIMS = 16
_NBYTES_CAP = 1 << 64
_HEADER_ALIGNMENT = 8
# The writer gathers the bytes it is given into blocks of this size and hashes and writes each full one on its own
# thread while the caller fills the next: small enough to stay in the CPU's cache, large enough for the disk.
WRITE_BLOCK_BYTES = 1 << 20
# Blocks written at once (hashing stays in file order): a disk takes several writes in flight faster than one after
# the other (measured here: tp 1 2.3 s with 4, 3.0 s with 2, 3.5 s with 1).
WRITES_IN_FLIGHT = 4
# Direct I/O (no copy into the page cache) needs buffers, offsets and sizes aligned to the disk's blocks: 4 KiB
# covers 512-byte and 4 KiB sectors alike. The block size is a multiple of it.
DIRECT_ALIGNMENT = 4096
# Bytes written through the page cache are handed to the disk in steps of this size (a multiple of the block size),
# so the disk works while the file grows and the fsync at publish waits for the tail only (direct writes leave
# nothing to hand over).
WRITEBACK_BYTES = 32 << 20
_TENSOR_KEYS = frozenset({"dtype", "shape", "data_offsets"})
# Not exported by Python before 3.13; the value is Linux's on x86-64 and aarch64.
_MAP_NORESERVE = getattr(
    mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64") else 0
)
# safetensors dtype name -> bytes per element. Torch dtypes are looked up by name only where tensors are made:
# moving bytes (a conversion without a cast) never imports torch.
DTYPE_SIZES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "C64": 8,
}
_TORCH_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
}
# NaN and +-Inf by their bits: with the sign bit masked off, a float is not finite when its bits reach the all-ones
# exponent (the masked value's high bits). Complex64 is two float32s. The fnuz formats' only NaN is 0x80.
_NONFINITE_FROM: dict[str, tuple[int, int]] = {
    "F64": (0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
    "F32": (0x7FFF_FFFF, 0x7F80_0000),
    "C64": (0x7FFF_FFFF, 0x7F80_0000),
    "F16": (0x7FFF, 0x7C00),
    "BF16": (0x7FFF, 0x7F80),
    "F8_E4M3": (0x7F, 0x7F),
    "F8_E5M2": (0x7F, 0x7C),
    "F8_E8M0": (0xFF, 0xFF),
}
_NAN_ONLY_0X80 = ("F8_E4M3FNUZ", "F8_E5M2FNUZ")
_NONFINITE_CHUNK = 1 << 18  # elements per step of the NaN/Inf scan: its temporary stays in the CPU's cache


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    import torch

    return getattr(torch, _TORCH_NAMES[name])


def readable_dtype(name: str) -> str:
    """A safetensors dtype name as torch names it ("BF16" -> "bfloat16"), for messages."""
    return _TORCH_NAMES[name]


_NAMES_BY_TORCH = {torch_name: name for name, torch_name in _TORCH_NAMES.items()}


def dtype_name(dtype: str | torch.dtype) -> str:
    """The safetensors name of a torch dtype (a safetensors name is returned as it is, once checked)."""
    if not isinstance(dtype, str):
        return stored_dtype_name(str(dtype).removeprefix("torch."))
    if dtype not in DTYPE_SIZES:
        raise DFlashTrtError(f"{dtype} is a dtype safetensors cannot store.")
    return dtype


def stored_dtype_name(torch_name: str) -> str:
    """The safetensors name of a torch dtype named as a string ("bfloat16" -> "BF16"), without importing torch."""
    if torch_name not in _NAMES_BY_TORCH:
        raise DFlashTrtError(f"{torch_name} is a dtype safetensors cannot store.")
    return _NAMES_BY_TORCH[torch_name]


def bits_view(data: np.ndarray, dtype: str) -> np.ndarray:
    """A contiguous array's bytes as unsigned integers of `dtype`'s width (its bit patterns)."""
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8).view(f"<u{DTYPE_SIZES[dtype]}")


def bits_have_nonfinite(data: np.ndarray, dtype: str) -> bool:
    """True if `data`, the bytes of `dtype` values, holds a NaN or +-Inf: a bit test, in cache-sized steps."""
    if dtype in _NAN_ONLY_0X80:
        return bool((bits_view(data, dtype) == 0x80).any())
    rule = _NONFINITE_FROM.get(dtype)
    if rule is None:  # integers and bool: always finite
        return False
    mask, nonfinite_from = rule
    bits = bits_view(data, dtype)
    if dtype == "C64":
        bits = bits.view("<u4")
    scratch = np.empty(min(bits.size, _NONFINITE_CHUNK), dtype=bits.dtype)
    for start in range(0, bits.size, _NONFINITE_CHUNK):
        chunk = bits[start : start + _NONFINITE_CHUNK]
        masked = scratch[: chunk.size]
        np.bitwise_and(chunk, mask, out=masked)
        if masked.max() >= nonfinite_from:
            return True
    return False


@dataclass(frozen=True, slots=True)
class _TensorInfo:
    dtype: str  # safetensors name
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
        return torch_dtype(self._info(name).dtype)

    def dtype_name(self, name: str) -> str:
        """The tensor's safetensors dtype name ("BF16", ...), known without torch."""
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
        import torch

        info = self._info(name)
        if self._fd is None:
            raise DFlashTrtError(f"{self.path} is closed.")
        dtype, nbytes = torch_dtype(info.dtype), info.end - info.begin
        if nbytes == 0:
            return torch.empty(info.shape, dtype=dtype)
        region, offset = self._region(name, self._data_start + info.begin, nbytes)
        if offset % dtype.itemsize == 0:
            tensor = torch.frombuffer(region, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)
            return (tensor.clone() if copy else tensor).view(info.shape)
        raw = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
        return raw.clone().view(dtype).view(info.shape)

    def read_rows(self, name: str, start: int, stop: int, into: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) of `name` read as their bit patterns (unsigned integers as wide as the dtype, shaped like
        the rows) into the start of `into` (a uint8 buffer, reused by the caller) or a new array: bytes to move or
        test, with no torch and no page of the file left mapped."""
        info = self._info(name)
        if not info.shape or not 0 <= start <= stop <= info.shape[0]:
            raise DFlashTrtError(f"rows {start}:{stop} are outside tensor {brief(name)} of shape {info.shape}.")
        if self._fd is None:
            raise DFlashTrtError(f"{self.path} is closed.")
        row_bytes = (info.end - info.begin) // info.shape[0] if info.shape[0] else 0
        nbytes = (stop - start) * row_bytes
        data = np.empty(nbytes, dtype=np.uint8) if into is None else into[:nbytes]
        view, done, first = memoryview(data.data), 0, self._data_start + info.begin + start * row_bytes
        while done < len(data):
            try:
                count = os.preadv(self._fd, [view[done:]], first + done)
            except OSError as exc:
                reason = exc.strerror or exc
                raise DFlashTrtError(f"cannot read tensor {brief(name)} of {self.path}: {reason}.") from exc
            if count == 0:
                raise DFlashTrtError(f"{self.path} was truncated while tensor {brief(name)} was read from it.")
            done += count
        return data.view(f"<u{DTYPE_SIZES[info.dtype]}").reshape(stop - start, *info.shape[1:])

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
    if not isinstance(dtype_name, str) or dtype_name not in DTYPE_SIZES:
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
    span = offsets[1] - offsets[0]
    expected = _nbytes_capped(shape, DTYPE_SIZES[dtype_name], _NBYTES_CAP)
    if expected != span:
        needs = "more than 2**64" if expected > _NBYTES_CAP else str(expected)
        raise DFlashTrtError(
            f"{path}: tensor {brief(name)} ({dtype_name} {brief(shape)}) needs {needs} bytes but its data_offsets "
            f"span {span}."
        )
    return _TensorInfo(dtype_name, tuple(shape), offsets[0], offsets[1])


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

    Only the tensor being written is in memory, and it may arrive in pieces of any size (`start`, `append`, `finish`)
    from any source: a conversion that only moves bytes never makes a tensor. The pieces are copied into the
    writer's blocks of WRITE_BLOCK_BYTES (so the caller may reuse its buffer at once); each full block is hashed (in
    file order) and written at its offset on one of the writer's threads (blake3 and the write release the GIL)
    while the caller fills the next. With `direct`, blocks go straight to the disk where the file system allows it
    (O_DIRECT), without a copy into the page cache or writeback left for the fsync; the short last block goes
    through the page cache.
    The file is created exclusively (never overwrites) and is deleted again if the writer is closed before every
    tensor was written or a `with` block fails.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        entries: Mapping[str, tuple[str | torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        fsync: bool = True,
        digest: bool = False,
        direct: bool = False,
    ) -> None:
        """`entries`: dtype (a safetensors name or a torch dtype) and shape of each tensor, in file order.
        `fsync`: make the file durable at close (leave it False when the caller fsyncs at publish);
        `digest`: hash every byte as it is written (`hexdigest()` once closed), for an integrity record;
        `direct`: write full blocks with direct I/O where the file system supports it (large files written once)."""
        self.path = Path(path)
        self._entries = {name: (dtype_name(dtype), tuple(shape)) for name, (dtype, shape) in entries.items()}
        self._order = list(self._entries)
        self._next = 0
        self._open_bytes = -1  # bytes the tensor being written still expects; -1 between tensors
        self._fsync = fsync
        self._digest = new_record_digest() if digest else None
        self._hexdigest: str | None = None
        self._threads = ThreadPoolExecutor(max_workers=WRITES_IN_FLIGHT, thread_name_prefix="safetensors-write")
        self._blocks = [_aligned_buffer(WRITE_BLOCK_BYTES) for _ in range(WRITES_IN_FLIGHT + 1)]
        self._in_flight: list[Future[None] | None] = [None] * len(self._blocks)
        self._filling, self._filled, self._block_offset = 0, 0, 0
        self._hashed = threading.Event()  # set once every block handed on so far is hashed
        self._hashed.set()
        header = _build_header(self.path, self._entries, metadata)
        try:
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError as exc:
            raise DFlashTrtError(f"{self.path} already exists; refusing to overwrite it.") from exc
        except OSError as exc:
            raise DFlashTrtError(f"cannot create {self.path}: {exc.strerror or exc}.") from exc
        self._direct = direct and _set_direct(self._fd, True)
        self._stage(memoryview(struct.pack("<Q", len(header)) + header))

    def _stage(self, view: memoryview) -> None:
        """Copy bytes into the block being filled, handing each block that fills up to the writer's threads."""
        while view:
            block = self._blocks[self._filling]
            count = min(len(view), len(block) - self._filled)
            block[self._filled : self._filled + count] = view[:count]
            self._filled += count
            view = view[count:]
            if self._filled == len(block):
                fd, after, self._hashed = self._require_open(), self._hashed, threading.Event()
                job = self._threads.submit(self._put, fd, block, self._block_offset, after, self._hashed)
                self._in_flight[self._filling] = job
                self._block_offset += len(block)
                self._filling, self._filled = (self._filling + 1) % len(self._blocks), 0
                self._wait(self._filling)

    def _put(self, fd: int, block: memoryview, offset: int, after: threading.Event, hashed: threading.Event) -> None:
        """Hash one block once the blocks before it are (`after`), then write it at its offset (on a writer thread,
        or the caller's for the last block)."""
        after.wait()
        try:
            if self._digest is not None:
                self._digest.update(block)
        finally:
            hashed.set()
        end = offset + len(block)
        while block:
            try:
                written = os.pwrite(fd, block, offset)
            except OSError as exc:  # a disk needing other alignment than DIRECT_ALIGNMENT: through the page cache
                if not (self._direct and exc.errno == errno.EINVAL):
                    raise
                self._direct = _set_direct(fd, False)
                continue
            block, offset = block[written:], offset + written
        if not self._direct and end % WRITEBACK_BYTES == 0:
            start_writeback(fd, end - WRITEBACK_BYTES, WRITEBACK_BYTES)

    def _wait(self, index: int) -> None:
        """Return once block `index` is hashed and written (raising its failure as this file's error)."""
        in_flight, self._in_flight[index] = self._in_flight[index], None
        if in_flight is not None:
            try:
                in_flight.result()
            except OSError as exc:
                self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        self.abort()
        raise DFlashTrtError(f"cannot write {self.path}: {exc.strerror or exc}.") from exc

    def _require_open(self) -> int:
        if self._fd is None:
            raise DFlashTrtError(f"{self.path} is already closed.")
        return self._fd

    def start(self, name: str) -> None:
        """Begin the next tensor, `name`; its bytes follow through `append`."""
        self._require_open()
        if self._open_bytes >= 0:
            raise DFlashTrtError(f"{self.path}: tensor {name!r} started before {self._order[self._next]!r} finished.")
        if self._next >= len(self._order):
            raise DFlashTrtError(f"{self.path}: tensor {name!r} was not declared or is written twice.")
        expected_name = self._order[self._next]
        if name != expected_name:
            raise DFlashTrtError(f"{self.path}: expected tensor {expected_name!r} next, got {name!r}.")
        dtype, shape = self._entries[name]
        self._open_bytes = math.prod(shape) * DTYPE_SIZES[dtype]

    def append(self, data: np.ndarray | bytes | memoryview) -> None:
        """Append bytes of the tensor being written (an array, bytes or a buffer); copied before this returns."""
        view = memoryview(np.ascontiguousarray(data).data if isinstance(data, np.ndarray) else data).cast("B")
        if self._open_bytes < 0 or len(view) > self._open_bytes:
            name = self._order[min(self._next, len(self._order) - 1)]
            self.abort()
            raise DFlashTrtError(f"{self.path}: {len(view)} bytes appended beyond tensor {name!r}'s declared size.")
        self._stage(view)
        self._open_bytes -= len(view)

    def finish(self) -> None:
        """End the tensor being written; it must have received exactly its declared bytes."""
        if self._open_bytes != 0:
            name = self._order[self._next] if self._next < len(self._order) else "?"
            missing = self._open_bytes
            self.abort()
            raise DFlashTrtError(f"{self.path}: tensor {name!r} finished {missing} bytes short of its declared size.")
        self._open_bytes = -1
        self._next += 1

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append `tensor`, which must be the next entry and match its declared dtype and shape."""
        self.start(name)
        dtype, shape = self._entries[name]
        if dtype_name(tensor.dtype) != dtype or tuple(tensor.shape) != shape:
            self.abort()
            raise DFlashTrtError(
                f"{self.path}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, declared {dtype} {shape}."
            )
        self.append(tensor_bytes(tensor))
        self.finish()

    def close(self) -> None:
        """Write the last block, close (fsync first if asked); raises (and deletes the file) if some declared tensor
        was never written."""
        if self._fd is None:
            return
        for index in range(len(self._blocks)):
            self._wait(index)
        self._threads.shutdown()
        if self._next != len(self._order):
            missing = self._order[self._next]
            self.abort()
            raise DFlashTrtError(
                f"{self.path}: closed after {self._next} of {len(self._order)} tensors; {missing!r} is missing."
            )
        try:
            if self._filled:  # a short block: through the page cache (direct I/O takes whole disk blocks only)
                self._direct = self._direct and _set_direct(self._fd, False)
                last = self._blocks[self._filling][: self._filled]
                self._put(self._fd, last, self._block_offset, self._hashed, threading.Event())
            if self._fsync:
                os.fsync(self._fd)
        except OSError as exc:
            self._fail(exc)
        os.close(self._fd)
        self._fd = None
        if self._digest is not None:
            self._hexdigest = self._digest.hexdigest()
            self._digest = None

    def hexdigest(self) -> str:
        """Digest of the whole file as written (a writer opened with `digest=True`, once closed)."""
        if self._hexdigest is None:
            raise DFlashTrtError(f"{self.path}: no digest (not hashed, or not closed yet).")
        return self._hexdigest

    def abort(self) -> None:
        """Close and delete the partial file (once the blocks in flight, if any, are done with it)."""
        for index, in_flight in enumerate(self._in_flight):
            self._in_flight[index] = None
            if in_flight is not None:
                in_flight.exception()  # waits; its failure, if any, is why this file is being dropped
        self._threads.shutdown()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
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


def _aligned_buffer(nbytes: int) -> memoryview:
    """`nbytes` of memory starting at a multiple of DIRECT_ALIGNMENT (what direct I/O reads its bytes from)."""
    raw = np.empty(nbytes + DIRECT_ALIGNMENT, dtype=np.uint8)
    skip = -raw.ctypes.data % DIRECT_ALIGNMENT
    return raw[skip : skip + nbytes].data


def _set_direct(fd: int, on: bool) -> bool:
    """Turn direct I/O on or off for an open file; whether it is now on (False where the file system refuses it)."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | direct if on else flags & ~direct)
    except OSError:
        return False
    return on


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's bytes, in row-major order, as a uint8 array (a view where the tensor is contiguous on the CPU)."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, dtype=np.uint8)


def _build_header(
    path: Path, entries: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, str] | None
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
        if not all(_is_int(dim) and dim >= 0 for dim in shape):
            raise DFlashTrtError(f"{path}: tensor {name!r} has invalid shape {shape!r}.")
        size = math.prod(shape) * DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return encoded + b" " * (-(8 + len(encoded)) % _HEADER_ALIGNMENT)


def tensor_has_nonfinite(tensor: torch.Tensor) -> bool:
    """True if a floating or complex tensor holds NaN or +-Inf: the bit test of `bits_have_nonfinite` on its bytes
    (no sum that finite values could overflow, no temporary as large as the tensor)."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return False
    return bits_have_nonfinite(tensor_bytes(tensor), dtype_name(tensor.dtype))
