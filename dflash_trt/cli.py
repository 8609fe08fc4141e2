"""`dflash-trt` entry point: one subcommand per module in `dflash_trt.commands`."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

from dflash_trt.errors import DFlashTrtError

# Each name is a module in dflash_trt.commands exposing `register(subparsers)`.
COMMANDS = ["convert", "verify", "generate", "build", "selftest", "triton", "sweep", "plan", "demo"]


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so it unwinds (and cleans up) exactly as Ctrl-C does."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-trt",
        description="Convert, check and run DFlash speculative decoding for TensorRT-LLM 1.2.x engines.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"dflash_trt.commands.{name}").register(subparsers)
    return parser


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except DFlashTrtError as exc:
        message = " ".join(str(exc).splitlines())  # one line, whatever a library's text held
        print(f"dflash-trt {args.command}: error: {message}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"dflash-trt {args.command}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"dflash-trt {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # the file system said no (permissions, a full disk, a file where a folder must be)
        where = f": {exc.filename}" if exc.filename else ""
        print(f"dflash-trt {args.command}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"dflash-trt {args.command}: error: out of memory; ask for less (fewer or shorter prompts, fewer "
              "new tokens, a smaller model)", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _run(args)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
