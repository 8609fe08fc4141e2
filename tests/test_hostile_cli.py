"""Hostile command lines end to end, over every subcommand that writes: each is refused with exit 2 and one stderr
line, no traceback, and leaves every input and output byte for byte as it was (nothing published).

Calls run in-process through `dflash_trt.cli.main`; the inputs are real (the embedded tiny pair, its conversion, an
engine folder, a build profile, a sweep config).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from _hostile_cli import World, assert_refused, hub_snapshot, make_world, run_cli, snapshot
from safetensors.torch import load_file, save_file

from dflash_trt.checkpoint.integrity import INTEGRITY_FILE
from dflash_trt.tiny.heldout import asset_dir

Case = Callable[[World, Path], list[str]]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return make_world(tmp_path_factory.mktemp("hostile_cli"))


def _convert(w: World, out: Path, *extra: str) -> list[str]:
    return [
        "convert",
        "--model_dir",
        str(w.target),
        "--dflash_model_dir",
        str(w.draft),
        "--output_dir",
        str(out),
        *extra,
    ]


def _triton(w: World, out: Path, *extra: str) -> list[str]:
    return ["triton", "--engine_dir", str(w.engine), "--tokenizer_dir", str(w.target), "--output_dir", str(out), *extra]


def _alias(w: World, tmp: Path, to: Path) -> Path:
    link = tmp / "alias"
    link.symlink_to(to)
    return link


# Outputs that are, contain or lie inside an input: refused whatever the flags, without suggesting --overwrite.
OUTPUT_AMONG_INPUTS: dict[str, tuple[Case, str]] = {
    "convert into the target": (lambda w, t: _convert(w, w.target, "--overwrite"), r"is the input --model_dir"),
    "convert over the models' parent": (
        lambda w, t: _convert(w, w.target.parent, "--overwrite"),
        r"contains the input --model_dir",
    ),
    "convert inside the drafter": (lambda w, t: _convert(w, w.draft / "out"), r"lies inside the input --dflash"),
    "convert into a link to the target": (
        lambda w, t: _convert(w, _alias(w, t, w.target), "--overwrite"),
        r"is the input --model_dir",
    ),
    "convert over the hub cache's blobs": (
        lambda w, t: [
            "convert",
            "--model_dir",
            str(hub_snapshot(w.target, t / "hub")),
            "--dflash_model_dir",
            str(w.draft),
            "--output_dir",
            str(t / "hub" / "models--org--tiny" / "blobs"),
            "--overwrite",
        ],
        r"contains the input --model_dir .*\(really .*/blobs/",
    ),
    "convert beside calibration prompts": (
        lambda w, t: _convert(
            w, w.prompts.parent, "--overwrite", "--qformat", "fp8", "--calib_dataset", str(w.prompts)
        ),
        r"contains the input --calib_dataset",
    ),
    "triton into the tokenizer": (lambda w, t: _triton(w, w.target, "--overwrite"), r"is the input --tokenizer_dir"),
    "triton into the engine": (lambda w, t: _triton(w, w.engine, "--overwrite"), r"is the input --engine_dir"),
    "triton over the plugin library": (
        lambda w, t: _triton(w, w.plugin.parent, "--overwrite"),
        r"contains the input --plugin_library",
    ),
    "triton over its profile": (
        lambda w, t: [
            "triton",
            "--config",
            str(w.profile),
            "--tokenizer_dir",
            str(w.target),
            "--output_dir",
            str(w.profile.parent),
            "--overwrite",
        ],
        r"contains the input --config",
    ),
    "build into the checkpoint": (
        lambda w, t: [
            "build",
            "--checkpoint_dir",
            str(w.checkpoint),
            "--output_dir",
            str(w.checkpoint),
            "--overwrite",
            "--dry_run",
        ],
        r"is the input --checkpoint_dir",
    ),
    "build inside the checkpoint": (
        lambda w, t: ["build", "--checkpoint_dir", str(w.checkpoint), "--output_dir", str(w.checkpoint / "e")],
        r"lies inside the input --checkpoint_dir",
    ),
    "build workspace over the models": (
        lambda w, t: ["build", "--config", str(w.profile), "--output_dir", str(w.target.parent), "--dry_run"],
        r"contains the input the target model",
    ),
    "demo inside the embedded pair": (
        lambda w, t: ["demo", "--output_dir", str(asset_dir() / "out")],
        r"lies inside the input the embedded tiny pair",
    ),
    "sweep results over its dataset": (
        lambda w, t: ["sweep", "--config", str(w.sweep)],
        r"contains the input --config",
    ),
}


@pytest.mark.parametrize("case", list(OUTPUT_AMONG_INPUTS))
def test_output_among_the_inputs_is_refused(world: World, tmp_path: Path, capsys, case: str) -> None:
    make_argv, message = OUTPUT_AMONG_INPUTS[case]
    argv = make_argv(world, tmp_path)
    before = snapshot(world.root, asset_dir(), tmp_path)
    code, _, err = run_cli(argv, capsys)
    assert_refused(code, err, argv[0], message)
    assert "--overwrite" not in err
    assert snapshot(world.root, asset_dir(), tmp_path) == before


def test_the_same_commands_with_outputs_apart_succeed(world: World, tmp_path: Path, capsys) -> None:
    """The refusals above are about where the output is, not about the inputs themselves."""
    assert run_cli(_convert(world, tmp_path / "ckpt"), capsys)[0] == 0
    assert run_cli(_triton(world, tmp_path / "repo"), capsys)[0] == 0
    code, _, err = run_cli(
        ["build", "--checkpoint_dir", str(world.checkpoint), "--output_dir", str(tmp_path / "engine"), "--dry_run",
         "--max_seq_len", "128", "--max_input_len", "64"],
        capsys,
    )
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "repo"]


def _tampered(w: World, tmp: Path, edit: Callable[[Path], None], keep_record: bool = False) -> Path:
    copy = shutil.copytree(w.checkpoint, tmp / "ckpt")
    if not keep_record:
        (copy / INTEGRITY_FILE).unlink()  # whoever tampers can delete the record too
    edit(copy)
    return copy


def _edit_config(**changes) -> Callable[[Path], None]:
    def edit(ckpt: Path) -> None:
        config = json.loads((ckpt / "config.json").read_text())
        config.update(changes)
        (ckpt / "config.json").write_text(json.dumps(config))

    return edit


def _flip_byte(ckpt: Path) -> None:
    raw = bytearray((ckpt / "rank0.safetensors").read_bytes())
    raw[-1000] ^= 0x01
    (ckpt / "rank0.safetensors").write_bytes(bytes(raw))


def _nan_weight(ckpt: Path) -> None:
    tensors = load_file(ckpt / "rank0.safetensors")
    tensors["transformer.layers.2.mlp.proj.weight"][0, 0] = math.nan
    save_file(tensors, ckpt / "rank0.safetensors", metadata={"format": "pt"})


# Checkpoints changed after conversion: generate must refuse them, not decode garbage with exit 0.
TAMPERED: dict[str, tuple[Callable[[World, Path], Path], str]] = {
    "a byte flipped": (
        lambda w, t: _tampered(w, t, _flip_byte, keep_record=True),
        r"rank0\.safetensors changed after conversion",
    ),
    "config edited, record kept": (
        lambda w, t: _tampered(w, t, _edit_config(num_hidden_layers=4), keep_record=True),
        r"config\.json changed after conversion",
    ),
    "layer count edited down": (
        lambda w, t: _tampered(w, t, _edit_config(num_hidden_layers=4)),
        r"holds tensor 'transformer\.layers\.4\..*which its config\.json does not describe",
    ),
    "dtype edited": (
        lambda w, t: _tampered(w, t, _edit_config(dtype="float16")),
        r"is torch\.float32, but config\.json says torch\.float16",
    ),
    "NaN weight": (lambda w, t: _tampered(w, t, _nan_weight), r"'transformer\.layers\.2\.mlp\.proj\.weight' holds NaN"),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_generate_refuses_a_tampered_checkpoint(world: World, tmp_path: Path, capsys, case: str) -> None:
    make, message = TAMPERED[case]
    checkpoint = make(world, tmp_path)
    before = snapshot(world.root, tmp_path)
    code, out, err = run_cli(
        ["generate", "--checkpoint_dir", str(checkpoint), "--input_file", str(world.prompts)], capsys
    )
    assert_refused(code, err, "generate", message)
    assert out == ""
    assert snapshot(world.root, tmp_path) == before


def test_the_untampered_checkpoint_generates(world: World, capsys) -> None:
    code, out, err = run_cli(
        [
            "generate",
            "--checkpoint_dir",
            str(world.checkpoint),
            "--input_file",
            str(world.prompts),
            "--max_new_tokens",
            "4",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    assert len(json.loads(out)["sequences"]) == 2
