"""HF target + DFlash drafter (z-lab or speculators format) → one TensorRT-LLM 1.2.x checkpoint (config.json +
rank{N}.safetensors).

Tensors stream from memory-mapped sources to a header-first writer one at a time, so peak memory stays near the
largest single tensor; the output is staged beside its destination and renamed into place only once written and
checked, so a failure never leaves a half checkpoint behind.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import shutil
import signal
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from dflash_trt.checkpoint.atomic import atomic_directory, check_destination, check_output_apart, scratch_directory
from dflash_trt.checkpoint.draft_vocabulary import MAP_DTYPES, check_draft_vocabulary
from dflash_trt.checkpoint.hf_reader import HFCheckpointReader, open_drafter
from dflash_trt.checkpoint.integrity import write_integrity_record
from dflash_trt.checkpoint.layout import DRAFT, TARGET
from dflash_trt.checkpoint.safetensors_io import SafetensorsFile, readable_dtype
from dflash_trt.checkpoint.sharding import check_parallel, pad_vocab_size
from dflash_trt.checkpoint.stored import QuantSettings
from dflash_trt.checkpoint.trtllm_config import checkpoint_config
from dflash_trt.conversion.plan import ConversionPlan, rank_file
from dflash_trt.conversion.prequantized import PrequantizedFormat, read_hf_quant_config
from dflash_trt.conversion.rank_writer import RankWritten, write_rank_files
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import DTYPES, FP8, NONE
from dflash_trt.spec import (
    DraftSpec,
    TargetSpec,
    check_tensor_shapes,
    draft_optional_tensors,
    draft_tensor_shapes,
    load_draft_spec,
    load_target_spec,
    target_tensor_shapes,
)

if TYPE_CHECKING:
    import torch

SOURCE_FLOAT_DTYPES = ("F32", "F16", "BF16")  # safetensors names of the float types a source weight may have
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
        from dflash_trt.conversion import prequantized_input

        expected, scales = prequantized_input.source_expectations(target, prequantized, expected)
        extra += scales
        carried = set(scales) | prequantized_input.carried_weights(target)
    check_tensor_shapes(expected, _source_shapes(target_reader), "target", extra)
    draft_shapes = _source_shapes(draft_reader)
    optional = draft_optional_tensors(draft)
    present = {name: shape for name, shape in optional.items() if name in draft_shapes}
    check_tensor_shapes({**draft_tensor_shapes(draft), **present}, draft_shapes, "drafter", tuple(optional))
    for what, reader in (("target", target_reader), ("drafter", draft_reader)):
        for name in reader.names():
            if name in carried and what == "target" or name.endswith(IGNORED_SOURCE_SUFFIXES):
                continue
            dtype = reader.dtype_name(name)
            if what == "drafter" and name in MAP_DTYPES:
                if dtype != MAP_DTYPES[name]:
                    raise DFlashTrtError(
                        f"drafter tensor '{name}' has dtype {dtype} ({readable_dtype(dtype)}); expected "
                        f"{readable_dtype(MAP_DTYPES[name])}"
                    )
            elif dtype not in SOURCE_FLOAT_DTYPES:
                raise DFlashTrtError(
                    f"{what} tensor '{name}' has dtype {dtype} ({readable_dtype(dtype)}); expected float32, float16 or "
                    "bfloat16 weights (a pre-quantized target needs its hf_quant_config.json)"
                )
    check_draft_vocabulary(draft, draft_reader)


def check_written(staging: Path, plan: ConversionPlan) -> None:
    """Cheap self-check before publishing: every rank file reopens with exactly the planned names, shapes, dtypes."""
    entries = plan.entries()
    for rank in range(plan.tp_size):
        with SafetensorsFile(staging / rank_file(rank)) as written:
            if sorted(written.names()) != sorted(entries):
                raise DFlashTrtError(f"internal error: {rank_file(rank)} does not hold the planned tensors")
            for name, (dtype, shape) in entries.items():
                if written.shape(name) != shape or written.dtype_name(name) != dtype:
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


def _write_ranks_in_worker(plan: ConversionPlan, staging: Path, ranks: list[int]) -> dict[int, RankWritten]:
    """Some rank files in their own process, with its own readers (memory stays one tensor per worker)."""
    with HFCheckpointReader(plan.model_dir) as target_reader, open_drafter(plan.dflash_model_dir) as draft_reader:
        return write_rank_files(plan, staging, {TARGET: target_reader, DRAFT: draft_reader}, ranks, lambda _: None)


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


def _rank_groups(tp_size: int, workers: int) -> list[list[int]]:
    """The ranks split into `workers` runs of consecutive ranks (fewer if there are fewer ranks); rank 0 first."""
    count = min(workers, tp_size)
    return [list(range(tp_size))[group * tp_size // count : (group + 1) * tp_size // count] for group in range(count)]


def _write_ranks(
    plan: ConversionPlan, staging: Path, readers: dict, workers: int, show_progress: bool
) -> list[RankWritten]:
    """Every rank file: those of rank 0's group here, each other group in its own process at the same time."""
    tensors = len(plan.layout)
    here, *elsewhere = _rank_groups(plan.tp_size, workers)
    written: dict[int, RankWritten] = {}
    with tqdm(
        total=tensors * plan.tp_size, desc="convert", unit="tensor", disable=None if show_progress else True
    ) as bar:
        if not elsewhere:
            written = write_rank_files(plan, staging, readers, here, bar.update)
        else:
            with _worker_pool(len(elsewhere)) as pool:
                try:
                    jobs = [(group, pool.submit(_write_ranks_in_worker, plan, staging, group)) for group in elsewhere]
                    # Rank 0's group tests every replicated tensor for NaN/Inf: bad input fails here, and fast.
                    written = write_rank_files(plan, staging, readers, here, bar.update)
                    for group, job in jobs:
                        written |= job.result()
                        bar.update(tensors * len(group))
                except BaseException:  # a refusal, Ctrl-C or SIGTERM: stop writing ranks nobody will publish
                    _stop_workers(pool)
                    raise
    return [written[rank] for rank in range(plan.tp_size)]


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
    calibration = calib_dataset if needs_calibration else None
    cut = _calibration_cut(model_dir, calibration, calib_size, calib_max_seq_len, target)
    check_parallel(target, draft, tp_size, moe_ep_size)
    plan = ConversionPlan(
        model_dir,
        dflash_model_dir,
        target,
        draft,
        dtype,
        tp_size,
        quant,
        prequantized=prequantized,
        moe_ep_size=moe_ep_size,
    )
    plan.check_formats()
    config = _checkpoint_config(plan, dtype)
    with HFCheckpointReader(model_dir) as target_reader, open_drafter(dflash_model_dir) as draft_reader:
        check_sources(target, draft, target_reader, draft_reader, prequantized)
        readers = {TARGET: target_reader, DRAFT: draft_reader}
        scales = _conversion_scales(plan, target_reader, output_dir, calibration, calib_size, cut, show_progress)
        plan = replace(plan, scales=scales)
        layout = plan.layout
        with atomic_directory(output_dir, "convert", overwrite, inputs) as staging:
            ranks = _write_ranks(plan, staging, readers, workers, show_progress)
            check_written(staging, plan)
            (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            _copy_tokenizer_files(tokenizer, staging)
            digests = {rank_file(rank): written.digest for rank, written in enumerate(ranks)}
            write_integrity_record(staging, ["config.json", *digests], digests)
    return ConversionResult(output_dir, tp_size, len(layout), sum(written.tensor_bytes for written in ranks))


def _conversion_scales(
    plan: ConversionPlan,
    target_reader: HFCheckpointReader,
    output_dir: Path,
    calib_dataset: str | Path | None,
    calib_size: int,
    cut: int | None,
    show_progress: bool,
) -> dict[str, torch.Tensor]:
    """The activation and KV scales the plan stores: calibrated ones, and a pre-quantized target's own."""
    scales = {}
    if cut is not None and calib_dataset is not None:
        scales = calibrated_scales(
            plan.model_dir,
            plan.dflash_model_dir,
            output_dir.parent,
            plan.dtype,
            plan.quant,
            Path(calib_dataset),
            calib_size,
            cut,
            show_progress,
        )
    if plan.prequantized is not None:
        from dflash_trt.conversion import prequantized_input

        scales.update(prequantized_input.carried_scales(plan.prequantized, plan.layout, target_reader))
    return scales


def _calibration_cut(
    model_dir: Path,
    calib_dataset: str | Path | None,
    calib_size: int,
    calib_max_seq_len: int | None,
    target: TargetSpec,
) -> int | None:
    """The prompt tokens calibration keeps, its prompts checked first; None without calibration (the default comes
    from the calibration module, and so torch: a conversion that does not calibrate never imports it)."""
    if calib_dataset is None:
        return None
    cut = default_calib_max_seq_len(target.max_position_embeddings) if calib_max_seq_len is None else calib_max_seq_len
    check_calibration_prompts(model_dir, Path(calib_dataset), calib_size, cut, target.max_position_embeddings)
    return cut


def resolve_quantization(
    model_dir: str | Path, qformat: str, dflash_qformat: str | None, kv_cache_dtype: str | None
) -> tuple[QuantSettings, PrequantizedFormat | None]:
    """The formats a conversion will write (a pre-quantized target keeps its own) and the target's own format."""
    prequantized = read_hf_quant_config(model_dir)
    if prequantized is not None:
        from dflash_trt.conversion import prequantized_input

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
