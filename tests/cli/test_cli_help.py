"""`--help` answers at once (no torch import for the command list) and every option's help shows its default."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt.cli import COMMANDS, build_parser, main

REPO_ROOT = Path(__file__).resolve().parents[2]


# Packages that cost seconds to import (or are absent on a lean host); help must answer without them.
HEAVY_PACKAGES = ("torch", "transformers", "modelopt", "tritonclient", "numpy")


def _help_in_a_fresh_interpreter(argv: list[str], watched: tuple[str, ...]) -> tuple[list[str], str]:
    """The watched modules that printing `dflash-trt ARGV` imported, and the help text, from a new interpreter (the
    test process has long imported torch)."""
    script = (
        "import sys, contextlib, io\n"
        "from dflash_trt.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n"
        f"        main({argv!r})\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, exc.code\n"
        f"watched = {watched!r}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in watched or m.startswith(watched)))\n"
        "print(out.getvalue())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    imported, _, help_text = done.stdout.partition("\n")
    return ast.literal_eval(imported), help_text


def test_top_level_help_imports_neither_torch_nor_any_command() -> None:
    imported, help_text = _help_in_a_fresh_interpreter(
        ["--help"], (*HEAVY_PACKAGES, "pydantic", "dflash_trt.commands.")
    )
    assert imported == []
    for name in COMMANDS:
        assert f"\n    {name} " in help_text


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help_imports_no_heavy_package(command: str) -> None:
    imported, help_text = _help_in_a_fresh_interpreter([command, "--help"], HEAVY_PACKAGES)
    assert imported == []
    assert help_text.startswith(f"usage: dflash-trt {command} ")
    assert "options:" in help_text


def _command_parser(command: str) -> argparse.ArgumentParser:
    parser = build_parser([command])
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_with_a_default_shows_it(command: str) -> None:
    parser = _command_parser(command)
    formatter = parser._get_formatter()
    unshown = []
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            continue
        rendered = " ".join(formatter._format_action(action).split())
        if "default" not in rendered or str(action.default) not in rendered:
            unshown.append(f"{action.option_strings[0]} (default {action.default!r}): {rendered}")
    assert unshown == []


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["convert", "--help"], "weight dtype (default: bfloat16)"),
        (["generate", "--help"], "(default: 64)"),
        (["demo", "--help"], "workspace for the demo's outputs (default: demo_out)"),
    ],
)
def test_subcommand_help_shows_defaults(argv: list[str], shown: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_code:
        main(argv)
    assert exit_code.value.code == 0
    assert shown in " ".join(capsys.readouterr().out.split())


def test_an_unknown_command_is_one_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_code:
        main(["convrt", "--model_dir", "x"])
    assert exit_code.value.code == 2
    assert "invalid choice: 'convrt'" in capsys.readouterr().err


def test_a_bad_option_value_is_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exit_code:
        main(["convert", "--model_dir", "m", "--dflash_model_dir", "d", "--output_dir", "o", "--tp_size", "two"])
    err = capsys.readouterr().err
    assert exit_code.value.code == 2
    assert err == (
        "dflash-trt convert: error: argument --tp_size: must be an integer in [1, 1024], got 'two' "
        "(see dflash-trt convert --help)\n"
    )


def test_version_and_which_commands_need_a_gpu(capsys) -> None:
    from importlib import metadata

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"dflash-trt {metadata.version('dflash-trt')}"  # the installed release
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Needs a GPU host with TensorRT-LLM 1.2.x: build (except --dry_run), selftest" in help_text
