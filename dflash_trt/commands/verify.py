"""`dflash-trt verify`: re-read a converted checkpoint and check config and every tensor against the sources."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify", help="check a converted checkpoint against its HF / DFlash sources", description=__doc__
    )
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--model_dir", required=True, help="HF target the checkpoint was converted from")
    parser.add_argument("--dflash_model_dir", required=True, help="DFlash drafter the checkpoint was converted from")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dflash_trt.conversion.verify import verify_checkpoint

    report = verify_checkpoint(args.checkpoint_dir, args.model_dir, args.dflash_model_dir)
    print(json.dumps(report.to_dict()) if args.json else report.verdict())
    return 0 if report.ok else 1
