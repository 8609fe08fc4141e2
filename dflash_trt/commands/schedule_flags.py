"""`--draft_len_schedule` (with `--gpu` and `--acceptance_json` for `auto`) on the commands that build or run an
engine from a converted checkpoint: `build`, `emulate` and `generate` parse and resolve it the same way."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash_trt.analysis.gpus import GPUS
from dflash_trt.draft_schedule import AUTO, FIXED, DraftLenSchedule
from dflash_trt.errors import DFlashTrtError
from dflash_trt.inputs import DRAFT_LEN_SCHEDULE


def add_schedule_arguments(parser: argparse.ArgumentParser, default: str, gpu_flag: bool = True) -> None:
    """`gpu_flag` False: the command has its own `--gpu` (the GPU its engine is built for), which `auto` uses too."""
    parser.add_argument(
        "--draft_len_schedule",
        type=DRAFT_LEN_SCHEDULE,
        default=None,
        help="drafts each request verifies, by the step's load (with --draft_tree N: its node budget, up to "
        "block_size - 1 the chain of that many drafts, past it a tree of that many nodes): none (always "
        "block_size - 1, or N), N1:K1,N2:K2,... (with at least N requests in a step, verify K) or auto (derived for "
        "--gpu, the checkpoint's TP and formats and the acceptance in --acceptance_json or the stated assumption; "
        "`dflash-trt plan --draft_len_schedule auto` shows the table). "
        f"Default: {default}",
    )
    if gpu_flag:
        parser.add_argument(
            "--gpu", choices=sorted(GPUS), help="with --draft_len_schedule auto: the GPU it is derived for"
        )
    parser.add_argument(
        "--acceptance_json",
        help='with --draft_len_schedule auto: measured acceptance: {"histogram": [...]}, {"per_position": [...]} or '
        "a `generate --json` / `emulate --json` output",
    )


def schedule_for_checkpoint(
    args: argparse.Namespace, checkpoint_dir: Path, max_batch_size: int, gpu_flag: bool = True
) -> DraftLenSchedule:
    """The schedule a table or `none` names, or `auto` derived for this checkpoint (for the `--gpu` given, never an
    assumed one) and announced on stderr; `gpu_flag` as for `add_schedule_arguments`."""
    choice = FIXED if args.draft_len_schedule is None else args.draft_len_schedule
    if choice != AUTO:
        if args.gpu and gpu_flag:
            raise DFlashTrtError("--gpu only serves --draft_len_schedule auto")
        if args.acceptance_json:
            raise DFlashTrtError("--acceptance_json only serves --draft_len_schedule auto")
        assert isinstance(choice, DraftLenSchedule)
        return choice
    if args.gpu is None:
        raise DFlashTrtError(f"--draft_len_schedule auto prices each step on a GPU: give --gpu ({', '.join(GPUS)})")
    from dflash_trt.analysis.draft_schedule import checkpoint_schedule

    acceptance = Path(args.acceptance_json) if args.acceptance_json else None
    derived, source = checkpoint_schedule(checkpoint_dir, args.gpu, max_batch_size, acceptance, nodes=args.draft_tree)
    print(f"draft-length schedule {derived.schedule.text()} ({source})", file=sys.stderr)
    return derived.schedule
