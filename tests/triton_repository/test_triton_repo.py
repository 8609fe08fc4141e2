"""Triton repository: every config.pbtxt parses with Triton's own protobuf schema, the ensemble is wired end to end,
profiles and CLI overrides meet the serving schema, and repositories are written from engines and profiles."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from _triton_repo import model_configs, repository_settings, write_engine_dir, write_tokenizer

from dflash_trt.cli import main as cli_main
from dflash_trt.errors import DFlashTrtError
from dflash_trt.pipeline.profiles import load_profile, parse_profile
from dflash_trt.pipeline.settings import settings_from_profile
from dflash_trt.triton import processing as P
from dflash_trt.triton.repository import (
    CLIENT_FILE,
    LAUNCH_SCRIPT,
    PROCESSING_FILE,
    SETTINGS_FILE,
    settings_from_engine,
    write_repository,
)
from dflash_trt.triton.serving import ServingSettings


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


ROOT = Path(__file__).resolve().parents[2]


def _params(cfg) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


def check_ensemble_wiring(configs: dict) -> None:
    """Names, data types and dims line up from the ensemble's inputs through every step to its outputs."""
    ens = configs["ensemble"]
    assert ens.platform == "ensemble"
    available = {t.name: (t.data_type, tuple(t.dims), t.optional) for t in ens.input}
    consumed: set[str] = set()
    for step in ens.ensemble_scheduling.step:
        model = configs[step.model_name]
        assert model.max_batch_size == ens.max_batch_size
        inputs = {t.name: t for t in model.input}
        assert set(step.input_map) <= set(inputs), step.model_name
        required = {t.name for t in model.input if not t.optional}
        assert required <= set(step.input_map), (step.model_name, required - set(step.input_map))
        for key, source in step.input_map.items():
            assert source in available, (step.model_name, key, source)
            dtype, dims, optional = available[source]
            assert (dtype, dims) == (inputs[key].data_type, tuple(inputs[key].dims)), (step.model_name, key)
            assert inputs[key].optional or not optional, f"optional {source} feeds required {key}"
            consumed.add(source)
        outputs = {t.name: t for t in model.output}
        for key, target in step.output_map.items():
            assert key in outputs and target not in available, (step.model_name, key)
            available[target] = (outputs[key].data_type, tuple(outputs[key].dims), False)
    for t in ens.output:
        assert available[t.name][:2] == (t.data_type, tuple(t.dims)), t.name
    assert {t.name for t in ens.input} <= consumed, "unused ensemble input"
    produced = set(available) - {t.name for t in ens.input}
    assert produced <= consumed | {t.name for t in ens.output}, "an intermediate tensor is never consumed"


def parse_eagle_choices(text: str) -> list[list[int]]:
    """The tensorrtllm backend's csvStrToVecVecInt: paths split on '}', a leading '{' dropped, ints split on ','."""
    out, rest = [], text
    while "}" in rest:
        chunk, rest = rest.split("}", 1)
        chunk = chunk.strip().lstrip(",").strip()
        assert chunk.startswith("{"), text
        out.append([int(v) for v in chunk[1:].split(",") if v.strip()])
    assert not rest.strip(), text
    return out


@pytest.mark.parametrize("profile", ["b300-nvfp4/qwen3-8b", "h100-fp8/llama-3.1-8b-instruct", "h200-fp8/qwen3-32b"])
def test_repository_for_a_profile_parses_and_is_wired(tmp_path: Path, tokenizer_dir: Path, profile: str):
    prof = load_profile(ROOT / f"build_configs/{profile}.yaml")
    settings = settings_from_profile(prof, tmp_path / "ws/engine", tokenizer_dir, "/opt/lib/libdflash_trt_plugins.so")
    repo = write_repository(settings, tmp_path / "repo")
    configs = model_configs(repo)
    assert set(configs) == {"ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"}
    check_ensemble_wiring(configs)
    bls, ens = configs["tensorrt_llm_bls"], configs["ensemble"]
    assert bls.backend == "python" and bls.model_transaction_policy.decoupled
    assert [str(t) for t in bls.input] == [str(t) for t in ens.input]  # one request interface, two ways to serve it
    assert [str(t) for t in bls.output] == [str(t) for t in ens.output]
    assert _params(bls)["tensorrt_llm_model_name"] == "tensorrt_llm"
    trt = configs["tensorrt_llm"]
    params = _params(trt)
    assert trt.backend == "tensorrtllm" and trt.model_transaction_policy.decoupled
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["gpt_model_path"] == str((tmp_path / "ws/engine").absolute())
    assert params["decoding_mode"] == "eagle"
    k = prof.model.block_size - 1
    assert parse_eagle_choices(params["eagle_choices"]) == [[0] * d for d in range(1, k + 1)]
    assert float(params["kv_cache_free_gpu_mem_fraction"]) == prof.serving.kv_cache_free_gpu_mem_fraction
    assert params["batch_scheduler_policy"] == "guaranteed_no_evict"
    # Looked up unconditionally by the backend: they must exist, empty values keep guided decoding off.
    assert params["guided_decoding_backend"] == "" and params["xgrammar_tokenizer_info_path"] == ""
    assert trt.max_batch_size == prof.engine.max_batch_size
    assert {"acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"} <= {o.name for o in trt.output}
    pre = _params(configs["preprocessing"])
    assert float(pre["max_temperature"]) == float("inf") and int(pre["max_input_len"]) == prof.engine.max_input_len
    for path in [*repo.glob("*/config.pbtxt"), repo / SETTINGS_FILE]:  # no fill_template placeholder left
        assert "${" not in path.read_text(), path
    assert (repo / "preprocessing/1/model.py").is_file() and (repo / f"postprocessing/1/{PROCESSING_FILE}").is_file()
    assert (repo / "ensemble/1").is_dir() and (repo / "tensorrt_llm/1").is_dir()
    assert json.loads((repo / SETTINGS_FILE).read_text())["world_size"] == prof.checkpoint.tp_size


