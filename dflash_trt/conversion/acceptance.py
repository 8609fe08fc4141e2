"""Acceptance report: how quantizing the target, the drafter and the KV cache changes DFlash acceptance.

For every target format × drafter format in {none, fp8, nvfp4}² and KV cache in {none, fp8}, the golden model
of the converted pair runs quantized as the engine would (`calibrate.quantized_model`, scales calibrated in the
decoding loop on `--calib_dataset`, the drafter on the quantized target's features) and decodes the prompts;
the report gives the mean acceptance length (tokens per target step, bonus included) and the fraction of
sequences whose output is still the unquantized pair's.

    python -m dflash_trt.conversion.acceptance [--model_dir T --dflash_model_dir D --calib_dataset FILE.jsonl]
        [--prompts FILE.jsonl] [--limit N] [--calib_size 32] [--max_new_tokens 64] [--dtype bfloat16] [--json]

Defaults are the embedded tiny pair, its held-out prompts, and calibration prompts from its corpus's training
split (never the held-out ones).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_trt.conversion.calibrate import CALIBRATION_NEW_TOKENS, calibrate_pair, quantized_model
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import FP8, NONE, NVFP4
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.stats import mean_acceptance_length

WEIGHT_FORMATS = (NONE, FP8, NVFP4)
KV_FORMATS = (NONE, FP8)


@dataclass(frozen=True)
class AcceptanceRow:
    target: str
    drafter: str
    kv_cache: str
    mean_acceptance_length: float
    same_output_as_unquantized: float


def acceptance_table(
    model,
    calib_prompts: list[list[int]],
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
) -> list[AcceptanceRow]:
    """One row per (target, drafter, KV cache) format, the unquantized pair first."""

    def decode():
        return speculative_generate(model, prompts, max_new_tokens, stop_token_ids)

    baseline = decode()
    rows = []
    for kv in KV_FORMATS:
        for target in WEIGHT_FORMATS:
            amax = calibrate_pair(model, calib_prompts, CALIBRATION_NEW_TOKENS, target, kv)
            for drafter in WEIGHT_FORMATS:
                with quantized_model(model, target, drafter, kv, amax):
                    results = decode()
                same = sum(a.output_ids == b.output_ids for a, b in zip(results, baseline, strict=True))
                rows.append(
                    AcceptanceRow(
                        target, drafter, kv, round(mean_acceptance_length(results), 4), round(same / len(prompts), 4)
                    )
                )
    return rows


def markdown(rows: list[AcceptanceRow]) -> str:
    lines = [
        "| target | drafter | KV cache | mean acceptance length | same output as unquantized |",
        "|---|---|---|---|---|",
    ]
    label = {NONE: "bf16", FP8: "fp8", NVFP4: "nvfp4"}
    for r in rows:
        lines.append(
            f"| {label[r.target]} | {label[r.drafter]} | {label[r.kv_cache]} | "
            f"{r.mean_acceptance_length:.2f} | {r.same_output_as_unquantized:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from dflash_trt.conversion.convert import convert_checkpoint
    from dflash_trt.prompts import read_prompts
    from dflash_trt.reference.model import load_golden_model
    from dflash_trt.tiny.corpus import generate as generate_problems
    from dflash_trt.tiny.heldout import asset_dir, draft_dir, target_dir
    from dflash_trt.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", type=Path, default=None, help="HF target (default: the tiny pair's)")
    parser.add_argument("--dflash_model_dir", type=Path, default=None, help="DFlash drafter (default: tiny pair's)")
    parser.add_argument("--prompts", type=Path, default=None, help="jsonl prompts (default: tiny pair held-out)")
    parser.add_argument(
        "--calib_dataset",
        type=Path,
        default=None,
        help="jsonl calibration prompts (default for the tiny pair: its training split)",
    )
    parser.add_argument("--calib_size", type=int, default=32)
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N prompts only")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", help="checkpoint dtype the formats quantize from")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)

    tiny = args.model_dir is None and args.dflash_model_dir is None
    if not tiny and args.calib_dataset is None:
        raise DFlashTrtError("--calib_dataset is required with --model_dir / --dflash_model_dir")
    model_dir = args.model_dir or target_dir()
    draft = args.dflash_model_dir or draft_dir()
    tokenizer = load_tokenizer(model_dir)
    prompts = read_prompts(args.prompts or asset_dir() / "heldout.jsonl", tokenizer, limit=args.limit)
    if args.calib_dataset is not None:
        calib = read_prompts(args.calib_dataset, tokenizer, limit=args.calib_size)
    else:
        calib = [tokenizer.encode(p.prompt) for p in generate_problems(seed=2024, count=args.calib_size, heldout=False)]
    with tempfile.TemporaryDirectory(prefix="dflash-acceptance-") as tmp:
        convert_checkpoint(model_dir, draft, Path(tmp) / "ckpt", dtype=args.dtype)
        model = load_golden_model(Path(tmp) / "ckpt")
    rows = acceptance_table(model, calib, prompts, args.max_new_tokens, list(model.target.spec.eos_token_ids))
    if args.json:
        print(
            json.dumps(
                {
                    "prompts": len(prompts),
                    "max_new_tokens": args.max_new_tokens,
                    "dtype": args.dtype,
                    "rows": [asdict(r) for r in rows],
                }
            )
        )
    else:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
