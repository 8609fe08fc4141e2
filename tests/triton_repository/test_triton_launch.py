"""The repository's launch script preloads the plugin library on every rank."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from _triton_repo import repository_settings, write_tokenizer

from dflash_trt.triton.repository import (
    LAUNCH_SCRIPT,
    write_repository,
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _fake_binary(path: Path, record: Path) -> Path:
    path.write_text(
        f'#!/usr/bin/env bash\n{{ echo "LD_PRELOAD=$LD_PRELOAD $DFLASH_TRT_LOAD_PLUGINS"; '
        f'printf "%s\\n" "$@"; }} > {record}\n'
    )
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("world_size", [1, 2])
def test_launch_script_preloads_the_plugin(tmp_path: Path, tokenizer_dir: Path, world_size: int):
    plugin = tmp_path / "libdflash_trt_plugins.so"
    plugin.write_bytes(b"\x7fELF")
    repo = write_repository(
        repository_settings(tokenizer_dir, plugin_library=str(plugin), world_size=world_size), tmp_path / "repo"
    )
    record = tmp_path / "argv.txt"
    env = dict(
        os.environ,
        TRITONSERVER=str(_fake_binary(tmp_path / "tritonserver", record)),
        MPIRUN=str(_fake_binary(tmp_path / "mpirun", record)),
        LD_PRELOAD="",
    )
    env.pop("DFLASH_TRT_PLUGIN_LIB", None)
    env.pop("DFLASH_TRT_LOAD_PLUGINS", None)
    elsewhere = tmp_path / "elsewhere"  # the script does not depend on the directory it is started from
    elsewhere.mkdir()
    subprocess.run(
        ["bash", str(repo / LAUNCH_SCRIPT), "--grpc-port=9001"], env=env, check=True, timeout=30, cwd=elsewhere
    )
    lines = record.read_text().splitlines()
    assert f"--model-repository={repo.absolute()}" in lines and "--grpc-port=9001" in lines
    if world_size == 1:
        assert lines[0] == f"LD_PRELOAD={plugin} 1"  # preloaded, and told to register its creators on load
    else:  # mpirun itself runs without the plugin and hands it to every rank
        assert lines[0] == "LD_PRELOAD= "
        assert lines[1:6] == ["--allow-run-as-root", "-x", f"LD_PRELOAD={plugin}", "-x", "DFLASH_TRT_LOAD_PLUGINS=1"]
        assert lines.count(str(tmp_path / "tritonserver")) == 2 and "--load-model=tensorrt_llm" in lines
        assert lines.index("--grpc-port=9001") < lines.index(":") < lines.index("--allow-grpc=false")
    env["DFLASH_TRT_PLUGIN_LIB"] = str(tmp_path / "missing.so")
    failed = subprocess.run(["bash", str(repo / LAUNCH_SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
    assert failed.returncode == 1 and "missing.so not found" in failed.stderr
