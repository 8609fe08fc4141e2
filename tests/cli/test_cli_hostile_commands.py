"""Hostile command lines end to end, over every subcommand that writes: each is refused with exit 2 and one stderr
line, no traceback, and leaves every input and output byte for byte as it was (nothing published).

Calls run in-process through `dflash_trt.cli.main`; the inputs are real (the embedded tiny pair, its conversion, an
engine folder, a build profile, a sweep config).
"""

from __future__ import annotations

import errno
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
    "selftest inside the embedded pair": (
        lambda w, t: ["selftest", "--output_dir", str(asset_dir() / "target")],
        r"is the input the embedded tiny pair|lies inside the input the embedded",
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
        [
            "build",
            "--checkpoint_dir",
            str(world.checkpoint),
            "--output_dir",
            str(tmp_path / "engine"),
            "--dry_run",
            "--max_seq_len",
            "128",
            "--max_input_len",
            "64",
        ],
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
    "hidden size edited": (
        lambda w, t: _tampered(w, t, _edit_config(hidden_size=96)),
        r"'dflash\.fc\.weight' has shape \(128, 256\), but config\.json implies \(96, 192\)",
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


def test_build_refuses_a_checkpoint_changed_after_conversion(world: World, tmp_path: Path, capsys) -> None:
    """Checked before anything else of the build (here: before finding no TensorRT-LLM)."""
    checkpoint = _tampered(world, tmp_path, _flip_byte, keep_record=True)
    before = snapshot(world.root, tmp_path)
    argv = [
        "build",
        "--checkpoint_dir",
        str(checkpoint),
        "--output_dir",
        str(tmp_path / "engine"),
        "--max_seq_len",
        "128",
        "--max_input_len",
        "64",
    ]
    code, _, err = run_cli(argv, capsys)
    assert_refused(code, err, "build", r"rank0\.safetensors changed after conversion")
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


def _models_with(w: World, tmp: Path, which: str, **changes) -> tuple[Path, Path]:
    """Copies of the target and drafter, `which` one's config.json updated with `changes`."""
    target, draft = shutil.copytree(w.target, tmp / "target"), shutil.copytree(w.draft, tmp / "draft")
    path = (target if which == "target" else draft) / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return target, draft


def _convert_models(models: tuple[Path, Path], out: Path, *extra: str) -> list[str]:
    return [
        "convert",
        "--model_dir",
        str(models[0]),
        "--dflash_model_dir",
        str(models[1]),
        "--output_dir",
        str(out),
        *extra,
    ]


def _config_text(w: World, tmp: Path, which: str, name: str, text: str) -> tuple[Path, Path]:
    target, draft = _models_with(w, tmp, which)
    ((target if which == "target" else draft) / name).write_text(text)
    return target, draft


def _file(tmp: Path, name: str, data: bytes | str) -> Path:
    path = tmp / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def _profile_for(w: World, tmp: Path, models: tuple[Path, Path]) -> Path:
    """The world's build profile, pointed at other model folders."""
    text = w.profile.read_text().replace(str(w.target), str(models[0])).replace(str(w.draft), str(models[1]))
    return _file(tmp, "profile.yaml", text)


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


def _fp16_overflow(w: World, tmp: Path) -> tuple[Path, Path]:
    target, draft = _models_with(w, tmp, "target")
    tensors = load_file(target / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = 1e6
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target, draft


def _escaping_tokenizer(w: World, tmp: Path) -> tuple[Path, Path]:
    target, draft = _models_with(w, tmp, "target")
    (target / "tokenizer.json").unlink()
    (target / "tokenizer.json").symlink_to(_file(tmp, "elsewhere.json", "{}"))
    return target, draft


def _generate(w: World, *extra: str, prompts: Path | None = None) -> list[str]:
    return ["generate", "--checkpoint_dir", str(w.checkpoint), "--input_file", str(prompts or w.prompts), *extra]


def _generate_with(w: World, tmp: Path, name: str, text: str) -> list[str]:
    """generate on a copy of the checkpoint whose file `name` holds `text`."""
    checkpoint = shutil.copytree(w.checkpoint, tmp / "ckpt")
    (checkpoint / name).write_text(text)
    (checkpoint / "evil.py").write_text(f"open({str(tmp / 'code-ran')!r}, 'w')\n")
    return ["generate", "--checkpoint_dir", str(checkpoint), "--input_file", str(w.prompts)]


UNWRITABLE = Path("/sys/dflash-hostile/out")  # sysfs refuses new folders even to root
NESTED = "[" * 100_000 + "]" * 100_000
FP8 = ("--qformat", "fp8")

# Hostile files, values and places, one per case: every one must be refused before anything is published.
HOSTILE: dict[str, tuple[Case, str]] = {
    # convert: the output place
    "convert onto a file": (lambda w, t: _convert(w, _file(t, "f", "x")), r"exists and is not a directory"),
    "convert under a file": (lambda w, t: _convert(w, _file(t, "f", "x") / "ckpt"), r"cannot create output .*ckpt"),
    "convert where nothing may be written": (lambda w, t: _convert(w, UNWRITABLE), r"cannot create output"),
    # convert: the models' configs
    "tie_word_embeddings as a string": (
        lambda w, t: _convert_models(_models_with(w, t, "target", tie_word_embeddings="false"), t / "o"),
        r"'tie_word_embeddings' must be true or false, got 'false'",
    ),
    "drafter attention_bias as a string": (
        lambda w, t: _convert_models(_models_with(w, t, "draft", attention_bias="false"), t / "o"),
        r"drafter config: 'attention_bias' must be true or false",
    ),
    "NaN rms_norm_eps": (
        lambda w, t: _convert_models(_models_with(w, t, "target", rms_norm_eps=math.nan), t / "o"),
        r"'rms_norm_eps' must be a finite number > 0, got nan",
    ),
    "negative rms_norm_eps": (
        lambda w, t: _convert_models(_models_with(w, t, "draft", rms_norm_eps=-1.0), t / "o"),
        r"'rms_norm_eps' must be a finite number > 0",
    ),
    "rope_theta 0": (
        lambda w, t: _convert_models(_models_with(w, t, "target", rope_parameters={"rope_theta": 0}), t / "o"),
        r"'rope_theta' must be a finite number > 0, got 0",
    ),
    "architectures as a string": (
        lambda w, t: _convert_models(_models_with(w, t, "target", architectures="Qwen3ForCausalLM"), t / "o"),
        r"'architectures' must be a list of names, got 'Qwen3ForCausalLM'",
    ),
    "drafter vocab_size as a string": (
        lambda w, t: _convert_models(_models_with(w, t, "draft", vocab_size="128"), t / "o"),
        r"'vocab_size' must be an integer >= 1 and <= 16777216, got '128'",
    ),
    "rope_parameters a list": (
        lambda w, t: _convert_models(_models_with(w, t, "target", rope_parameters=[1, 2]), t / "o"),
        r"rope_parameters / rope_scaling must be objects",
    ),
    "config.json nested absurdly": (
        lambda w, t: _convert_models(_config_text(w, t, "target", "config.json", NESTED), t / "o"),
        r"config\.json is nested too deeply",
    ),
    "generation_config.json a list": (
        lambda w, t: _convert_models(_config_text(w, t, "target", "generation_config.json", "[1]"), t / "o"),
        r"generation_config\.json must hold a JSON object",
    ),
    "generation_config.json with a string eos": (
        lambda w, t: _convert_models(
            _config_text(w, t, "target", "generation_config.json", '{"eos_token_id": "0"}'), t / "o"
        ),
        r"eos_token_id must be a token id or a list of them, got '0'",
    ),
    "config.json not UTF-8": (
        lambda w, t: _convert_models(
            _config_text(w, t, "draft", "config.json", "{\udcff}".encode("utf-8", "surrogateescape").decode("latin-1")),
            t / "o",
        ),
        r"config\.json is not valid JSON",
    ),
    "a model folder that is a file": (
        lambda w, t: [
            "convert",
            "--model_dir",
            str(_file(t, "m", "x")),
            "--dflash_model_dir",
            str(w.draft),
            "--output_dir",
            str(t / "o"),
        ],
        r"has no config\.json|is not a directory",
    ),
    "a weight beyond float16": (
        lambda w, t: _convert_models(_fp16_overflow(w, t), t / "o", "--dtype", "float16"),
        r"'model\.layers\.1\.mlp\.up_proj\.weight' does not fit float16",
    ),
    "a tokenizer link leaving the model folder": (
        lambda w, t: _convert_models(_escaping_tokenizer(w, t), t / "o"),
        r"tokenizer\.json links to .*elsewhere\.json, outside",
    ),
    # convert: calibration prompts, checked before any work
    "calibration prompts not UTF-8": (
        lambda w, t: _convert(w, t / "o", *FP8, "--calib_dataset", str(_file(t, "c.jsonl", b"\xff\xfe{}\n"))),
        r"c\.jsonl is not UTF-8 text",
    ),
    "calibration prompts a folder": (
        lambda w, t: _convert(w, t / "o", *FP8, "--calib_dataset", str(_folder(t / "cal"))),
        r"cal is not a readable HF datasets folder|cal is a folder; reading an HF datasets folder needs",
    ),
    "calibration prompts with per-line options": (
        lambda w, t: _convert(
            w, t / "o", *FP8, "--calib_dataset", str(_file(t, "c.jsonl", '{"text": "hi", "max_new_tokens": 4}\n'))
        ),
        r"c\.jsonl:1: per-prompt option 'max_new_tokens' is not supported",
    ),
    "calibration prompts of bad JSON": (
        lambda w, t: _convert(w, t / "o", *FP8, "--calib_dataset", str(_file(t, "c.jsonl", "{oops\n"))),
        r"c\.jsonl:1 is not valid JSON",
    ),
    "calibration prompts without quantization": (
        lambda w, t: _convert(w, t / "o", "--calib_dataset", str(w.prompts)),
        r"--calib_dataset is only read when quantizing",
    ),
    "quantization without calibration prompts": (
        lambda w, t: _convert(w, t / "o", *FP8),
        r"quantization needs --calib_dataset",
    ),
    "convert with --workers 0": (
        lambda w, t: _convert(w, t / "o", "--workers", "0"),
        r"argument --workers: must be an integer in \[1, 1024\], got '0'",
    ),
    # triton
    "triton onto a file": (lambda w, t: _triton(w, _file(t, "f", "x")), r"exists and is not a directory"),
    "triton where nothing may be written": (lambda w, t: _triton(w, UNWRITABLE), r"cannot create output"),
    "triton with a folder holding no tokenizer": (
        lambda w, t: [
            "triton",
            "--engine_dir",
            str(w.engine),
            "--tokenizer_dir",
            str(w.draft),
            "--output_dir",
            str(t / "repo"),
        ],
        r"holds no tokenizer",
    ),
    "triton from a folder that is no engine": (
        lambda w, t: [
            "triton",
            "--engine_dir",
            str(w.draft),
            "--tokenizer_dir",
            str(w.target),
            "--output_dir",
            str(t / "repo"),
        ],
        r"is not a DFlash engine directory",
    ),
    # build
    "build without TensorRT-LLM": (
        lambda w, t: [
            "build",
            "--checkpoint_dir",
            str(w.checkpoint),
            "--output_dir",
            str(t / "engine"),
            "--max_seq_len",
            "128",
            "--max_input_len",
            "64",
        ],
        r"TensorRT-LLM|tensorrt_llm",
    ),
    "build from a profile that is not YAML": (
        lambda w, t: ["build", "--config", str(_file(t, "p.yaml", "name: [unclosed")), "--dry_run"],
        r"YAML|yaml",
    ),
    "build from a profile not UTF-8": (
        lambda w, t: ["build", "--config", str(_file(t, "p.yaml", b"name: \xff\n")), "--dry_run"],
        r"not valid YAML",
    ),
    "build from a profile nested absurdly": (
        lambda w, t: ["build", "--config", str(_file(t, "p.yaml", "a: " + NESTED)), "--dry_run"],
        r"nested too deeply|not valid YAML",
    ),
    "build --config over a string head count": (
        lambda w, t: [
            "build",
            "--config",
            str(_profile_for(w, t, _models_with(w, t, "target", num_attention_heads="4"))),
            "--output_dir",
            str(t / "ws"),
            "--dry_run",
        ],
        r"target config: 'num_attention_heads' must be an integer",
    ),
    "build --config over a NaN drafter eps": (
        lambda w, t: [
            "build",
            "--config",
            str(_profile_for(w, t, _models_with(w, t, "draft", rms_norm_eps=math.nan))),
            "--output_dir",
            str(t / "ws"),
            "--dry_run",
        ],
        r"drafter config: 'rms_norm_eps' must be",
    ),
    # demo
    "demo onto a file": (
        lambda w, t: ["demo", "--output_dir", str(_file(t, "f", "x")), "--num_prompts", "1"],
        r"cannot create output|not a directory",
    ),
    # sweep
    "sweep config missing": (lambda w, t: ["sweep", "--config", str(t / "none.yaml")], r"cannot read sweep config"),
    "sweep config not UTF-8": (
        lambda w, t: ["sweep", "--config", str(_file(t, "s.yaml", b"model: \xff\n"))],
        r"is not valid YAML",
    ),
    "sweep results onto a file": (
        lambda w, t: [
            "sweep",
            "--config",
            str(
                _file(
                    t, "s.yaml", w.sweep.read_text().replace("output_dir: .", f"output_dir: {_file(t, 'results', 'x')}")
                )
            ),
        ],
        r"Not a directory|File exists",
    ),
    # generate (writes nothing, but reads everything a user hands it)
    "generate from prompts not UTF-8": (
        lambda w, t: _generate(w, prompts=_file(t, "p.jsonl", b'{"text": "\xff"}\n')),
        r"is not UTF-8 text",
    ),
    "generate with a NaN temperature": (
        lambda w, t: _generate(w, "--temperature", "nan"),
        r"argument --temperature: must be a finite number >= 0 \(0, or anything below 1e-05, means greedy\), got 'nan'",
    ),
    "generate with an overflowing seed": (
        lambda w, t: _generate(w, "--seed", str(2**70)),
        r"argument --seed: must be an integer in \[0, 9223372036854775807\]",
    ),
    "generate a trillion tokens": (
        lambda w, t: _generate(w, "--max_new_tokens", str(10**12)),
        r"argument --max_new_tokens: must be an integer in \[1, 2147483647\], got '1000000000000'",
    ),
    "generate more tokens than the model has positions": (
        lambda w, t: _generate(w, "--max_new_tokens", "1000"),
        r"exceeds the target's max_position_embeddings \(256\)",
    ),
    "generate from a prompt longer than the model": (
        lambda w, t: _generate(w, prompts=_file(t, "p.jsonl", json.dumps({"input_ids": [5] * 300}) + "\n")),
        r"the longest prompt \(300 tokens\)",
    ),
    "generate with per-line options": (
        lambda w, t: _generate(w, prompts=_file(t, "p.jsonl", '{"input_ids": [5], "temperature": 0.7}\n')),
        r"per-prompt option 'temperature'",
    ),
    "generate from a prompt folder": (
        lambda w, t: _generate(w, prompts=t),
        r"is not a readable HF datasets folder|is a folder; reading an HF datasets folder needs",
    ),
    "generate with a corrupt tokenizer": (
        lambda w, t: _generate_with(w, t, "tokenizer.json", '{"model": {"type": "BPE", "vocab": 7}}'),
        r"the tokenizer in .* cannot be loaded",
    ),
    "generate with tokenizer code in auto_map": (
        lambda w, t: _generate_with(
            w,
            t,
            "tokenizer_config.json",
            json.dumps({"tokenizer_class": "Evil", "auto_map": {"AutoTokenizer": [None, "evil.Evil"]}}),
        ),
        r"the tokenizer in .* cannot be loaded",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_input_is_refused_cleanly(world: World, tmp_path: Path, capsys, case: str) -> None:
    make_argv, message = HOSTILE[case]
    argv = make_argv(world, tmp_path)
    before = snapshot(world.root, asset_dir(), tmp_path)
    code, out, err = run_cli(argv, capsys)
    assert_refused(code, err, argv[0], message)
    assert snapshot(world.root, asset_dir(), tmp_path) == before
    assert not UNWRITABLE.exists() and not (tmp_path / "code-ran").exists()


def test_a_full_disk_while_writing_the_triton_repository(world: World, tmp_path: Path, capsys, monkeypatch) -> None:
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(args[1]))

    monkeypatch.setattr("dflash_trt.triton.repository.shutil.copyfile", no_space)
    before = snapshot(world.root, tmp_path)
    code, _, err = run_cli(_triton(world, tmp_path / "repo"), capsys)
    assert_refused(code, err, "triton", r"No space left on device: .*model\.py")
    assert snapshot(world.root, tmp_path) == before


def test_mixed_target_and_drafter_formats_warn_before_converting(world: World, tmp_path: Path, capsys) -> None:
    argv = _convert(
        world,
        tmp_path / "o",
        "--qformat",
        "fp8",
        "--dflash_qformat",
        "none",
        "--calib_dataset",
        str(world.prompts),
        "--calib_size",
        "1",
        "--calib_max_seq_len",
        "4",
    )
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert err.startswith(
        "dflash-trt convert: warning: target weights fp8 but drafter weights none: "
        "`dflash-trt build` will refuse this checkpoint"
    )
    build = ["build", "--checkpoint_dir", str(tmp_path / "o"), "--output_dir", str(tmp_path / "e"), "--dry_run"]
    code, _, err = run_cli(build, capsys)
    assert_refused(
        code,
        err,
        "build",
        r"the drafter is quantized as weights unquantized, KV cache unquantized but "
        r"the target as weights FP8, KV cache unquantized",
    )


def test_generate_trace_in_text(world: World, capsys) -> None:
    code, out, err = run_cli(_generate(world, "--trace", "--max_new_tokens", "6"), capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("[0] ") and lines[1].startswith("    step 0: drafted [")
    assert sum(line.startswith("    step ") for line in lines) >= 2


def test_build_config_on_a_cpu_host_exits_3(world: World, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("dflash_trt.pipeline.run.gpu_build_available", lambda: False)
    code, out, err = run_cli(["build", "--config", str(world.profile), "--output_dir", str(tmp_path / "ws")], capsys)
    assert code == 3
    assert "needs a GPU host" in out
    assert err.splitlines()[-1] == (
        "dflash-trt build: stopped before the engine: this host has no CUDA GPU with TensorRT-LLM "
        "1.2.x; the checkpoint is ready, finish with the command above on a GPU host"
    )  # the last line, after any progress
    assert (tmp_path / "ws" / "checkpoint" / "config.json").is_file()
