"""`dflash-trt` entry point: one subcommand per module in `dflash_trt.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

from dflash_trt.errors import DFlashTrtError

# Each name is a module in dflash_trt.commands exposing `register(subparsers)`.
COMMANDS = ["convert", "verify", "generate", "build", "selftest", "triton", "sweep", "plan", "demo", "emulate"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-trt",
        description="Convert, check and run DFlash speculative decoding for TensorRT-LLM 1.2.x engines.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"dflash_trt.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DFlashTrtError as exc:
        print(f"dflash-trt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dflash-trt {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
