"""Rank files written in one pass over the layout: each tensor is read from its sources once and every rank's piece
of it goes to that rank's file.

Most of a conversion only moves bytes (renamed, fused, split over ranks): those tensors are read with `pread` as
bit patterns, cut by the split rules of `sharding.rank_piece`, tested for NaN/Inf by their bits and written, with
no torch at all. Torch comes in only where bytes change: a cast to another dtype, a quantized or carried weight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dflash_trt.checkpoint.hf_reader import HFCheckpointReader
from dflash_trt.checkpoint.layout import TARGET, OutputTensor
from dflash_trt.checkpoint.safetensors_io import (
    DTYPE_SIZES,
    StreamingSafetensorsWriter,
    bits_have_nonfinite,
    readable_dtype,
    tensor_bytes,
    torch_dtype,
)
from dflash_trt.checkpoint.sharding import Piece, Ranges, Split, rank_piece
from dflash_trt.conversion.plan import (
    ConversionPlan,
    check_stored_finite,
    rank_file,
    rank_file_bytes,
    rank_tensors,
    source_label,
)
from dflash_trt.errors import DFlashTrtError

if TYPE_CHECKING:
    import torch

Readers = dict[str, HFCheckpointReader]
# Source bytes read per step of a tensor too large to read whole: a huge embedding is never whole in memory.
BLOCK_BYTES = 16 << 20
# A tensor up to this size is read whole, once, and every rank's piece cut from it in memory.
WHOLE_MAX_BYTES = 32 << 20
# Read buffers reused in turn: fresh memory for every block would cost more than the copy (a page fault per page).
READ_BUFFERS = 3


class ReadBuffers:
    """A ring of reusable read buffers. A buffer is refilled only once every writer it went to is done with it: each
    writer hashes and writes at most its last block in the background, so only writers whose last block came from
    the buffer may still be reading it."""

    def __init__(self, count: int = READ_BUFFERS) -> None:
        self._buffers = [np.empty(0, dtype=np.uint8) for _ in range(count)]
        self._next = 0
        self._last_buffer: dict[StreamingSafetensorsWriter, int] = {}

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least `nbytes`, free to overwrite."""
        index, self._next = self._next, (self._next + 1) % len(self._buffers)
        for writer, last in self._last_buffer.items():
            if last == index:
                writer.wait_written()
        if len(self._buffers[index]) < nbytes:
            self._buffers[index] = np.empty(nbytes, dtype=np.uint8)
        return self._buffers[index]

    def appended(self, writer: StreamingSafetensorsWriter, data: np.ndarray) -> None:
        """Record that `writer` was handed `data` (a view of one of the buffers, or memory of its own)."""
        base = data.base if data.base is not None else data
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        owner = next((i for i, buffer in enumerate(self._buffers) if buffer is base), -1)
        self._last_buffer[writer] = owner


@dataclass(frozen=True)
class RankWritten:
    """One rank file as written: its tensor bytes and the digest of the whole file (for the integrity record)."""

    tensor_bytes: int
    digest: str