SHIPPED = sorted((ROOT / "build_configs").glob("*/*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_profile_repository_keeps_eagle_safe_serving(tmp_path: Path, tokenizer_dir: Path, path: Path):
    """Chunked context and KV block reuse off; the BLS (a coroutine serving many requests per instance) has the
    profile's few instances, never one stub per batch slot."""
    prof = load_profile(path)
    repo = write_repository(settings_from_profile(prof, tmp_path / "engine", tokenizer_dir, "lib.so"), tmp_path / "r")
    configs = model_configs(repo)
    params = _params(configs["tensorrt_llm"])
    assert params["decoding_mode"] == "eagle"
    assert (params["enable_chunked_context"], params["enable_kv_cache_reuse"]) == ("false", "false")
    assert configs["tensorrt_llm_bls"].instance_group[0].count == prof.serving.instance_count < 8
    assert configs["preprocessing"].instance_group[0].count == prof.serving.instance_count
    assert configs["postprocessing"].instance_group[0].count == 1  # it holds split characters in its own memory
    assert not configs["postprocessing"].HasField("dynamic_batching")
    assert configs["postprocessing"].instance_group[0].count == 1  # it holds split characters in its own memory
    assert not configs["postprocessing"].HasField("dynamic_batching")


def test_paths_written_into_configs_are_absolute(tmp_path: Path, tokenizer_dir: Path, monkeypatch):
    """The backend refuses a relative gpt_model_path; Triton runs elsewhere than where the repository was made."""
    monkeypatch.chdir(tmp_path)
    tokenizer = Path(os.path.relpath(tokenizer_dir, tmp_path))
    repo = write_repository(
        repository_settings(
            tokenizer, engine_dir="demo_out/engine", plugin_library="plugins/build/libdflash_trt_plugins.so"
        ),
        tmp_path / "repo",
    )
    configs = model_configs(repo)
    assert _params(configs["tensorrt_llm"])["gpt_model_path"] == str(tmp_path / "demo_out/engine")
    for name in ("tensorrt_llm", "preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert _params(configs[name])["tokenizer_dir"] == str(tokenizer_dir), name
    recorded = json.loads((repo / SETTINGS_FILE).read_text())
    assert recorded["plugin_library"] == str(tmp_path / "plugins/build/libdflash_trt_plugins.so")
    assert f"DEFAULT_PLUGIN='{tmp_path}/plugins/build/libdflash_trt_plugins.so'" in (repo / LAUNCH_SCRIPT).read_text()


@pytest.mark.parametrize(
    "flag,value,message",
    [
        (
            "--kv_cache_free_gpu_mem_fraction",
            "5",
            "argument --kv_cache_free_gpu_mem_fraction: must be a finite number in (0, 1], got '5'",
        ),
        (
            "--kv_cache_free_gpu_mem_fraction",
            "nan",
            "argument --kv_cache_free_gpu_mem_fraction: must be a finite number in (0, 1], got 'nan'",
        ),
        (
            "--kv_cache_free_gpu_mem_fraction",
            "0",
            "argument --kv_cache_free_gpu_mem_fraction: must be a finite number in (0, 1], got '0'",
        ),
        # A whole GPU for the KV cache passes the flag's rule; the serving schema leaves room for the rest.
        ("--kv_cache_free_gpu_mem_fraction", "1", "--kv_cache_free_gpu_mem_fraction: Input should be less than 1"),
        ("--instance_count", "0", "argument --instance_count: must be an integer in [1, 2147483647], got '0'"),
    ],
)
def test_cli_overrides_are_checked_by_their_rule_and_the_profile_schema(
    tmp_path: Path, tokenizer_dir: Path, capsys, flag: str, value: str, message: str
):
    engine = write_engine_dir(tmp_path / "eng")
    profile = ROOT / "build_configs/b200-nvfp4/qwen3-4b.yaml"
    for source in (["--engine_dir", str(engine)], ["--config", str(profile), "--work_dir", str(tmp_path / "ws")]):
        out = tmp_path / "repo"
        argv = ["triton", *source, "--tokenizer_dir", str(tokenizer_dir), "--output_dir", str(out), flag, value]
        try:
            code = cli_main(argv)
        except SystemExit as exited:  # the flag's rule refuses it while the arguments are parsed
            code = exited.code
        assert code == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
        assert not out.exists()


def test_repository_settings_refuse_kv_block_reuse_however_built(tokenizer_dir: Path):
    with pytest.raises(DFlashTrtError, match="enable_kv_cache_reuse: must stay false"):
        repository_settings(tokenizer_dir, enable_kv_cache_reuse=True)


def test_serving_settings_refuse_an_attention_window(tokenizer_dir: Path):
    with pytest.raises(DFlashTrtError, match="max_attention_window_size: must stay unset .* makes the KV cache cyclic"):
        repository_settings(tokenizer_dir, max_attention_window_size=4096)
    data = yaml.safe_load((ROOT / "build_configs/h200-fp8/qwen3-8b.yaml").read_text())
    data["serving"]["max_attention_window_size"] = 1024
    with pytest.raises(DFlashTrtError, match="serving.max_attention_window_size: must stay unset"):
        parse_profile(data, "p.yaml")


def test_profiles_refuse_kv_block_reuse():
    data = yaml.safe_load((ROOT / "build_configs/h200-fp8/qwen3-8b.yaml").read_text())
    data["serving"]["enable_kv_cache_reuse"] = True
    with pytest.raises(DFlashTrtError, match="serving.enable_kv_cache_reuse: must stay false"):
        parse_profile(data, "p.yaml")


def test_python_models_import_only_what_processing_defines(tmp_path: Path, tokenizer_dir: Path):
    import ast

    repo = write_repository(repository_settings(tokenizer_dir), tmp_path / "repo")
    for name in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        tree = ast.parse((repo / name / "1/model.py").read_text())
        imported = [
            a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module == "dflash_processing"
            for a in n.names
        ]
        assert imported and all(hasattr(P, a) for a in imported)
        classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
        assert classes == ["TritonPythonModel"]
    compile((repo / CLIENT_FILE).read_text(), CLIENT_FILE, "exec")


def test_write_repository_refuses_to_overwrite(tmp_path: Path, tokenizer_dir: Path):
    write_repository(repository_settings(tokenizer_dir), tmp_path / "repo")
    with pytest.raises(DFlashTrtError, match="already exists"):
        write_repository(repository_settings(tokenizer_dir), tmp_path / "repo")
    write_repository(repository_settings(tokenizer_dir, max_draft_len=9), tmp_path / "repo", overwrite=True)
    params = _params(model_configs(tmp_path / "repo")["tensorrt_llm"])
    assert len(parse_eagle_choices(params["eagle_choices"])) == 9


def test_settings_from_engine_reads_the_manifest(tmp_path: Path, tokenizer_dir: Path):
    s = settings_from_engine(write_engine_dir(tmp_path / "eng"), tokenizer_dir, ServingSettings(instance_count=3))
    assert (s.max_batch_size, s.max_input_len, s.max_draft_len, s.world_size) == (128, 2048, 9, 2)
    assert (s.plugin_library, s.instance_count, s.max_temperature) == ("/p/lib.so", 3, 0.0)
    assert s.max_seq_len == 4096  # the KV window 4096 + 2 x 9 (no max_position_embeddings) less two blocks of 9
    configs = model_configs(write_repository(s, tmp_path / "repo"))
    assert _params(configs["preprocessing"])["max_seq_len"] == _params(configs["tensorrt_llm_bls"])["max_seq_len"]
    assert _params(configs["preprocessing"])["max_seq_len"] == "4096"
    fewer_positions = write_engine_dir(tmp_path / "positions")
    config = json.loads((fewer_positions / "config.json").read_text())
    config["pretrained_config"] = {"max_position_embeddings": 4000}
    (fewer_positions / "config.json").write_text(json.dumps(config))
    assert settings_from_engine(fewer_positions, tokenizer_dir).max_seq_len == 4000 - 18
    del config["build_config"]["max_seq_len"]
    (fewer_positions / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashTrtError, match="lacks 'max_seq_len'"):
        settings_from_engine(fewer_positions, tokenizer_dir)
    assert s.draft_len_schedule == "none"  # an engine built before draft-length schedules
    scheduled = write_engine_dir(tmp_path / "scheduled", draft_len_schedule="2:7,16:3")
    assert settings_from_engine(scheduled, tokenizer_dir).draft_len_schedule == "2:7,16:3"
    with pytest.raises(DFlashTrtError, match="not a DFlash engine directory"):
        settings_from_engine(tmp_path, tokenizer_dir)
    broken = tmp_path / "broken"
    write_engine_dir(broken)
    (broken / "dflash_trt.json").write_text(json.dumps({"max_batch_size": 1}))
    with pytest.raises(DFlashTrtError, match="lacks 'plugin_library'"):
        settings_from_engine(broken, tokenizer_dir)


def test_a_tree_engine_gets_the_chain_over_its_draft_positions(tmp_path: Path, tokenizer_dir: Path):
    """A draft-tree engine verifies 40 nodes over 15 positions: the backend gets the manifest's 15-deep chain as
    eagle_choices (the runtime checks their depth against num_eagle_layers), not a 40-deep one."""
    chain = [[0] * depth for depth in range(1, 16)]
    engine = write_engine_dir(tmp_path / "eng", max_draft_len=40, draft_tree=40, eagle_choices=chain)
    settings = settings_from_engine(engine, tokenizer_dir)
    # Requests up to its window (4114) less its 40 nodes (the executor's clip, beyond 2 x 15 for the next block).
    assert settings.max_seq_len == 4114 - 40
    write_repository(settings, tmp_path / "repo")
    params = _params(model_configs(tmp_path / "repo")["tensorrt_llm"])
    assert parse_eagle_choices(params["eagle_choices"]) == chain


def test_cli_writes_a_repository_from_an_engine_and_from_a_profile(tmp_path: Path, tokenizer_dir: Path, capsys):
    engine = write_engine_dir(tmp_path / "eng")
    assert (
        cli_main(
            [
                "triton",
                "--engine_dir",
                str(engine),
                "--tokenizer_dir",
                str(tokenizer_dir),
                "--output_dir",
                str(tmp_path / "r1"),
            ]
        )
        == 0
    )
    assert _params(model_configs(tmp_path / "r1")["tensorrt_llm"])["gpt_model_path"] == str(engine.absolute())
    assert "launch_triton.sh" in capsys.readouterr().out
    profile = ROOT / "build_configs/b200-nvfp4/qwen3-4b.yaml"
    assert (
        cli_main(
            [
                "triton",
                "--config",
                str(profile),
                "--tokenizer_dir",
                str(tokenizer_dir),
                "--work_dir",
                str(tmp_path / "ws"),
                "--output_dir",
                str(tmp_path / "r2"),
                "--instance_count",
                "2",
                "--json",
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed["engine_dir"] == str((tmp_path / "ws/engine").absolute()) and printed["instance_count"] == 2
    configs = model_configs(tmp_path / "r2")
    check_ensemble_wiring(configs)
    assert configs["preprocessing"].instance_group[0].count == 2
    assert (
        cli_main(
            [
                "triton",
                "--engine_dir",
                str(engine),
                "--tokenizer_dir",
                str(tmp_path),
                "--output_dir",
                str(tmp_path / "r3"),
            ]
        )
        == 2
    )
    assert "holds no tokenizer" in capsys.readouterr().err


def test_a_tree_profiles_repository_verifies_its_nodes_over_the_chains_positions(tokenizer_dir, tmp_path, capsys):
    """`triton --config` on a profile with `engine.draft_tree: 32` (Qwen3-8B: 15 draft positions): 32 drafts per
    request, the EAGLE choices the 15-deep chain."""
    source = ROOT / "build_configs/h200-fp8/qwen3-8b.yaml"
    data = yaml.safe_load(source.read_text())
    data["engine"].update(max_batch_size=64, draft_tree=32, draft_len_schedule="none")
    data["sweep"]["concurrency"] = [1, 64]
    data["quantization"]["calibration"]["dataset"] = str(source.parent / data["quantization"]["calibration"]["dataset"])
    profile = tmp_path / "tree.yaml"
    profile.write_text(yaml.safe_dump(data))
    out = tmp_path / "repo"
    argv = ["triton", "--config", str(profile), "--tokenizer_dir", str(tokenizer_dir), "--work_dir", str(tmp_path)]
    assert cli_main([*argv, "--output_dir", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["max_draft_len"], printed["eagle_depth"]) == (32, 15)
    choices = _params(model_configs(out)["tensorrt_llm"])["eagle_choices"]
    assert choices == ", ".join("{" + ", ".join(["0"] * depth) + "}" for depth in range(1, 16))
