"""`dflash-trt convert`: HF target + DFlash drafter (z-lab or speculators format) → one TensorRT-LLM 1.2.x checkpoint.

Flags follow TensorRT-LLM's `convert_checkpoint.py` (`--model_dir`, `--dflash_model_dir` like EAGLE's
`--eagle_model_dir`, `--output_dir`, `--dtype`, `--tp_size`, `--pp_size`).
"""

from __future__ import annotations

import argparse
import sys
import time

from dflash_trt.formats import DTYPES, KV_CACHE_DTYPES, NONE, QFORMATS
from dflash_trt.inputs import GPUS, POSITIVE_INT, WORKERS, IntRange
from dflash_trt.jsonfile import strict_json


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model_dir", required=True, help="HF target model directory (Qwen3, Qwen3-MoE or Llama 3.x)")
    parser.add_argument(
        "--dflash_model_dir", required=True, help="DFlash or DFlash2 drafter directory (z-lab or speculators format)"
    )
    parser.add_argument("--output_dir", required=True, help="TensorRT-LLM checkpoint directory to create")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="weight dtype")
    parser.add_argument("--tp_size", type=GPUS, default=1, help="tensor-parallel ranks (default 1)")
    parser.add_argument(
        "--pp_size",
        type=IntRange(1, 1),
        default=1,
        help="pipeline-parallel ranks: 1 (TensorRT-LLM's speculative decoding engines need pp_size 1)",
    )
    parser.add_argument(
        "--moe_ep_size",
        type=GPUS,
        default=1,
        help="expert-parallel groups of a MoE target; each expert splits over tp / this (default 1)",
    )
    parser.add_argument(
        "--workers",
        type=WORKERS,
        default=1,
        help="processes writing rank files at once, each a run of consecutive ranks (default 1: one process writes "
        "every rank file in one pass)",
    )
    parser.add_argument("--qformat", choices=QFORMATS, default=NONE, help="target weights: fp8 (Hopper) or nvfp4")
    parser.add_argument("--dflash_qformat", choices=QFORMATS, default=None, help="drafter weights (default: --qformat)")
    parser.add_argument(
        "--kv_cache_dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="fp8: FP8 KV cache (default: a pre-quantized target's, else none)",
    )
    parser.add_argument(
        "--calib_dataset",
        default=None,
        help="calibration prompts: jsonl ({'text'} or {'input_ids'} per line) or a local HF datasets "
        "folder with a text or input_ids column",
    )
    parser.add_argument("--calib_size", type=POSITIVE_INT, default=64, help="calibration prompts used (default 64)")
    parser.add_argument(
        "--calib_max_seq_len",
        type=POSITIVE_INT,
        default=None,
        help="calibration prompt tokens kept, at most the target's max_position_embeddings (default: 512, or "
        "fewer where the target's positions must also hold the 32 tokens decoded after each prompt)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an --output_dir an earlier dflash-trt convert wrote"
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert a target + DFlash drafter into one TensorRT-LLM checkpoint", description=__doc__
    )
    add_convert_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dflash_trt.conversion.convert import convert_checkpoint, resolve_quantization

    started = time.perf_counter()
    quant, _ = resolve_quantization(args.model_dir, args.qformat, args.dflash_qformat, args.kv_cache_dtype)
    if quant.qformat != quant.dflash_qformat:
        print(
            f"dflash-trt convert: warning: target weights {quant.qformat} but drafter weights "
            f"{quant.dflash_qformat}: `dflash-trt build` will refuse this checkpoint (one engine quantizes both "
            "alike); verify and generate can still use it",
            file=sys.stderr,
        )
    result = convert_checkpoint(
        args.model_dir,
        args.dflash_model_dir,
        args.output_dir,
        dtype=args.dtype,
        tp_size=args.tp_size,
        pp_size=args.pp_size,
        overwrite=args.overwrite,
        workers=args.workers,
        qformat=args.qformat,
        dflash_qformat=args.dflash_qformat,
        kv_cache_dtype=args.kv_cache_dtype,
        calib_dataset=args.calib_dataset,
        calib_size=args.calib_size,
        calib_max_seq_len=args.calib_max_seq_len,
        moe_ep_size=args.moe_ep_size,
        show_progress=sys.stderr.isatty(),
    )
    summary = {
        "output_dir": str(result.output_dir),
        "tp_size": result.tp_size,
        "tensors_per_rank": result.num_tensors,
        "bytes_written": result.bytes_written,
        "seconds": round(time.perf_counter() - started, 3),
    }
    if args.json:
        print(strict_json(summary))
    else:
        print(
            f"wrote {result.output_dir} ({result.tp_size} rank file(s), {result.bytes_written / 2**20:.1f} MiB) "
            f"in {summary['seconds']} s"
        )
    return 0
