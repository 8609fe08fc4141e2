"""HF target + z-lab DFlash drafter → one TensorRT-LLM 1.2.x checkpoint (config.json + rank{N}.safetensors).

Tensors stream from memory-mapped sources to a header-first writer one at a time, so peak memory stays near the
largest single tensor; the output is staged beside its destination and renamed into place only once written and
checked, so a failure never leaves a half checkpoint behind.
"""

from __future__ import annotations

import ctypes
import json
import math
import multiprocessing
import os
import shutil
import signal
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_trt.checkpoint.atomic import atomic_directory, check_destination, check_output_apart, scratch_directory
from dflash_trt.checkpoint.hf_reader import HFCheckpointReader
from dflash_trt.checkpoint.integrity import write_integrity_record
from dflash_trt.checkpoint.layout import DRAFT, TARGET, OutputTensor, checkpoint_layout, target_heads
from dflash_trt.checkpoint.safetensors_io import SafetensorsFile, StreamingSafetensorsWriter, tensor_has_nonfinite
from dflash_trt.checkpoint.sharding import ExpertLayout, Split, check_moe_parallel, check_tp, pad_vocab_size
from dflash_trt.checkpoint.stored import QuantSettings, kv_scale_name, rank_pieces, rank_stored, stored_entries
from dflash_trt.checkpoint.trtllm_config import checkpoint_config
from dflash_trt.conversion import prequantized_input
from dflash_trt.conversion.prequantized import PrequantizedFormat, read_hf_quant_config
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import DTYPES, FP8, NONE, quantized_linear, torch_dtypes
from dflash_trt.quant.linears import check_quantizable
from dflash_trt.spec import (
    DraftSpec,
    TargetSpec,
    check_tensor_shapes,
    draft_tensor_shapes,
    load_draft_spec,
    load_target_spec,
    target_tensor_shapes,
)

SOURCE_FLOAT_DTYPES = tuple(torch_dtypes().values())
SourceTensors = Iterable[tuple[str, str, torch.Tensor]]  # (TARGET or DRAFT, source name, tensor)
# Plain data files a user expects next to the checkpoint (for `generate --input_file` with text). Never code.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
# Tensors at least this large are streamed in row blocks of about this size (bounded memory for embeddings).
STREAM_MIN_BYTES = 64 << 20
STREAM_BLOCK_BYTES = 32 << 20
PR_SET_PDEATHSIG = 1  # prctl option: signal this process when its parent dies (linux/prctl.h)
# Non-parameter buffers some exporters store; they carry no weights the engine needs.
IGNORED_SOURCE_SUFFIXES = (".rotary_emb.inv_freq",)
# Calibration prompt tokens kept when the caller does not say (fewer on a model with fewer positions).
DEFAULT_CALIB_MAX_SEQ_LEN = 512


@dataclass(frozen=True)
class ConversionResult:
    output_dir: Path
    tp_size: int
    num_tensors: int
    bytes_written: int


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def _source_shapes(reader: HFCheckpointReader) -> dict[str, tuple[int, ...]]:
    return {n: reader.shape(n) for n in reader.names() if not n.endswith(IGNORED_SOURCE_SUFFIXES)}


def check_sources(
    target: TargetSpec,
    draft: DraftSpec,
    target_reader: HFCheckpointReader,
    draft_reader: HFCheckpointReader,
    prequantized: PrequantizedFormat | None = None,
) -> None:
    """Every tensor present with the shape its config promises, float-typed (or, in a pre-quantized target, one of
    its quantized linears' tensors), nothing unexpected."""
    expected = target_tensor_shapes(target)
    extra: tuple[str, ...] = ("lm_head.weight",) if target.tie_word_embeddings else ()
    carried: set[str] = set()
    if prequantized is not None:
        expected, scales = prequantized_input.source_expectations(target, prequantized, expected)
        extra += scales
        carried = set(scales) | prequantized_input.carried_weights(target)
    check_tensor_shapes(expected, _source_shapes(target_reader), "target", extra)
    check_tensor_shapes(draft_tensor_shapes(draft), _source_shapes(draft_reader), "drafter")
    for what, reader in (("target", target_reader), ("drafter", draft_reader)):
        for name in reader.names():
            if name in carried and what == "target" or name.endswith(IGNORED_SOURCE_SUFFIXES):
                continue
            if reader.dtype(name) not in SOURCE_FLOAT_DTYPES:
                raise DFlashTrtError(
                    f"{what} tensor '{name}' has dtype {reader.dtype(name)}; expected float32, float16 or bfloat16 "
                    "weights (a pre-quantized target needs its hf_quant_config.json)"
                )


