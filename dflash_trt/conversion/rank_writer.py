"""Rank files written in one pass over the layout: each tensor's rows are read from its sources once, block by block,
and every rank's share of each block goes to that rank's file.

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
# Source bytes read per step: a block this small stays in the CPU's cache while it is cut, tested and copied into the
# writers' blocks (a block larger than the cache is fetched from memory again by each pass, and writing from it cost
# 3-4x the CPU time of writing the same bytes in 1 MiB blocks).
BLOCK_BYTES = 1 << 20


class Scratch:
    """The two buffers every block passes through, reused (fresh memory for every block would cost more than the
    copy: a page fault per page): one the sources are read into, one column cuts are gathered into. Writers copy
    what they are given, so a buffer is free again as soon as its bytes are handed on."""

    def __init__(self) -> None:
        self._buffers = {"read": np.empty(0, dtype=np.uint8), "gather": np.empty(0, dtype=np.uint8)}

    def take(self, use: str, nbytes: int) -> np.ndarray:
        """The buffer for `use` ("read" or "gather"), at least `nbytes` long."""
        if len(self._buffers[use]) < nbytes:
            self._buffers[use] = np.empty(nbytes, dtype=np.uint8)
        return self._buffers[use]


@dataclass(frozen=True)
class RankWritten:
    """One rank file as written: its tensor bytes and the digest of the whole file (for the integrity record)."""

    tensor_bytes: int
    digest: str


@dataclass(frozen=True)
class Rows:
    """Rows [first, stop) of one expert of a full tensor (a tensor not stacked by experts is one expert), with
    columns `columns` of each (None: whole rows)."""

    expert: int
    first: int
    stop: int
    columns: tuple[int, int] | None = None


# A piece in file order: runs of rows of the full tensor, or (an int) that many rows of zeros.
Segments = list[Rows | int]


def piece_segments(piece: Piece, shape: tuple[int, ...], stacked: bool) -> Segments:
    """A rank's piece of a tensor of `shape` (`stacked`: `[experts, rows, columns]`, one matrix per expert) as runs of
    rows of the full tensor, in the order its file holds them; that is the full tensor's own row order (checked), so
    one pass over the tensor serves every rank."""
    width = shape[2] if stacked else shape[1] if len(shape) > 1 else 1

    def runs(box: Ranges) -> list[Rows]:
        experts, (rows, *columns) = (box[0], box[1:] or ((0, shape[1]),)) if stacked else ((0, 1), box)
        cut = columns[0] if columns and columns[0] != (0, width) else None
        return [Rows(expert, *rows, cut) for expert in range(*experts)]

    if piece.axis == 0:
        segments: Segments = [run for part in piece.parts for run in ([part] if isinstance(part, int) else runs(part))]
    else:  # parts side by side along dim 1 of a stacked expert tensor: expert by expert, each part's rows of it
        experts = piece.parts[0]
        assert not isinstance(experts, int)
        boxes = [part for part in piece.parts if not isinstance(part, int)]
        segments = [Rows(expert, *box[1]) for expert in range(*experts[0]) for box in boxes]
    rows = [segment for segment in segments if isinstance(segment, Rows)]
    if any((b.expert, b.first) < (a.expert, a.stop) for a, b in zip(rows, rows[1:], strict=False)):
        raise DFlashTrtError(f"internal error: a rank piece of shape {shape} is not in the tensor's row order")
    return segments


class SourceTensor:
    """A layout tensor's full (unsharded) value as its sources concatenated by rows, read on demand as bit patterns.

    A tensor stacked by experts (`[experts, rows, columns]` from 2-D sources, one matrix per expert or several
    stacked by rows) is each expert's sources concatenated, expert after expert; any other tensor, 3-D ones read
    from a 3-D source included, is its sources concatenated along dim 0."""

    def __init__(self, out: OutputTensor, readers: Readers, scratch: Scratch | None = None) -> None:
        self.out, self.readers, self.scratch = out, readers, scratch or Scratch()
        model, name = out.sources[0]
        self.stacked = len(out.shape) == 3 and len(readers[model].shape(name)) == 2
        experts = out.shape[0] if self.stacked else 1
        per_expert = len(out.sources) // experts
        self.groups = [out.sources[e * per_expert : (e + 1) * per_expert] for e in range(experts)]

    def blocks(self, expert: int, first: int, stop: int) -> Iterator[tuple[int, np.ndarray, str]]:
        """Rows [first, stop) of `expert` as blocks of whole rows of one source each, about BLOCK_BYTES apiece (at
        least one row): (the block's first row, its bit patterns, its dtype)."""
        offset = 0
        for model, name in self.groups[expert]:
            reader = self.readers[model]
            rows = reader.shape(name)[0]
            low, high = max(first, offset) - offset, min(stop, offset + rows) - offset
            row_bytes = reader.nbytes(name) // max(1, rows)
            step = max(1, BLOCK_BYTES // max(1, row_bytes))
            for start in range(low, high, step):
                end = min(start + step, high)
                block = reader.read_rows(name, start, end, self.scratch.take("read", (end - start) * row_bytes))
                yield offset + start, block, reader.dtype_name(name)
            offset += rows


def cast_bits(block: np.ndarray, source_dtype: str, stored_dtype: str) -> np.ndarray:
    """`block`'s values cast to `stored_dtype`, as bits shaped like the block; the block itself when the types agree.
    Widening to float32 is exact and needs no torch (bfloat16 is float32's upper half; numpy has float16); a
    narrowing cast rounds as torch does, with torch."""
    if source_dtype == stored_dtype:
        return block
    if (source_dtype, stored_dtype) == ("BF16", "F32"):
        return block.astype("<u4") << 16
    if (source_dtype, stored_dtype) == ("F16", "F32"):
        return block.view("<f2").astype("<f4").view("<u4")
    values = _as_tensor(block, source_dtype)
    cast = tensor_bytes(values.to(torch_dtype(stored_dtype)))
    return cast.view(f"<u{DTYPE_SIZES[stored_dtype]}").reshape(block.shape)


def _as_tensor(block: np.ndarray, dtype: str) -> torch.Tensor:
    import torch

    return torch.from_numpy(np.ascontiguousarray(block).reshape(-1).view(np.uint8)).view(torch_dtype(dtype))


def _blame_nonfinite(out: OutputTensor, readers: Readers, stored_dtype: str) -> DFlashTrtError:
    """The error for a stored block holding NaN/Inf: a source that holds one, else a cast that overflowed."""
    for model, name in out.sources:
        shape = readers[model].shape(name)
        source = SourceTensor(OutputTensor(name, ((model, name),), shape), readers)
        if any(bits_have_nonfinite(block, dtype) for _, block, dtype in source.blocks(0, 0, shape[0])):
            what = "target" if model == TARGET else "drafter"
            return DFlashTrtError(f"{what} tensor '{name}' contains NaN or Inf values")
    return DFlashTrtError(
        f"{source_label(out)} does not fit {readable_dtype(stored_dtype)}: its stored form '{out.name}' holds NaN or "
        "Inf (values beyond the type's range); convert with --dtype bfloat16 or float32"
    )


class Route:
    """One distinct rank piece on its way to the files holding it, following the pass over the tensor's rows."""

    def __init__(self, segments: Segments, writers: list[StreamingSafetensorsWriter], scan: bool) -> None:
        self.segments, self.writers, self.scan = segments, writers, scan
        self._next = 0  # the first segment not yet wholly delivered

    def chunks(self, expert: int, first: int, block: np.ndarray) -> Iterator[np.ndarray]:
        """The piece's share of `block` (rows from `first` of `expert`), in file order: views of the block (strided
        where the piece takes some columns only), and any rows of zeros reached on the way."""
        stop = first + len(block)
        while self._next < len(self.segments):
            segment = self.segments[self._next]
            if isinstance(segment, int):
                yield self._zeros(segment, block)
            elif (segment.expert, segment.first) >= (expert, stop):
                return
            else:
                rows = block[max(segment.first, first) - first : min(segment.stop, stop) - first]
                yield rows if segment.columns is None else rows[:, slice(*segment.columns)]
                if segment.stop > stop:
                    return
            self._next += 1

    def rest(self, block: np.ndarray) -> Iterator[np.ndarray]:
        """Rows of zeros that end the piece (vocabulary padding), once the pass is over."""
        for segment in self.segments[self._next :]:
            assert isinstance(segment, int), "a piece's rows were not all delivered"
            yield self._zeros(segment, block)
        self._next = len(self.segments)

    @staticmethod
    def _zeros(rows: int, like: np.ndarray) -> np.ndarray:
        return np.zeros((rows, *like.shape[1:]), dtype=like.dtype)


def _routes(plan: ConversionPlan, source: SourceTensor, writers: dict[int, StreamingSafetensorsWriter]) -> list[Route]:
    """Each distinct piece of the tensor with the ranks holding it; every row is tested for NaN/Inf by one piece (a
    replicated tensor by rank 0's)."""
    out = source.out
    holders: dict[Piece, list[int]] = {}
    for rank in writers:
        piece = rank_piece(out.shape, out.split, plan.tp_size, rank, out.heads, out.experts)
        holders.setdefault(piece, []).append(rank)
    scan = [out.split is not Split.REPLICATE or 0 in ranks for ranks in holders.values()]
    return [
        Route(piece_segments(piece, out.shape, source.stacked), [writers[rank] for rank in ranks], tests)
        for (piece, ranks), tests in zip(holders.items(), scan, strict=True)
    ]


def needed_rows(routes: list[Route]) -> list[tuple[int, int, int]]:
    """The rows some piece holds, as (expert, first, stop) runs in the tensor's order (overlaps and neighbours
    merged)."""
    runs = sorted((s.expert, s.first, s.stop) for route in routes for s in route.segments if isinstance(s, Rows))
    merged: list[tuple[int, int, int]] = []
    for expert, first, stop in runs:
        if merged and merged[-1][0] == expert and first <= merged[-1][2]:
            merged[-1] = (expert, merged[-1][1], max(stop, merged[-1][2]))
        else:
            merged.append((expert, first, stop))
    return merged


def _deliver(chunks: list[tuple[Route, np.ndarray]], scratch: Scratch, stored: str) -> bool:
    """Hand each chunk to its piece's writers, column cuts gathered into one reused buffer first; False (nothing
    handed on from then) at a chunk a scanning piece finds NaN/Inf in."""
    cut = sum(chunk.nbytes for _, chunk in chunks if not chunk.flags.c_contiguous)
    gathered, at = scratch.take("gather", cut) if cut else None, 0
    for route, chunk in chunks:
        if gathered is not None and not chunk.flags.c_contiguous:
            into = gathered[at : at + chunk.nbytes].view(chunk.dtype).reshape(chunk.shape)
            np.copyto(into, chunk)
            chunk, at = into, at + chunk.nbytes
        if route.scan and bits_have_nonfinite(chunk, stored):
            return False
        for writer in route.writers:
            writer.append(chunk)
    return True


def _write_moved(
    plan: ConversionPlan,
    out: OutputTensor,
    readers: Readers,
    writers: dict[int, StreamingSafetensorsWriter],
    scratch: Scratch,
) -> None:
    """A tensor whose stored form is a piece of its sources (cast if need be): one pass over the rows any rank holds,
    each read once, in blocks; each block's share for every piece tested for NaN/Inf (by one piece) and written to
    every rank holding that piece."""
    source, stored = SourceTensor(out, readers, scratch), plan.stored_dtype(out)
    routes = _routes(plan, source, writers)
    for writer in writers.values():
        writer.start(out.name)
    data = np.empty((0, *out.shape[2 if source.stacked else 1 :]), dtype=f"<u{DTYPE_SIZES[stored]}")
    for expert, first, stop in needed_rows(routes):
        for row, block, dtype in source.blocks(expert, first, stop):
            data = cast_bits(block, dtype, stored)
            if not _deliver([(route, c) for route in routes for c in route.chunks(expert, row, data)], scratch, stored):
                raise _blame_nonfinite(out, readers, stored)
    _deliver([(route, chunk) for route in routes for chunk in route.rest(data)], scratch, stored)
    for writer in writers.values():
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
                    staging / rank_file(rank), entries, metadata={"format": "pt"}, fsync=False, digest=True, direct=True
                )
            )
            for rank in ranks
        }
        scratch = Scratch()
        for out in plan.layout:
            if plan.moves_bytes(out):
                _write_moved(plan, out, readers, writers, scratch)
            else:
                for rank in ranks:  # the first rank tests the sources: a bad input is named, not taken for overflow
                    for name, piece in rank_tensors(plan, out, readers, rank, check_finite=rank == ranks[0]).items():
                        check_stored_finite(out, name, piece)
                        writers[rank].write(name, piece)
            progress(len(ranks))
    rank_bytes = rank_file_bytes(entries)
    return {rank: RankWritten(rank_bytes, writer.hexdigest()) for rank, writer in writers.items()}
