"""`dflash-trt triton --checkpoint_dir`: the CPU-served repository differs from the engine repository only in its
`tensorrt_llm` folder, whose Python model declares exactly the tensors, dims, batching and decoupling of the
tensorrtllm backend's config; what a repository is written from is checked first (plugin paths the loader would
split, corrupt or foreign tokenizers). Every config is parsed with Triton's own protobuf schema."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _triton_repo import repository_settings
from google.protobuf import text_format

from dflash_trt.cli import main as cli_main
from dflash_trt.errors import DFlashTrtError
from dflash_trt.triton.repository import (
    BLS,
    LAUNCH_SCRIPT,
    TENSORRT_LLM,
    RepositorySettings,
    settings_from_checkpoint,
    write_repository,
)

mc = pytest.importorskip("tritonclient.grpc.model_config_pb2")


@pytest.fixture(scope="module")
def checkpoint(tiny: Path) -> Path:
    return tiny


def _configs(repo: Path) -> dict:
    return {
        d.name: text_format.Parse((d / "config.pbtxt").read_text(), mc.ModelConfig())
        for d in sorted(repo.iterdir())
        if (d / "config.pbtxt").is_file()
    }


def _without(config, *fields):
    copy = mc.ModelConfig()
    copy.CopyFrom(config)
    for name in fields:
        copy.ClearField(name)
    return copy


def test_only_the_tensorrt_llm_model_differs_from_the_engine_repository(checkpoint, tmp_path):
    cpu = settings_from_checkpoint(checkpoint, checkpoint, max_batch_size=4)
    engine = RepositorySettings(
        engine_dir="/engines/tiny",
        tokenizer_dir=str(checkpoint),
        plugin_library="/opt/lib/libdflash_trt_plugins.so",
        max_batch_size=cpu.max_batch_size,
        max_input_len=cpu.max_input_len,
        max_draft_len=cpu.max_draft_len,
        world_size=1,
        max_temperature=cpu.max_temperature,
        max_seq_len=cpu.max_seq_len,
    )
    served = _configs(write_repository(cpu, tmp_path / "cpu"))
    built = _configs(write_repository(engine, tmp_path / "engine"))
    assert served.keys() == built.keys()
    for name in served.keys() - {TENSORRT_LLM}:
        assert served[name] == built[name], name
    llm, reference = served[TENSORRT_LLM], built[TENSORRT_LLM]
    assert (llm.backend, reference.backend) == ("python", "tensorrtllm")
    assert _without(llm, "backend", "parameters") == _without(reference, "backend", "parameters")
    assert llm.model_transaction_policy.decoupled and llm.max_batch_size == 4
    params = {k: v.string_value for k, v in llm.parameters.items()}
    assert params == {
        "checkpoint_dir": str(checkpoint.absolute()),
        "max_batch_size": "4",
        "max_seq_len": str(cpu.max_seq_len),
        "tokens_per_block": "32",
    }
    assert (tmp_path / "cpu" / TENSORRT_LLM / "1" / "model.py").is_file()
    assert served[BLS].instance_group[0].count == 1  # an async BLS: no stub per batch slot


def test_the_cpu_launch_script_preloads_nothing(checkpoint, tmp_path):
    repo = write_repository(settings_from_checkpoint(checkpoint, checkpoint, 2), tmp_path / "r")
    script = (repo / LAUNCH_SCRIPT).read_text()
    assert "LD_PRELOAD" not in script and "DFLASH_TRT_LOAD_PLUGINS" not in script and "--model-repository" in script


def test_max_seq_len_defaults_to_the_context_less_two_draft_blocks(checkpoint):
    """The engine's last step drafts a block that ends 2K positions past a request's last token (docs/engine.md §4)."""
    config = json.loads((checkpoint / "config.json").read_text())
    longest = config["max_position_embeddings"] - 2 * config["max_draft_len"]
    s = settings_from_checkpoint(checkpoint, checkpoint, 2)
    assert (s.max_seq_len, s.max_input_len, s.max_draft_len) == (longest, longest - 1, config["max_draft_len"])
    with pytest.raises(DFlashTrtError, match=f"--max_seq_len must be in 2..{longest}"):
        settings_from_checkpoint(checkpoint, checkpoint, 2, max_seq_len=longest + 1)
    with pytest.raises(DFlashTrtError, match="--max_batch_size must be >= 1"):
        settings_from_checkpoint(checkpoint, checkpoint, 0)


def test_cli_writes_a_cpu_repository_and_refuses_engine_only_mixes(checkpoint, tmp_path, capsys):
    out = tmp_path / "repo"
    argv = ["triton", "--checkpoint_dir", str(checkpoint), "--tokenizer_dir", str(checkpoint), "--output_dir"]
    assert cli_main([*argv, str(out), "--max_batch_size", "2", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["checkpoint_dir"] == str(checkpoint.absolute()) and printed["max_batch_size"] == 2
    assert _configs(out)[TENSORRT_LLM].backend == "python"
    engine = ["triton", "--engine_dir", str(tmp_path), "--tokenizer_dir", str(checkpoint), "--output_dir"]
    assert cli_main([*engine, str(tmp_path / "e"), "--max_batch_size", "4"]) == 2
    assert "--max_batch_size applies to --checkpoint_dir only" in capsys.readouterr().err
    assert cli_main(["triton", "--checkpoint_dir", str(checkpoint), "--output_dir", str(tmp_path / "x")]) == 2
    assert "--tokenizer_dir is required with --checkpoint_dir" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() and not (tmp_path / "x").exists()
    assert cli_main([*argv, str(tmp_path / "shown")]) == 0
    hints = capsys.readouterr().out  # the closing hints name what runs them: this Python, and the server binary
    assert f"{sys.executable} {tmp_path / 'shown' / 'client.py'}" in hints and "TRITONSERVER=" in hints


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--draft_tree", "14"], "--draft_tree 14: a tree holds at least the chain's 15 drafts"),
        (["--draft_tree", "257"], "--draft_tree 257: an EAGLE engine verifies at most 256 drafts"),
    ],
)
def test_a_cpu_tree_takes_the_builds_node_rule(checkpoint, tmp_path, capsys, flags, message):
    argv = ["triton", "--checkpoint_dir", str(checkpoint), "--tokenizer_dir", str(checkpoint), "--output_dir"]
    assert cli_main([*argv, str(tmp_path / "repo"), *flags]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "repo").exists()
    engine = ["triton", "--engine_dir", str(tmp_path), "--tokenizer_dir", str(checkpoint), "--output_dir"]
    assert cli_main([*engine, str(tmp_path / "e"), "--draft_tree", "24"]) == 2
    assert "--draft_tree applies to --checkpoint_dir only" in capsys.readouterr().err


@pytest.mark.parametrize("library", ["/opt/my libs/libdflash_trt_plugins.so", "/opt/a:b/libdflash_trt_plugins.so"])
def test_plugin_paths_the_loader_would_split_are_refused(checkpoint, library):
    with pytest.raises(DFlashTrtError, match="splits LD_PRELOAD at spaces and colons"):
        RepositorySettings(
            engine_dir="/e",
            tokenizer_dir=str(checkpoint),
            plugin_library=library,
            max_batch_size=1,
            max_input_len=8,
            max_draft_len=3,
            world_size=1,
            max_temperature=0.0,
            max_seq_len=64,
        )


def _tokenizer_copy(checkpoint: Path, where: Path) -> Path:
    where.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (where / name).write_bytes((checkpoint / name).read_bytes())
    return where


def test_corrupt_and_foreign_tokenizers_are_refused(checkpoint, tmp_path, capsys):
    corrupt = _tokenizer_copy(checkpoint, tmp_path / "corrupt")
    (corrupt / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    argv = ["triton", "--checkpoint_dir", str(checkpoint), "--output_dir", str(tmp_path / "r"), "--tokenizer_dir"]
    assert cli_main([*argv, str(corrupt)]) == 2
    assert "cannot be loaded" in capsys.readouterr().err
    foreign = _tokenizer_copy(checkpoint, tmp_path / "foreign")
    data = json.loads((foreign / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    for i in range(200):
        vocab[f"extra{i}"] = len(vocab)
    (foreign / "tokenizer.json").write_text(json.dumps(data))
    assert cli_main([*argv, str(foreign)]) == 2
    err = capsys.readouterr().err
    assert "more than the 128 of the checkpoint" in err and "belongs to another model" in err
    assert not (tmp_path / "r").exists()


def test_a_multi_rank_checkpoint_is_refused(checkpoint, tmp_path):
    sharded = tmp_path / "tp2"
    sharded.mkdir()
    config = json.loads((checkpoint / "config.json").read_text())
    config["mapping"] = {**config.get("mapping", {}), "tp_size": 2}
    (sharded / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashTrtError, match="runs one rank; convert with --tp_size 1"):
        settings_from_checkpoint(sharded, checkpoint, 2)


def test_the_repository_client_says_how_to_start_a_server_when_none_runs(checkpoint, tmp_path, capsys, monkeypatch):
    import importlib.util
    import socket
    import sys

    repo = write_repository(settings_from_checkpoint(checkpoint, checkpoint, 2), tmp_path / "r")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = importlib.util.spec_from_file_location("repository_client", repo / "client.py")
    client = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "repository_client", client)  # dataclasses look their module up
    spec.loader.exec_module(client)
    assert client.main(["--url", f"127.0.0.1:{port}", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"no Triton server at 127.0.0.1:{port}" in err and str(repo / LAUNCH_SCRIPT) in err
    assert len(err.strip().splitlines()) == 1


def test_python_models_start_their_stub_without_the_plugin_preload(checkpoint, tmp_path):
    """The wrapper in each Python model folder, called as python_backend's stub launcher calls a stub: exit 1 alone
    (the launcher's probe), else the backend's own stub from PYTHON_LIB with the same arguments, preload dropped."""
    import os
    import subprocess

    repo = write_repository(settings_from_checkpoint(checkpoint, checkpoint, 2), tmp_path / "r")
    backend = tmp_path / "backend"
    backend.mkdir()
    record = tmp_path / "record"
    real = backend / "triton_python_backend_stub"
    real.write_text(f'#!/usr/bin/env bash\n{{ echo "$@"; env; }} > {record}\n')
    real.chmod(0o755)
    env = {**os.environ, "LD_PRELOAD": "", "DFLASH_TRT_LOAD_PLUGINS": "1"}
    for name in ("preprocessing", "postprocessing", "tensorrt_llm_bls", TENSORRT_LLM):
        wrapper = repo / name / "triton_python_backend_stub"
        assert os.access(wrapper, os.X_OK)
        assert subprocess.run([str(wrapper)], env=env).returncode == 1
        args = [str(repo / name / "1/model.py"), "region", "1024", "1024", "77", str(backend), "9", f"{name}_0_0"]
        assert subprocess.run([str(wrapper), *args], env=env).returncode == 0
        lines = record.read_text().splitlines()
        assert lines[0] == " ".join(args)
        assert not any(line.startswith(("LD_PRELOAD=", "DFLASH_TRT_LOAD_PLUGINS=")) for line in lines[1:])


def test_path_map_writes_the_serving_hosts_paths(checkpoint, tmp_path, capsys):
    """Validated against the files here, written as the serving host mounts them."""
    here = str(checkpoint.parent.absolute())
    out = tmp_path / "repo"
    argv = ["triton", "--checkpoint_dir", str(checkpoint), "--tokenizer_dir", str(checkpoint), "--output_dir"]
    assert cli_main([*argv, str(out), "--path_map", f"{here}=/models", "--max_batch_size", "2"]) == 0
    configs = _configs(out)
    params = {k: v.string_value for k, v in configs[TENSORRT_LLM].parameters.items()}
    assert params["checkpoint_dir"] == f"/models/{checkpoint.name}"
    for name in ("preprocessing", "postprocessing", BLS):
        assert configs[name].parameters["tokenizer_dir"].string_value == f"/models/{checkpoint.name}"
    assert here not in "".join((d / "config.pbtxt").read_text() for d in out.iterdir() if d.is_dir())
    capsys.readouterr()
    assert cli_main([*argv, str(tmp_path / "bad"), "--path_map", "models=/x"]) == 2
    assert "--path_map 'models=/x': expected HERE=THERE, two absolute paths" in capsys.readouterr().err


def _engine_settings(checkpoint: Path, **changes) -> RepositorySettings:
    """An engine repository for the tiny pair's tokenizer (the shared settings, at the tiny pair's sizes)."""
    tiny = {"engine_dir": "/engines/tiny", "plugin_library": "/opt/lib/libdflash_trt_plugins.so"}
    return repository_settings(checkpoint, **tiny, max_batch_size=8, max_input_len=64, **changes)


@pytest.mark.parametrize(("replicas", "world_size", "groups"), [(8, 1, "0;1;2;3;4;5;6;7"), (4, 2, "0,1;2,3;4,5;6,7")])
def test_replicas_are_instances_on_their_own_gpus(checkpoint, tmp_path, replicas, world_size, groups):
    repo = write_repository(_engine_settings(checkpoint, replicas=replicas, world_size=world_size), tmp_path / "r")
    llm = _configs(repo)[TENSORRT_LLM]
    assert llm.instance_group[0].count == replicas
    assert llm.parameters["gpu_device_ids"].string_value == groups
    script = (repo / LAUNCH_SCRIPT).read_text()
    assert f"REPLICAS={replicas}" in script and "TRTLLM_ORCHESTRATOR=1" in script
    single = _configs(write_repository(_engine_settings(checkpoint), tmp_path / "one"))[TENSORRT_LLM]
    assert single.instance_group[0].count == 1 and "gpu_device_ids" not in single.parameters


def test_node_profiles_serve_one_replica_per_group_of_gpus():
    from dflash_trt.pipeline.profiles import load_profile

    root = Path(__file__).resolve().parents[2] / "build_configs"
    for path in [*root.glob("b300-*/*.yaml"), *root.glob("h100-fp8/*.yaml")]:
        profile = load_profile(path)
        assert profile.serving.replicas * profile.checkpoint.tp_size == 8, path


@pytest.mark.parametrize("replicas", ["0", "65"])
def test_replicas_flag_is_checked_by_its_rule(checkpoint, tmp_path, capsys, replicas):
    argv = ["triton", "--checkpoint_dir", str(checkpoint), "--tokenizer_dir", str(checkpoint), "--output_dir"]
    with pytest.raises(SystemExit) as exited:
        cli_main([*argv, str(tmp_path / "r"), "--replicas", replicas])
    assert exited.value.code == 2
    assert f"argument --replicas: must be an integer in [1, 64], got '{replicas}'" in capsys.readouterr().err


def test_a_profiles_tokenizer_is_checked_against_its_recorded_target(checkpoint, tmp_path, capsys, monkeypatch):
    import dflash_trt.recorded_configs as recorded

    profile = Path(__file__).resolve().parents[2] / "build_configs/b200-nvfp4/qwen3-4b.yaml"
    monkeypatch.setattr(recorded, "packaged_recorded_configs", lambda: {"Qwen/Qwen3-4B": {"vocab_size": 10}})
    argv = ["triton", "--config", str(profile), "--tokenizer_dir", str(checkpoint)]
    assert cli_main([*argv, "--work_dir", str(tmp_path / "w"), "--output_dir", str(tmp_path / "r")]) == 2
    assert "more than the 10 of the profile's target Qwen/Qwen3-4B" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
