"""The README's tour on the tiny pair runs exactly as printed (paths rebased into a temporary folder)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml

from dflash_trt.cli import main
from dflash_trt.commands.build import readable_json

REPO_ROOT = Path(__file__).resolve().parents[2]


def tour_commands() -> list[str]:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## The tiny pair, and the tour on it", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.DOTALL)
    assert block is not None
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_tour_runs_as_printed(tmp_path, capsys):
    commands = tour_commands()
    assert [c.split()[1] for c in commands] == ["convert", "verify", "generate", "build", "bench"]
    for command in commands:
        argv = [
            str(REPO_ROOT / word) if word.startswith("dflash_trt/assets/") else word.replace("tour/", f"{tmp_path}/")
            for word in shlex.split(command)
        ]
        assert argv[0] == "dflash-trt"
        assert main(argv[1:]) == 0, command
    printed = capsys.readouterr().out
    assert "OK:" in printed and "trtllm-build --checkpoint_dir" in printed
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert {p["engine"] for p in results["points"]} == {"dflash", "ar"}


def test_dry_run_json_keeps_short_lists_on_one_line():
    manifest = {"eagle_choices": [[0] * n for n in range(1, 16)], "limits": {"max_seq_len": 256}, "runs": [{"a": 1}]}
    text = readable_json(manifest)
    assert json.loads(text) == manifest
    assert len(text.splitlines()) == 11
    assert '"eagle_choices": [[0], [0, 0],' in text


def test_the_sweep_example_measures_real_text():
    doc = (REPO_ROOT / "docs" / "performance.md").read_text()
    blocks = [block.split("```", 1)[0] for block in doc.split("```yaml\n")[1:]]
    example = yaml.safe_load(next(block for block in blocks if block.startswith("# sweep.yaml")))
    assert "synthetic" not in example
    dataset = REPO_ROOT / example["dataset"]
    lines = dataset.read_text().splitlines()
    assert len(lines) > 500 and all(isinstance(json.loads(line)["text"], str) for line in lines)