class SourceTensor:
    """A layout tensor's full (unsharded) value as its sources concatenated by rows, read on demand as bit patterns.

    A stacked expert tensor `[experts, rows, columns]` is each expert's sources concatenated, expert after expert:
    in row-major order that is all its sources, in order, so a small one is read whole the same way."""

    def __init__(self, out: OutputTensor, readers: Readers, buffers: ReadBuffers | None = None) -> None:
        self.out, self.readers, self.buffers = out, readers, buffers or ReadBuffers()
        self.stacked = len(out.shape) == 3
        experts = out.shape[0] if self.stacked else 1
        per_expert = len(out.sources) // experts
        self.groups = [out.sources[e * per_expert : (e + 1) * per_expert] for e in range(experts)]
        dtypes = {readers[model].dtype_name(name) for model, name in out.sources}
        nbytes = sum(readers[model].nbytes(name) for model, name in out.sources)
        self.whole_dtype = next(iter(dtypes)) if len(dtypes) == 1 and nbytes <= WHOLE_MAX_BYTES else None
        self._whole: np.ndarray | None = None

    def _read_whole(self) -> np.ndarray:
        """Every source read, in order, into one buffer: the full tensor without a concatenating copy."""
        if self._whole is None:
            sizes = [self.readers[model].nbytes(name) for model, name in self.out.sources]
            buffer, at = self.buffers.take(sum(sizes)), 0
            for (model, name), size in zip(self.out.sources, sizes, strict=True):
                self.readers[model].read_rows(name, 0, self._rows(model, name), buffer[at : at + size])
                at += size
            self._whole = buffer[:at].view(f"<u{DTYPE_SIZES[self.whole_dtype or 'U8']}").reshape(self.out.shape)
        return self._whole

    def _read(self, model: str, name: str, start: int, stop: int) -> np.ndarray:
        reader = self.readers[model]
        nbytes = (stop - start) * (reader.nbytes(name) // max(1, self._rows(model, name)))
        return reader.read_rows(name, start, stop, self.buffers.take(nbytes))

    def _rows(self, model: str, name: str) -> int:
        return self.readers[model].shape(name)[0]

    def blocks(self, box: Ranges) -> Iterator[tuple[np.ndarray, str]]:
        """The box of the full tensor, in row-major order, as contiguous blocks with their dtype."""
        if self.whole_dtype is not None:
            yield np.ascontiguousarray(self._read_whole()[tuple(slice(*r) for r in box)]), self.whole_dtype
        elif self.stacked:
            for expert in range(*box[0]):
                for block, dtype in self._source_rows(self.groups[expert], box[1:]):
                    yield block[np.newaxis], dtype
        else:
            yield from self._source_rows(self.groups[0], box)

    def _source_rows(self, sources: tuple[tuple[str, str], ...], box: Ranges) -> Iterator[tuple[np.ndarray, str]]:
        """Rows `box[0]` of `sources` stacked by rows (columns `box[1]` of each, if given), block by block."""
        first, stop = box[0] if box else (0, sum(self._rows(m, n) for m, n in sources))
        offset = 0
        for model, name in sources:
            rows, reader = self._rows(model, name), self.readers[model]
            low, high = max(first, offset) - offset, min(stop, offset + rows) - offset
            step = max(1, BLOCK_BYTES // max(1, reader.nbytes(name) // max(1, rows)))
            for start in range(low, high, step):
                block = self._read(model, name, start, min(start + step, high))
                if len(box) > 1:
                    block = np.ascontiguousarray(block[:, slice(*box[1])])
                yield block, reader.dtype_name(name)
            offset += rows


def piece_blocks(piece: Piece, source: SourceTensor, width: int) -> Iterator[tuple[np.ndarray, str | None]]:
    """A rank's piece in file order, block by block (zero padding rows carry no dtype: they need no cast or test)."""
    if piece.axis == 0:
        for part in piece.parts:
            if isinstance(part, int):
                yield np.zeros((part, *source.out.shape[1:]), dtype=f"<u{width}"), None
            else:
                yield from source.blocks(part)
        return
    # Parts side by side along dim 1 of a stacked expert tensor: expert by expert, each part's rows of it.
    experts = piece.parts[0]
    assert not isinstance(experts, int)
    for expert in range(*experts[0]):
        for part in piece.parts:
            assert not isinstance(part, int)
            yield from source.blocks(((expert, expert + 1), *part[1:]))


def cast_bits(block: np.ndarray, source_dtype: str, stored_dtype: str) -> np.ndarray:
    """`block`'s values cast to `stored_dtype`, as bits; the block itself when the types agree. Widening to float32
    is exact and needs no torch (bfloat16 is float32's upper half; numpy has float16); a narrowing cast rounds as
    torch does, with torch."""
    if source_dtype == stored_dtype:
        return block
    if (source_dtype, stored_dtype) == ("BF16", "F32"):
        return block.astype("<u4") << 16
    if (source_dtype, stored_dtype) == ("F16", "F32"):
        return block.view("<f2").astype("<f4").view("<u4")
    values = _as_tensor(block, source_dtype)
    return tensor_bytes(values.to(torch_dtype(stored_dtype)))


def _as_tensor(block: np.ndarray, dtype: str) -> torch.Tensor:
    import torch

    return torch.from_numpy(np.ascontiguousarray(block).reshape(-1).view(np.uint8)).view(torch_dtype(dtype))


def _blame_nonfinite(out: OutputTensor, readers: Readers, stored_dtype: str) -> DFlashTrtError:
    """The error for a stored block holding NaN/Inf: a source that holds one, else a cast that overflowed."""
    for model, name in out.sources:
        shape = readers[model].shape(name)
        for block, dtype in SourceTensor(OutputTensor(name, ((model, name),), shape), readers).blocks(((0, shape[0]),)):
            if bits_have_nonfinite(block, dtype):
                what = "target" if model == TARGET else "drafter"
                return DFlashTrtError(f"{what} tensor '{name}' contains NaN or Inf values")
    return DFlashTrtError(
        f"{source_label(out)} does not fit {readable_dtype(stored_dtype)}: its stored form '{out.name}' holds NaN or "
        "Inf (values beyond the type's range); convert with --dtype bfloat16 or float32"
    )


def _write_moved(
    plan: ConversionPlan,
    out: OutputTensor,
    readers: Readers,
    writers: dict[int, StreamingSafetensorsWriter],
    buffers: ReadBuffers,
) -> None:
    """A tensor whose stored form is a piece of its sources (cast if need be): each distinct piece read once, written
    to every rank holding it; every row tested for NaN/Inf by one rank (a replicated tensor by rank 0)."""
    source, stored = SourceTensor(out, readers, buffers), plan.stored_dtype(out)
    holders: dict[Piece, list[int]] = {}
    for rank in writers:
        piece = rank_piece(out.shape, out.split, plan.tp_size, rank, out.heads, out.experts)
        holders.setdefault(piece, []).append(rank)
    for piece, ranks in holders.items():
        scan = out.split is not Split.REPLICATE or 0 in ranks
        targets = [writers[rank] for rank in ranks]
        for writer in targets:
            writer.start(out.name)
        for block, dtype in piece_blocks(piece, source, DTYPE_SIZES[stored]):
            data = block if dtype is None else cast_bits(block, dtype, stored)
            if scan and dtype is not None and bits_have_nonfinite(data, stored):
                raise _blame_nonfinite(out, readers, stored)
            for writer in targets:
                writer.append(data)
                buffers.appended(writer, data)
        for writer in targets:
            writer.finish()


def write_rank_files(
    plan: ConversionPlan, staging: Path, readers: Readers, ranks: list[int], progress: Callable[[int], object]
) -> dict[int, RankWritten]:
    """The files of `ranks`, written side by side in one pass, each hashed as written (made durable at publish)."""
    entries = plan.entries()
    with contextlib.ExitStack() as stack:
        writers = {
            rank: stack.enter_context(
                StreamingSafetensorsWriter(
                    staging / rank_file(rank), entries, metadata={"format": "pt"}, fsync=False, digest=True
                )
            )
            for rank in ranks
        }
        buffers = ReadBuffers()
        for out in plan.layout:
            if plan.moves_bytes(out):
                _write_moved(plan, out, readers, writers, buffers)
            else:
                for rank in ranks:  # the first rank tests the sources: a bad input is named, not taken for overflow
                    for name, piece in rank_tensors(plan, out, readers, rank, check_finite=rank == ranks[0]).items():
                        check_stored_finite(out, name, piece)
                        writers[rank].write(name, piece)
            progress(len(ranks))
    rank_bytes = rank_file_bytes(entries)
    return {rank: RankWritten(rank_bytes, writer.hexdigest()) for rank, writer in writers.items()}
