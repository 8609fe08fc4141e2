"""`dflash-trt verify`: re-read a converted checkpoint and check config and every tensor against the sources."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash_trt.errors import DFlashTrtError
from dflash_trt.inputs import POSITIVE_INT
from dflash_trt.jsonfile import strict_json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify", help="check a converted checkpoint against its HF / DFlash sources", description=__doc__
    )
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--model_dir", required=True, help="HF target the checkpoint was converted from")
    parser.add_argument("--dflash_model_dir", required=True, help="DFlash drafter the checkpoint was converted from")
    parser.add_argument(
        "--calib_dataset",
        default=None,
        help="the prompts the checkpoint was calibrated on: rerun calibration and compare every calibrated scale "
        "bit for bit (without it they are only checked to be finite and positive)",
    )
    parser.add_argument("--calib_size", type=POSITIVE_INT, default=64, help="as given to convert")
    parser.add_argument("--calib_max_seq_len", type=POSITIVE_INT, default=512, help="as given to convert")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dflash_trt.conversion.verify import Calibration, verify_checkpoint

    calibration = None
    if args.calib_dataset is not None:
        if not Path(args.calib_dataset).exists():
            raise DFlashTrtError(f"--calib_dataset {args.calib_dataset} does not exist")
        calibration = Calibration(Path(args.calib_dataset), args.calib_size, args.calib_max_seq_len)
    report = verify_checkpoint(args.checkpoint_dir, args.model_dir, args.dflash_model_dir, calibration)
    print(strict_json(report.to_dict()) if args.json else report.verdict())
    return 0 if report.ok else 1
