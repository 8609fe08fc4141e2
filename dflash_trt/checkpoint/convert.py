"""HF target + z-lab DFlash drafter → one TensorRT-LLM 1.2.x checkpoint (config.json + rank{N}.safetensors).

Tensors stream from memory-mapped sources to a header-first writer one at a time, so peak memory stays near the
largest single tensor; the output is staged beside its destination and renamed into place only once written and
checked, so a failure never leaves a half checkpoint behind.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_trt.checkpoint.atomic import atomic_directory, check_destination
from dflash_trt.checkpoint.hf_reader import HFCheckpointReader
from dflash_trt.checkpoint.layout import DRAFT, TARGET, OutputTensor, checkpoint_layout, target_heads
from dflash_trt.checkpoint.safetensors_io import SafetensorsFile, StreamingSafetensorsWriter, tensor_has_nonfinite
from dflash_trt.checkpoint.sharding import check_tp, pad_vocab_size, shard, sharded_shape
from dflash_trt.checkpoint.trtllm_config import checkpoint_config
from dflash_trt.errors import DFlashTrtError
from dflash_trt.spec import (
    DraftSpec,
    TargetSpec,
    check_tensor_shapes,
    draft_tensor_shapes,
    load_draft_spec,
    load_target_spec,
    target_tensor_shapes,
)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SOURCE_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
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
# Non-parameter buffers some exporters store; they carry no weights the engine needs.
IGNORED_SOURCE_SUFFIXES = (".rotary_emb.inv_freq",)


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
    target: TargetSpec, draft: DraftSpec, target_reader: HFCheckpointReader, draft_reader: HFCheckpointReader
) -> None:
    """Every tensor present with the shape its config promises, float-typed, nothing unexpected."""
    tied_extra = ("lm_head.weight",) if target.tie_word_embeddings else ()
    check_tensor_shapes(target_tensor_shapes(target), _source_shapes(target_reader), "target", tied_extra)
    check_tensor_shapes(draft_tensor_shapes(draft), _source_shapes(draft_reader), "drafter")
    for what, reader in (("target", target_reader), ("drafter", draft_reader)):
        for name in reader.names():
            if reader.dtype(name) not in SOURCE_FLOAT_DTYPES and not name.endswith(IGNORED_SOURCE_SUFFIXES):
                raise DFlashTrtError(
                    f"{what} tensor '{name}' has dtype {reader.dtype(name)}; expected float32, float16 or bfloat16 "
                    "weights (pre-quantized inputs are not supported by this converter)"
                )


def _load_full(out: OutputTensor, readers: dict[str, HFCheckpointReader], check_finite: bool) -> torch.Tensor:
    loaded = []
    for model, name in out.sources:
        tensor = readers[model].get(name)
        if check_finite and tensor_has_nonfinite(tensor):
            what = "target" if model == TARGET else "drafter"
            raise DFlashTrtError(f"{what} tensor '{name}' contains NaN or Inf values")
        loaded.append(tensor)
    return out.assemble(loaded)


def rank_tensor(
    out: OutputTensor, full: torch.Tensor, dtype: torch.dtype, tp_size: int, rank: int
) -> torch.Tensor:
    """The exact tensor rank `rank` stores for `out`: split first (views), then cast (copies only the piece)."""
    return shard(full, out.split, tp_size, rank, out.heads).to(dtype).contiguous()


def _write_rank(
    path: Path,
    layout: list[OutputTensor],
    readers: dict[str, HFCheckpointReader],
    dtype: torch.dtype,
    tp_size: int,
    rank: int,
    progress: Callable[[int], None],
) -> int:
    entries = {out.name: (dtype, sharded_shape(out.shape, out.split, tp_size, out.heads)) for out in layout}
    written = 0
    with StreamingSafetensorsWriter(path, entries, metadata={"format": "pt"}) as writer:
        for out in layout:
            piece = rank_tensor(out, _load_full(out, readers, check_finite=rank == 0), dtype, tp_size, rank)
            writer.write(out.name, piece)
            written += piece.numel() * piece.element_size()
            progress(1)
    return written


def check_written(staging: Path, layout: list[OutputTensor], dtype: torch.dtype, tp_size: int) -> None:
    """Cheap self-check before publishing: every rank file reopens with exactly the planned names, shapes, dtype."""
    for rank in range(tp_size):
        with SafetensorsFile(staging / rank_file(rank)) as written:
            if sorted(written.names()) != sorted(out.name for out in layout):
                raise DFlashTrtError(f"internal error: {rank_file(rank)} does not hold the planned tensors")
            for out in layout:
                expected = sharded_shape(out.shape, out.split, tp_size, out.heads)
                if written.shape(out.name) != expected or written.dtype(out.name) != dtype:
                    raise DFlashTrtError(f"internal error: {out.name} in {rank_file(rank)} was written wrongly")


def _copy_tokenizer_files(model_dir: Path, staging: Path) -> None:
    for name in TOKENIZER_FILES:
        source = model_dir / name
        if source.is_file() and not source.is_symlink():
            shutil.copyfile(source, staging / name)


def _write_rank_in_worker(
    model_dir: Path, dflash_model_dir: Path, path: Path, target: TargetSpec, draft: DraftSpec, dtype: torch.dtype,
    tp_size: int, rank: int,
) -> int:
    """One rank file in its own process, with its own memory-mapped readers (memory stays one tensor per worker)."""
    with HFCheckpointReader(model_dir) as target_reader, HFCheckpointReader(dflash_model_dir) as draft_reader:
        readers = {TARGET: target_reader, DRAFT: draft_reader}
        return _write_rank(path, checkpoint_layout(target, draft), readers, dtype, tp_size, rank, lambda _: None)


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
) -> ConversionResult:
    """Convert and publish atomically; raises DFlashTrtError (nothing written) on any bad input.

    `workers` > 1 writes that many rank files at once, each in its own process.
    """
    if pp_size != 1:
        raise DFlashTrtError("--pp_size > 1 is not supported: TensorRT-LLM speculative decoding engines need pp_size 1")
    if dtype not in TORCH_DTYPES:
        raise DFlashTrtError(f"--dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
    if workers < 1:
        raise DFlashTrtError(f"--workers must be >= 1, got {workers}")
    model_dir, dflash_model_dir, output_dir = Path(model_dir), Path(dflash_model_dir), Path(output_dir)
    check_destination(output_dir, overwrite)
    target = load_target_spec(model_dir)
    draft = load_draft_spec(dflash_model_dir, target)
    check_tp(target_heads(target), target.intermediate_size, tp_size, "target")
    check_tp(target_heads(draft), draft.intermediate_size, tp_size, "drafter")
    torch_dtype = TORCH_DTYPES[dtype]
    layout = checkpoint_layout(target, draft)
    padded_vocab = pad_vocab_size(target.vocab_size, tp_size)
    config = checkpoint_config(target, draft, dtype, tp_size, vocab_size_padded=padded_vocab)
    with HFCheckpointReader(model_dir) as target_reader, HFCheckpointReader(dflash_model_dir) as draft_reader:
        check_sources(target, draft, target_reader, draft_reader)
        readers = {TARGET: target_reader, DRAFT: draft_reader}
        with atomic_directory(output_dir, overwrite) as staging:
            with tqdm(total=len(layout) * tp_size, desc="convert", unit="tensor", disable=not show_progress) as bar:
                # Rank 0 runs here first: it alone checks every source for NaN/Inf, so bad input fails fast.
                bytes_written = _write_rank(staging / rank_file(0), layout, readers, torch_dtype, tp_size, 0,
                                            bar.update)
                if workers == 1 or tp_size == 1:
                    for rank in range(1, tp_size):
                        bytes_written += _write_rank(staging / rank_file(rank), layout, readers, torch_dtype, tp_size,
                                                     rank, bar.update)
                else:
                    with ProcessPoolExecutor(max_workers=min(workers, tp_size - 1)) as pool:
                        jobs = [pool.submit(_write_rank_in_worker, model_dir, dflash_model_dir,
                                            staging / rank_file(rank), target, draft, torch_dtype, tp_size, rank)
                                for rank in range(1, tp_size)]
                        for job in jobs:
                            bytes_written += job.result()
                            bar.update(len(layout))
            check_written(staging, layout, torch_dtype, tp_size)
            (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            _copy_tokenizer_files(model_dir, staging)
    return ConversionResult(output_dir, tp_size, len(layout), bytes_written)