def _source_label(out: OutputTensor) -> str:
    model, name = out.sources[0]
    return f"{'target' if model == TARGET else 'drafter'} tensor '{name}'"


def check_stored_finite(out: OutputTensor, name: str, stored: torch.Tensor) -> None:
    """Sources are checked finite, so a non-finite stored value means the cast (or quantization) overflowed: a
    float16 checkpoint of weights beyond 65504 would otherwise hold +-Inf and decode nothing but garbage."""
    if tensor_has_nonfinite(stored):
        raise DFlashTrtError(
            f"{_source_label(out)} does not fit {str(stored.dtype).removeprefix('torch.')}: its stored form "
            f"'{name}' holds NaN or Inf (values beyond the type's range); convert with --dtype bfloat16 or float32"
        )


def check_cast_finite(out: OutputTensor, name: str, stored: torch.Tensor, sources: SourceTensors) -> None:
    """The one NaN/Inf scan of a tensor stored as a plain cast of its sources (or a piece of them): a cast keeps
    NaN and Inf, so a finite stored tensor proves its sources finite. Only a non-finite one has its `sources`
    (model, name, tensor; a generator maps them only then) scanned, to tell bad input from a cast that overflowed."""
    if not tensor_has_nonfinite(stored):
        return
    for model, source_name, tensor in sources:
        if tensor_has_nonfinite(tensor):
            what = "target" if model == TARGET else "drafter"
            raise DFlashTrtError(f"{what} tensor '{source_name}' contains NaN or Inf values")
    check_stored_finite(out, name, stored)


def _load_full(out: OutputTensor, readers: dict[str, HFCheckpointReader], check_finite: bool) -> torch.Tensor:
    loaded = []
    for model, name in out.sources:
        tensor = readers[model].get(name)
        if check_finite and tensor_has_nonfinite(tensor):
            what = "target" if model == TARGET else "drafter"
            raise DFlashTrtError(f"{what} tensor '{name}' contains NaN or Inf values")
        loaded.append(tensor)
    return out.assemble(loaded)


