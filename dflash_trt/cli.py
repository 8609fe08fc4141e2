"""`dflash-trt` entry point: one subcommand per module in `dflash_trt.commands`."""

from __future__ import annotations

import argparse
import ast
import importlib
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from dflash_trt import __version__
from dflash_trt.errors import DFlashTrtError

# Each name is a module in dflash_trt.commands exposing `register(subparsers)`.
COMMANDS = ["convert", "verify", "generate", "build", "selftest", "triton", "bench", "sweep", "plan", "demo", "emulate"]

GPU_EPILOG = (
    "Needs a GPU host with TensorRT-LLM 1.2.x: build (except --dry_run), selftest, and bench / sweep on an engine "
    "(--engine_dir). Every other command, and bench / sweep on a converted checkpoint, runs on a CPU."
)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so it unwinds (and cleans up) exactly as Ctrl-C does."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def _worth_showing(default: object) -> bool:
    """Not for flags (False), options without a default (None) or suppressed ones; 0 is a real default."""
    return default is not None and default is not False and default != argparse.SUPPRESS


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it has none worth showing or already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text or not _worth_showing(action.default) or not action.option_strings:
            return help_text
        return f"{help_text} (default: %(default)s)"


class RawDescriptionHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """HelpFormatter for a description laid out by hand (a usage block keeps its line breaks)."""


class CommandParser(argparse.ArgumentParser):
    def __init__(self, **kwargs) -> None:
        if kwargs.get("formatter_class") is argparse.RawDescriptionHelpFormatter:
            kwargs["formatter_class"] = RawDescriptionHelpFormatter  # a hand-laid description, defaults still shown
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(**kwargs)

    def error(self, message: str) -> NoReturn:
        """One line, like every other refusal (the usage is one `--help` away)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        """An option given without help still shows its default."""
        if kwargs.get("help") is None and _worth_showing(kwargs.get("default")) and args[0].startswith("-"):
            kwargs["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kwargs)


def _summary(name: str) -> str:
    """The first sentence of a command module's docstring, read without importing the module (and torch)."""
    source = Path(__file__).with_name("commands") / f"{name}.py"
    doc = ast.get_docstring(ast.parse(source.read_text(encoding="utf-8"))) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    return first.split(": ", 1)[1] if first.startswith("`") and ": " in first else first


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The full parser; given `argv`, only the command it names is imported (the others are listed by name), so
    `dflash-trt --help` and every other command's work skip the imports of commands not run."""
    parser = argparse.ArgumentParser(
        prog="dflash-trt",
        description="Convert, check and run DFlash speculative decoding for TensorRT-LLM 1.2.x engines.",
        epilog=GPU_EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"dflash-trt {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    chosen = None if argv is None else next((arg for arg in argv if not arg.startswith("-")), "")
    for name in COMMANDS:
        if chosen is None or name == chosen:
            importlib.import_module(f"dflash_trt.commands.{name}").register(subparsers)
        else:
            subparsers.add_parser(name, help=_summary(name), add_help=False)
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
        print(
            f"dflash-trt {args.command}: error: out of memory; ask for less (fewer or shorter prompts, fewer "
            "new tokens, a smaller model)",
            file=sys.stderr,
        )
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _run(args)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
