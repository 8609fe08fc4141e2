"""A small world of real inputs (models, checkpoint, engine folder, profile, sweep config, prompts) and the checks
every hostile command-line case shares: exit 2, one stderr line, no traceback, nothing in the world changed."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from dflash_trt.cli import main
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.tiny.heldout import draft_dir, target_dir


@dataclass(frozen=True)
class World:
    root: Path

    @property
    def target(self) -> Path:
        return self.root / "models" / "target"

    @property
    def draft(self) -> Path:
        return self.root / "models" / "draft"

    @property
    def checkpoint(self) -> Path:
        return self.root / "ckpt"

    @property
    def engine(self) -> Path:
        return self.root / "engine"

    @property
    def plugin(self) -> Path:
        return self.root / "lib" / "libdflash_trt_plugins.so"

    @property
    def prompts(self) -> Path:
        return self.root / "prompts" / "prompts.jsonl"

    @property
    def profile(self) -> Path:
        return self.root / "profiles" / "tiny.yaml"

    @property
    def sweep(self) -> Path:
        return self.root / "sweeps" / "sweep.yaml"


def make_world(root: Path) -> World:
    world = World(root)
    shutil.copytree(target_dir(), world.target)
    shutil.copytree(draft_dir(), world.draft)
    convert_checkpoint(world.target, world.draft, world.checkpoint, dtype="float32")
    world.plugin.parent.mkdir()
    world.plugin.write_bytes(b"\x7fELF not really")
    world.engine.mkdir()
    (world.engine / "config.json").write_text(
        json.dumps(
            {
                "pretrained_config": {"vocab_size": 512},
                "build_config": {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128 + 2 * 15},
            }
        )
    )
    manifest = {"max_batch_size": 4, "max_draft_len": 15, "tp_size": 1, "plugin_library": str(world.plugin)}
    (world.engine / "dflash_trt.json").write_text(json.dumps(manifest))
    world.prompts.parent.mkdir()
    world.prompts.write_text('{"input_ids": [5, 6, 7]}\n{"text": "add 0012 0034\\n"}\n')
    world.profile.parent.mkdir()
    world.profile.write_text(
        yaml.safe_dump(
            {
                "name": "tiny",
                "gpu": "b300",
                "model": {"target": str(world.target), "draft": str(world.draft), "block_size": 16},
                "quantization": {"qformat": "none", "dflash_qformat": "none", "kv_cache_dtype": "none"},
                "engine": {
                    "max_batch_size": 4,
                    "max_input_len": 64,
                    "max_seq_len": 128,
                    "max_num_tokens": 256,
                    "max_draft_len": 15,
                    "gemm_plugin": "auto",
                },
                "serving": {"instance_count": 1},
                "sweep": {"concurrency": [1, 4], "interactivity_band": [100, 200]},
            }
        )
    )
    world.sweep.parent.mkdir()
    world.sweep.write_text(
        yaml.safe_dump(
            {
                "model": "tiny",
                "dataset": str(world.prompts),
                "concurrency": [1],
                "output_dir": ".",
                "engines": [{"name": "ar", "kind": "ar", "engine_dir": str(world.engine)}],
            }
        )
    )
    return world


def snapshot(*roots: Path) -> dict[str, str]:
    """Every path under `roots` -> sha256 of a file, the target of a link, or 'dir'."""
    state: dict[str, str] = {}
    for root in roots:
        for path in sorted([root, *root.rglob("*")]):
            if path.is_symlink():
                state[str(path)] = "link " + str(path.readlink())
            elif path.is_dir():
                state[str(path)] = "dir"
            else:
                state[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return state


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of one in-process `dflash-trt` call; SystemExit (argparse) counts as a code."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(code: int, err: str, command: str, message: str) -> None:
    """Exit 2, exactly one stderr line naming the command, no traceback, the expected message."""
    assert code == 2, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"dflash-trt {command}: error: "), err
    assert "Traceback" not in err, err
    assert re.search(message, err), err


def hub_snapshot(source: Path, cache: Path, repo: str = "models--org--tiny") -> Path:
    """`source` laid out as an HF hub download: every file a relative link from snapshots/<rev>/ into blobs/."""
    entry = cache / repo
    (entry / "blobs").mkdir(parents=True)
    snapshot = entry / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        blob = entry / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(Path("../..") / "blobs" / blob.name)
    return snapshot