@dataclass(frozen=True)
class ConversionPlan:
    """Everything that decides the bytes of every rank file (picklable, so worker processes can take it)."""

    model_dir: Path
    dflash_model_dir: Path
    target: TargetSpec
    draft: DraftSpec
    dtype: torch.dtype
    tp_size: int
    quant: QuantSettings = QuantSettings()
    scales: dict = field(default_factory=dict)  # calibrated activation / KV-cache scales by checkpoint name
    prequantized: PrequantizedFormat | None = None  # the target's own quantization, carried over
    moe_ep_size: int = 1  # expert-parallel groups of a mixture-of-experts target (moe_tp_size = tp / this)

    @property
    def layout(self) -> list[OutputTensor]:
        return checkpoint_layout(self.target, self.draft, self.moe_ep_size)

    def check_formats(self) -> None:
        """Refuse, before anything is read, weights the chosen formats cannot hold (NVFP4 blocks per rank)."""
        for out in self.layout:
            check_quantizable(out.name, out.shape, self.quant.format_of(out.name), self.tp_size)

    def entries(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        entries = {}
        for out in self.layout:
            entries.update(stored_entries(out, self.dtype, self.quant, self.scales, self.tp_size))
        return entries


def rank_tensors(
    plan: ConversionPlan, out: OutputTensor, readers: dict[str, HFCheckpointReader], rank: int, check_finite: bool
) -> dict[str, torch.Tensor]:
    """Exactly what rank `rank` stores for `out` (also what `verify` recomputes)."""
    carried = prequantized_input.carried_tensors(plan.prequantized, out, readers[TARGET])
    if carried is not None:
        kv_name = kv_scale_name(out)
        if kv_name is not None and plan.quant.kv_cache_dtype != FP8:
            carried.pop(kv_name, None)  # the KV cache was asked to stay unquantized
        elif kv_name is not None and kv_name not in carried:
            carried[kv_name] = plan.scales[kv_name]  # the checkpoint has no KV scales: calibrated ones
        return rank_pieces(out, carried, plan.tp_size, rank)
    by_name = {o.name: o for o in plan.layout}

    def load_partner(name: str) -> torch.Tensor:
        return _load_full(by_name[name], readers, check_finite=False)

    full = _load_full(out, readers, check_finite)
    return rank_stored(out, full, plan.dtype, plan.quant, plan.scales, plan.tp_size, rank, load_partner)


def _streamable(plan: ConversionPlan, out: OutputTensor, readers: dict[str, HFCheckpointReader]) -> bool:
    """Large tensors copied row range for row range (embedding, lm_head, mlp.fc/gate) are streamed in blocks."""
    if len(out.sources) != 1 or out.split not in (Split.REPLICATE, Split.ROWS, Split.VOCAB):
        return False
    if plan.quant.format_of(out.name) != NONE and quantized_linear(out.name) is not None:
        return False
    model, name = out.sources[0]
    return readers[model].nbytes(name) >= STREAM_MIN_BYTES


def _stores_cast(plan: ConversionPlan, out: OutputTensor) -> bool:
    """Stored as a cast of (a piece of) its sources: neither quantized here nor carried from a quantized target."""
    if quantized_linear(out.name) is None:
        return True
    return plan.quant.format_of(out.name) == NONE and plan.prequantized is None


def _source_tensors(
    out: OutputTensor, readers: dict[str, HFCheckpointReader]
) -> Iterator[tuple[str, str, torch.Tensor]]:
    for model, name in out.sources:
        yield model, name, readers[model].get(name)


def _streams_experts(plan: ConversionPlan, out: OutputTensor) -> bool:
    """Unquantized stacked experts are written expert by expert (never a whole layer in memory)."""
    return out.split in (Split.EXPERT_FC, Split.EXPERT_PROJ) and (
        plan.quant.format_of(out.name) == NONE or quantized_linear(out.name) is None
    )


def _expert_blocks(
    plan: ConversionPlan, out: OutputTensor, readers: dict[str, HFCheckpointReader], rank: int
) -> Iterator[torch.Tensor]:
    """This rank's slice of each of its experts, as `[1, rows, columns]` blocks of the stacked tensor.

    fc: the expert's up_proj rows, then its gate_proj rows, each cut to this rank's moe_tp slice (rows mapped only);
    proj: the expert's down_proj columns of this slice. Every rank checks its own slice for NaN/Inf."""
    reader, experts = readers[TARGET], out.experts or ExpertLayout(out.shape[0])
    group, index, count = experts.ranks(plan.tp_size, rank)
    per_expert = len(out.sources) // experts.num_experts
    for expert in experts.experts_of(group):
        pieces = []
        for _, name in out.sources[expert * per_expert : (expert + 1) * per_expert]:
            if out.split is Split.EXPERT_FC:
                rows = reader.shape(name)[0] // count
                piece = reader.get_rows(name, index * rows, (index + 1) * rows)
            else:
                piece = reader.get(name).chunk(count, dim=1)[index]
            pieces.append((TARGET, name, piece))
        stored = torch.cat([piece.to(plan.dtype) for _, _, piece in pieces], dim=0).unsqueeze(0)
        check_cast_finite(out, out.name, stored, pieces)
        yield stored


def _row_blocks(
    plan: ConversionPlan, out: OutputTensor, readers: dict[str, HFCheckpointReader], rank: int
) -> Iterator[torch.Tensor]:
    """This rank's rows of `out` in blocks of about STREAM_BLOCK_BYTES, each mapped, checked, cast and dropped."""
    model, name = out.sources[0]
    reader, rows = readers[model], out.shape[0]
    first, stop, padding = 0, rows, 0
    if plan.tp_size > 1 and out.split is Split.ROWS:
        first, stop = rank * rows // plan.tp_size, (rank + 1) * rows // plan.tp_size
    elif plan.tp_size > 1 and out.split is Split.VOCAB:
        per_rank = pad_vocab_size(rows, plan.tp_size) // plan.tp_size
        first, stop = min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)
        padding = per_rank - (stop - first)
    # Every row is checked by exactly one rank: replicated tensors by rank 0, split ones by their owner.
    check_finite = rank == 0 or out.split is not Split.REPLICATE
    step = max(1, STREAM_BLOCK_BYTES // max(1, reader.nbytes(name) // rows))
    for start in range(first, stop, step):
        block = reader.get_rows(name, start, min(start + step, stop))
        stored = block.to(out.dtype or plan.dtype)
        if check_finite:
            check_cast_finite(out, out.name, stored, [(model, name, block)])
        yield stored
    if padding:
        yield torch.zeros((padding, *out.shape[1:]), dtype=plan.dtype)


@dataclass(frozen=True)
class RankWritten:
    """One rank file as written: its tensor bytes and the sha256 of the whole file (for the integrity record)."""

    tensor_bytes: int
    sha256: str


def _write_rank(
    plan: ConversionPlan,
    path: Path,
    readers: dict[str, HFCheckpointReader],
    rank: int,
    progress: Callable[[int], object],
) -> RankWritten:
    """Rank `rank`'s file, hashed as it is written; made durable later, by the publish (one fsync per file)."""
    entries = plan.entries()
    written = 0
    writer = StreamingSafetensorsWriter(path, entries, metadata={"format": "pt"}, fsync=False, sha256=True)
    with writer:
        for out in plan.layout:
            streamed = (
                _expert_blocks(plan, out, readers, rank)
                if _streams_experts(plan, out)
                else _row_blocks(plan, out, readers, rank)
                if _streamable(plan, out, readers)
                else None
            )
            if streamed is not None:
                writer.write_rows(out.name, streamed)
                dtype, shape = entries[out.name]
                written += math.prod(shape) * dtype.itemsize
            elif _stores_cast(plan, out):
                # Each rank scans its own piece; a replicated tensor, the same on every rank, is scanned by rank 0.
                for name, piece in rank_tensors(plan, out, readers, rank, check_finite=False).items():
                    if rank == 0 or out.split is not Split.REPLICATE:
                        check_cast_finite(out, name, piece, _source_tensors(out, readers))
                    writer.write(name, piece)
                    written += piece.numel() * piece.element_size()
            else:
                for name, piece in rank_tensors(plan, out, readers, rank, check_finite=rank == 0).items():
                    check_stored_finite(out, name, piece)
                    writer.write(name, piece)
                    written += piece.numel() * piece.element_size()
            progress(1)
    return RankWritten(written, writer.hexdigest())


def check_written(staging: Path, plan: ConversionPlan) -> None:
    """Cheap self-check before publishing: every rank file reopens with exactly the planned names, shapes, dtypes."""
    entries = plan.entries()
    for rank in range(plan.tp_size):
        with SafetensorsFile(staging / rank_file(rank)) as written:
            if sorted(written.names()) != sorted(entries):
                raise DFlashTrtError(f"internal error: {rank_file(rank)} does not hold the planned tensors")
            for name, (dtype, shape) in entries.items():
                if written.shape(name) != shape or written.dtype(name) != dtype:
                    raise DFlashTrtError(f"internal error: {name} in {rank_file(rank)} was written wrongly")


def _link_roots(model_dir: Path) -> list[Path]:
    """Where a model folder's links may point: the folder itself and, for an HF hub snapshot
    (`models--org--name/snapshots/<revision>/`), its cache entry, whose `blobs/` hold the files."""
    folder = model_dir.absolute()
    roots = [folder.resolve()]
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        roots.append(folder.parent.parent.resolve())
    return roots


def tokenizer_files(model_dir: Path) -> dict[str, Path]:
    """The tokenizer files to copy, by name, each resolved through its links (an HF hub download is all links).

    A link leading out of the model folder and its hub cache entry is refused rather than followed: the copy would
    publish whatever file it names.
    """
    roots, found = _link_roots(model_dir), {}
    for name in TOKENIZER_FILES:
        source = model_dir / name
        if not os.path.lexists(source):
            continue
        real = source.resolve()
        if not any(real == root or root in real.parents for root in roots):
            raise DFlashTrtError(f"{source} links to {real}, outside the model folder and its HF cache entry")
        if not real.is_file():
            raise DFlashTrtError(f"{source} is not a regular file (a broken link, a folder or a device)")
        found[name] = real
    return found


def _copy_tokenizer_files(files: dict[str, Path], staging: Path) -> None:
    for name, source in files.items():
        shutil.copyfile(source, staging / name)


def _die_with_parent(parent_pid: int) -> None:
    """Worker initializer: the kernel kills this worker when the converting process dies (Linux), so a killed
    convert leaves no orphan writing into a staging folder nobody will publish."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # no prctl: not Linux
        pass
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def _worker_pool(workers: int) -> ProcessPoolExecutor:
    """Spawned (not forked) workers: a fork taken after torch started its OpenMP threads can deadlock in them."""
    return ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_die_with_parent,
        initargs=(os.getpid(),),
    )


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Kill the workers mid-rank. Their list is taken first: shutdown() forgets it, and a pool left to shut down
    by itself would wait for every running rank to finish."""
    processes = list((getattr(pool, "_processes", None) or {}).values())  # no public kill before Python 3.14
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.kill()


def _write_rank_in_worker(plan: ConversionPlan, path: Path, rank: int) -> RankWritten:
    """One rank file in its own process, with its own memory-mapped readers (memory stays one tensor per worker)."""
    with HFCheckpointReader(plan.model_dir) as target_reader, HFCheckpointReader(plan.dflash_model_dir) as draft_reader:
        return _write_rank(plan, path, {TARGET: target_reader, DRAFT: draft_reader}, rank, lambda _: None)


def _check_run_settings(pp_size: int, dtype: str, workers: int) -> None:
    if pp_size != 1:
        raise DFlashTrtError(
            f"--pp_size must be 1 (TensorRT-LLM speculative decoding engines need pp_size 1), got {pp_size}"
        )
    if dtype not in DTYPES:
        raise DFlashTrtError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if workers < 1:
        raise DFlashTrtError(f"--workers must be >= 1, got {workers}")


def _needs_calibration(
    quant: QuantSettings, prequantized: PrequantizedFormat | None, calib_dataset: str | Path | None
) -> bool:
    """Whether the conversion needs calibration prompts, refusing a dataset given where none is read."""
    # A pre-quantized target brings its own scales; the drafter's (and its KV cache's) always come from calibration.
    needs_calibration = (
        quant.dflash_qformat != NONE or (prequantized is None and quant.qformat != NONE) or quant.kv_cache_dtype == FP8
    )
    if needs_calibration and calib_dataset is None:
        raise DFlashTrtError("quantization needs --calib_dataset FILE.jsonl: its prompts set the activation scales")
    if calib_dataset is not None and not needs_calibration:
        raise DFlashTrtError(
            "--calib_dataset is only read when quantizing (--qformat, --dflash_qformat or "
            "--kv_cache_dtype fp8); drop it or choose a format"
        )
    return needs_calibration


def _write_ranks(
    plan: ConversionPlan, staging: Path, readers: dict, workers: int, show_progress: bool
) -> list[RankWritten]:
    """Every rank file: rank 0 here, the others here too or in `workers` processes."""
    tensors = len(plan.layout)
    with tqdm(total=tensors * plan.tp_size, desc="convert", unit="tensor", disable=not show_progress) as bar:
        # Rank 0 runs here first: it checks every replicated tensor for NaN/Inf, so bad input fails fast.
        ranks = [_write_rank(plan, staging / rank_file(0), readers, 0, bar.update)]
        if workers == 1 or plan.tp_size == 1:
            for rank in range(1, plan.tp_size):
                ranks.append(_write_rank(plan, staging / rank_file(rank), readers, rank, bar.update))
        else:
            with _worker_pool(min(workers, plan.tp_size - 1)) as pool:
                try:
                    jobs = [
                        pool.submit(_write_rank_in_worker, plan, staging / rank_file(rank), rank)
                        for rank in range(1, plan.tp_size)
                    ]
                    for job in jobs:
                        ranks.append(job.result())
                        bar.update(tensors)
                except BaseException:  # a refusal, Ctrl-C or SIGTERM: stop writing ranks nobody will publish
                    _stop_workers(pool)
                    raise
    return ranks


def _checkpoint_config(plan: ConversionPlan, dtype: str) -> dict:
    quant, tp_size = plan.quant, plan.tp_size
    return checkpoint_config(
        plan.target,
        plan.draft,
        dtype,
        tp_size,
        quant.config(draft=False),
        quant.config(draft=True),
        vocab_size_padded=pad_vocab_size(plan.target.vocab_size, tp_size),
        moe_ep_size=plan.moe_ep_size,
    )


def convert_checkpoint(
    model_dir: str | Path,
    dflash_model_dir: str | Path,
    output_dir: str | Path,
    dtype: str = "bfloat16",
    tp_size: int = 1,
    pp_size: int = 1,
    overwrite: bool = False,
    show_progress: bool = False,
    workers: int = 1,
    qformat: str = NONE,
    dflash_qformat: str | None = None,
    kv_cache_dtype: str | None = None,
    calib_dataset: str | Path | None = None,
    calib_size: int = 64,
    calib_max_seq_len: int | None = None,
    moe_ep_size: int = 1,
) -> ConversionResult:
    """Convert and publish atomically; raises DFlashTrtError (nothing written) on any bad input.

    `workers` > 1 writes that many rank files at once, each in its own process. Quantization (`qformat` of the
    target, `dflash_qformat` of the drafter, default: the target's; `kv_cache_dtype`) takes its activation and KV
    scales from a calibration run of the golden model over the prompts of `calib_dataset`. A mixture-of-experts
    target's experts split over `moe_ep_size` expert-parallel groups and tp / `moe_ep_size` slices of each.
    """
    _check_run_settings(pp_size, dtype, workers)
    quant, prequantized = resolve_quantization(model_dir, qformat, dflash_qformat, kv_cache_dtype)
    needs_calibration = _needs_calibration(quant, prequantized, calib_dataset)
    model_dir, dflash_model_dir, output_dir = Path(model_dir), Path(dflash_model_dir), Path(output_dir)
    inputs = {"--model_dir": model_dir, "--dflash_model_dir": dflash_model_dir, "--calib_dataset": calib_dataset}
    check_output_apart(output_dir, inputs)
    check_destination(output_dir.absolute(), overwrite, "convert")
    target = load_target_spec(model_dir)
    draft = load_draft_spec(dflash_model_dir, target)
    tokenizer = tokenizer_files(model_dir)
    cut = default_calib_max_seq_len(target.max_position_embeddings) if calib_max_seq_len is None else calib_max_seq_len
    if needs_calibration and calib_dataset is not None:
        check_calibration_prompts(model_dir, Path(calib_dataset), calib_size, cut, target.max_position_embeddings)
    check_parallel(target, draft, tp_size, moe_ep_size)
    plan = ConversionPlan(
        model_dir,
        dflash_model_dir,
        target,
        draft,
        torch_dtypes()[dtype],
        tp_size,
        quant,
        prequantized=prequantized,
        moe_ep_size=moe_ep_size,
    )
    plan.check_formats()
    config = _checkpoint_config(plan, dtype)
    with HFCheckpointReader(model_dir) as target_reader, HFCheckpointReader(dflash_model_dir) as draft_reader:
        check_sources(target, draft, target_reader, draft_reader, prequantized)
        readers = {TARGET: target_reader, DRAFT: draft_reader}
        scales = {}
        if needs_calibration and calib_dataset is not None:
            scales = calibrated_scales(
                model_dir,
                dflash_model_dir,
                output_dir.parent,
                dtype,
                quant,
                Path(calib_dataset),
                calib_size,
                cut,
                show_progress,
            )
        if prequantized is not None:
            scales.update(prequantized_input.carried_scales(prequantized, plan.layout, target_reader))
        plan = replace(plan, scales=scales)
        layout = plan.layout
        with atomic_directory(output_dir, "convert", overwrite, inputs) as staging:
            ranks = _write_ranks(plan, staging, readers, workers, show_progress)
            check_written(staging, plan)
            (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            _copy_tokenizer_files(tokenizer, staging)
            digests = {rank_file(rank): written.sha256 for rank, written in enumerate(ranks)}
            write_integrity_record(staging, ["config.json", *digests], digests)
    return ConversionResult(output_dir, tp_size, len(layout), sum(written.tensor_bytes for written in ranks))


def resolve_quantization(
    model_dir: str | Path, qformat: str, dflash_qformat: str | None, kv_cache_dtype: str | None
) -> tuple[QuantSettings, PrequantizedFormat | None]:
    """The formats a conversion will write (a pre-quantized target keeps its own) and the target's own format."""
    prequantized = read_hf_quant_config(model_dir)
    if prequantized is not None:
        return prequantized_input.quant_settings(prequantized, qformat, dflash_qformat, kv_cache_dtype), prequantized
    quant = QuantSettings(qformat, qformat if dflash_qformat is None else dflash_qformat, kv_cache_dtype or NONE)
    return quant, None


def default_calib_max_seq_len(max_positions: int) -> int:
    """512 tokens, or fewer where the target's positions must also hold the tokens decoded after the prompt."""
    from dflash_trt.conversion.calibrate import CALIBRATION_NEW_TOKENS

    return max(1, min(DEFAULT_CALIB_MAX_SEQ_LEN, max_positions - CALIBRATION_NEW_TOKENS))


def check_calibration_prompts(
    model_dir: Path, calib_dataset: Path, calib_size: int, calib_max_seq_len: int, max_positions: int
) -> None:
    """Read the calibration prompts before any work, so a bad file is reported as itself, not after a conversion
    and under the name of an internal scratch folder; each one, cut to `calib_max_seq_len` and decoded
    CALIBRATION_NEW_TOKENS further, must fit the target's positions."""
    from dflash_trt.conversion.calibrate import CALIBRATION_NEW_TOKENS
    from dflash_trt.prompts import read_prompts
    from dflash_trt.tokenizer import load_tokenizer

    if calib_size < 1 or calib_max_seq_len < 1:
        raise DFlashTrtError("--calib_size and --calib_max_seq_len must be >= 1.")
    if calib_max_seq_len > max_positions:
        raise DFlashTrtError(
            f"--calib_max_seq_len must be in [1, {max_positions}] (the target's max_position_embeddings), "
            f"got {calib_max_seq_len}"
        )
    prompts = read_prompts(calib_dataset, load_tokenizer(model_dir), limit=calib_size)
    longest = max(min(len(p), calib_max_seq_len) for p in prompts)
    if longest + CALIBRATION_NEW_TOKENS > max_positions:
        raise DFlashTrtError(
            f"a calibration prompt of {longest} tokens (cut at --calib_max_seq_len) plus the {CALIBRATION_NEW_TOKENS} "
            f"tokens decoded after it exceeds the target's max_position_embeddings ({max_positions}); give "
            f"--calib_max_seq_len {max_positions - CALIBRATION_NEW_TOKENS} or less"
        )


def check_parallel(target: TargetSpec, draft: DraftSpec, tp_size: int, moe_ep_size: int) -> None:
    """Refuse tp / moe_ep sizes TensorRT-LLM cannot split these models by (dense MLPs by tp, experts by both)."""
    has_dense_mlp = target.moe is None or len(target.moe.sparse_layers) < target.num_hidden_layers
    check_tp(target_heads(target), target.intermediate_size if has_dense_mlp else tp_size, tp_size, "target")
    check_tp(target_heads(draft), draft.intermediate_size, tp_size, "drafter")
    if target.moe is not None:
        check_moe_parallel(target.moe.num_experts, target.moe.intermediate_size, tp_size, moe_ep_size)
    elif moe_ep_size != 1:
        raise DFlashTrtError("--moe_ep_size applies to mixture-of-experts targets only")


def calibrated_scales(
    model_dir: Path,
    dflash_model_dir: Path,
    work_dir: Path,
    dtype: str,
    quant: QuantSettings,
    calib_dataset: Path,
    calib_size: int,
    calib_max_seq_len: int,
    show_progress: bool = False,
) -> dict[str, torch.Tensor]:
    """Activation and KV scales from the golden model of the unquantized conversion, run over calibration prompts."""
    from dflash_trt.conversion.calibrate import calibrate_checkpoint

    if not calib_dataset.exists():
        raise DFlashTrtError(f"calibration dataset {calib_dataset} does not exist")
    with scratch_directory(work_dir, "calibration") as scratch:
        plain = scratch / "checkpoint"  # a pre-quantized target keeps its weights in it; nothing else is
        convert_checkpoint(model_dir, dflash_model_dir, plain, dtype=dtype, dflash_qformat=NONE, kv_cache_dtype=NONE)
        return calibrate_checkpoint(
            plain, quant, calib_dataset, calib_size, calib_max_seq_len, show_progress=show_progress
        )
