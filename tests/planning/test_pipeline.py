"""`dflash-trt build --config`: dry runs of every shipped profile, and an idempotent CPU run on a tiny real pair."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml
from _pairs import PairVariant, make_pair
from _profile_hub import RECORDED, RECORDED_PATH, profile_hub, tiny_profile

from dflash_trt.cli import main as cli_main
from dflash_trt.gpu_targets import GPU_SMS
from dflash_trt.inputs import DRAFT_LEN_SCHEDULE
from dflash_trt.pipeline.profiles import load_profile
from dflash_trt.pipeline.resolve import PipelineRequest, resolve_inputs
from dflash_trt.pipeline.run import Outcome, StageResult, resume_command, run_pipeline
from dflash_trt.pipeline.stages import stages
from dflash_trt.pipeline.workspace import StageState
from dflash_trt.trtllm.engine_manifest import MANIFEST_NAME

ROOT = Path(__file__).resolve().parents[2]
PROFILES = sorted((ROOT / "build_configs").glob("*/*.yaml"))
API = json.loads((ROOT / "tests/data/trtllm_api.json").read_text())


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    return profile_hub(tmp_path_factory.mktemp("hub"))


def _stage_commands(output: str) -> dict[str, str]:
    """Stage name -> the command line printed under it."""
    lines = output.splitlines()
    commands = {}
    for i, line in enumerate(lines):
        if line.startswith("[") and "would run" in line:
            commands[line.split("] ", 1)[1].split(" ", 1)[0]] = lines[i + 1].strip()
    return commands


def _trtllm_build_flags() -> set[str]:
    flags = API.get("trtllm_build_flags")
    if flags is None:
        pytest.skip("tests/data/trtllm_api.json records no trtllm_build_flags list to check against")
    return {f if f.startswith("--") else f"--{f}" for f in flags}


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_dry_run_of_every_profile(path: Path, hub: Path, tmp_path: Path, capsys):
    profile = load_profile(path)
    ws = tmp_path / "ws"
    assert cli_main(["build", "--config", str(path), "--hf_cache", str(hub), "--output_dir", str(ws), "--dry_run"]) == 0
    out = capsys.readouterr().out
    commands = _stage_commands(out)
    assert list(commands) == ["checkpoint", "engine", "triton"]
    convert = shlex.split(commands["checkpoint"])
    assert convert[:2] == ["dflash-trt", "convert"]
    assert convert[convert.index("--qformat") + 1] == profile.quantization.qformat
    assert convert[convert.index("--tp_size") + 1] == str(profile.checkpoint.tp_size)
    env, target, schedule_env, *build = shlex.split(commands["engine"])
    assert env.startswith("DFLASH_TRT_PLUGIN_LIB=") and env.endswith("libdflash_trt_plugins.so")
    # The network is built for the profile's GPU: its attention kernels differ between Hopper and Blackwell.
    assert target == f"DFLASH_TRT_TARGET_SM={GPU_SMS[profile.gpu]}"
    # ...and says which: Blackwell's generation passes on DFlashAttention, Hopper's on the stock plugin (XQA).
    generation = "DFlashAttention" if profile.gpu in ("b200", "b300") else "GPTAttention"
    route = next(line for line in out.splitlines() if line.startswith(f"attention on {profile.gpu}: "))
    passes = f"target_context GPTAttention, target_verification {generation}, draft_block_full_attention {generation}"
    assert passes in route
    # The shipped profiles derive their schedule (auto), and the build hands exactly that table to the network.
    name, _, table = schedule_env.partition("=")
    assert name == "DFLASH_TRT_DRAFT_LEN_SCHEDULE" and profile.engine.draft_len_schedule == "auto"
    if "offline: draft_len_schedule auto: derived once the models' config.json fields are known" in out:
        assert table == "none"  # a drafter whose shapes nobody recorded: nothing to derive from in a dry run
    else:
        assert f"draft-length schedule {table} (auto: trtllm calibration, {profile.gpu}" in out
        assert DRAFT_LEN_SCHEDULE(table).fitted_to(profile.model.block_size - 1).steps
    assert build[0] == "trtllm-build"
    flags = {build[i]: build[i + 1] for i in range(1, len(build) - 1) if build[i].startswith("--")}
    assert flags["--checkpoint_dir"] == str(ws / "checkpoint") and flags["--output_dir"] == str(ws / "engine")
    assert flags["--max_draft_len"] == str(profile.model.block_size - 1)
    assert flags["--max_batch_size"] == str(profile.engine.max_batch_size)
    assert flags["--max_num_tokens"] == str(profile.engine.max_num_tokens)
    assert flags["--gemm_plugin"] == profile.engine.gemm_plugin
    assert flags["--use_fp8_context_fmha"] == "enable" and flags["--speculative_decoding_mode"] == "eagle"
    lines = out.splitlines()
    seq, k = profile.engine.max_seq_len, profile.model.block_size - 1
    note = lines[lines.index(f"    {commands['engine']}") + 1]  # why config.json will record more than the profile
    assert note.startswith(f"    # --max_seq_len {seq}: the engine records max_seq_len {seq + 2 * k} = {seq} + 2 x {k}")
    assert not ws.exists(), "a dry run writes nothing"


def test_dry_runs_name_only_flags_trtllm_build_accepts(hub: Path, tmp_path: Path, capsys):
    accepted = _trtllm_build_flags()
    for path in PROFILES:
        assert (
            cli_main(
                [
                    "build",
                    "--config",
                    str(path),
                    "--hf_cache",
                    str(hub),
                    "--output_dir",
                    str(tmp_path / path.stem),
                    "--dry_run",
                ]
            )
            == 0
        )
        _, *build = shlex.split(_stage_commands(capsys.readouterr().out)["engine"])
        assert {a for a in build if a.startswith("--")} <= accepted, path


def test_typed_flags_override_the_profile(hub: Path, tmp_path: Path, capsys):
    path = ROOT / "build_configs/h200-fp8/qwen3-8b.yaml"
    assert (
        cli_main(
            [
                "build",
                "--config",
                str(path),
                "--hf_cache",
                str(hub),
                "--output_dir",
                str(tmp_path / "ws"),
                "--max_batch_size",
                "64",
                "--dry_run",
            ]
        )
        == 0
    )
    build = shlex.split(_stage_commands(capsys.readouterr().out)["engine"])
    assert build[build.index("--max_batch_size") + 1] == "64"


def test_missing_models_are_not_downloaded(tmp_path: Path, capsys):
    path = ROOT / "build_configs/h100-fp8/qwen3-4b.yaml"
    assert (
        cli_main(["build", "--config", str(path), "--hf_cache", str(tmp_path), "--output_dir", str(tmp_path / "ws")])
        == 2
    )
    assert "Qwen/Qwen3-4B is not in the HF cache" in capsys.readouterr().err
    assert not (tmp_path / "ws").exists()


@pytest.fixture
def fresh_machine(tmp_path: Path, monkeypatch) -> Path:
    """An empty HF home and no network: what a new user has before downloading anything."""
    home = tmp_path / "hf_home"
    home.mkdir()
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "DFLASH_TRT_PLUGIN_LIB"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("socket.socket.connect", _no_network)
    return home


def _no_network(*args, **kwargs):
    raise OSError("network access attempted during a dry run")


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_dry_run_of_every_profile_on_a_fresh_machine(path: Path, fresh_machine: Path, tmp_path: Path, capsys):
    profile = load_profile(path)
    ws = tmp_path / "ws"
    assert cli_main(["build", "--config", str(path), "--output_dir", str(ws), "--dry_run"]) == 0
    out = capsys.readouterr().out
    commands = _stage_commands(out)
    assert list(commands) == ["checkpoint", "engine", "triton"]
    convert = shlex.split(commands["checkpoint"])
    assert convert[convert.index("--model_dir") + 1] == profile.model.target  # resolved in the cache at run time
    assert convert[convert.index("--calib_dataset") + 1] == str(path.parent / "../calibration.jsonl")
    _, *build = shlex.split(commands["engine"])
    flags = {build[i]: build[i + 1] for i in range(1, len(build) - 1) if build[i].startswith("--")}
    assert flags["--max_draft_len"] == str(profile.model.block_size - 1)
    assert flags["--max_batch_size"] == str(profile.engine.max_batch_size)
    assert flags["--checkpoint_dir"] == str(ws / "checkpoint")
    # What 1.2.x's builder would settle is written out, whether or not the drafter's shapes are known yet.
    quant = profile.quantization
    fp8_attention = quant.qformat in ("fp8", "nvfp4") and quant.kv_cache_dtype == "fp8"
    assert flags["--use_fp8_context_fmha"] == ("enable" if fp8_attention else "disable")
    assert flags["--gemm_plugin"] == ("nvfp4" if quant.qformat == "nvfp4" else profile.engine.gemm_plugin)
    offline = [line for line in out.splitlines() if line.startswith("offline: ")]
    assert (
        f"offline: target {profile.model.target}: not downloaded; planned from its recorded config.json "
        "fields" in offline
    )
    drafter = RECORDED[profile.model.draft]
    if "unknown" in drafter:
        assert any(
            line.startswith(f"offline: drafter {profile.model.draft}: not downloaded and its shapes are unknown")
            for line in offline
        )
    else:
        assert (
            f"offline: drafter {profile.model.draft}: not downloaded; planned from its recorded config.json "
            "fields" in offline
        )
    assert not ws.exists() and not any(fresh_machine.iterdir()), "a dry run writes and downloads nothing"


def test_offline_dry_run_applies_the_checks_to_recorded_configs(fresh_machine: Path, tmp_path: Path, capsys):
    data = yaml.safe_load((ROOT / "build_configs/h200-fp8/qwen3-8b.yaml").read_text())
    data["model"]["recorded_configs"] = str(RECORDED_PATH)
    data["quantization"]["calibration"]["dataset"] = str(ROOT / "build_configs/calibration.jsonl")
    data["engine"]["max_seq_len"] = 50000  # beyond Qwen3-8B's recorded max_position_embeddings 40960
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(data))
    assert cli_main(["build", "--config", str(path), "--output_dir", str(tmp_path / "ws"), "--dry_run"]) == 2
    assert "past the 40960 rows of the target's max_position_embeddings RoPE tables" in capsys.readouterr().err
    data["engine"]["max_seq_len"] = 8192
    data["model"]["recorded_configs"] = None  # nothing recorded: the dry run says what to do
    path.write_text(yaml.safe_dump(data))
    assert cli_main(["build", "--config", str(path), "--output_dir", str(tmp_path / "ws"), "--dry_run"]) == 2
    assert "records no configs (model.recorded_configs)" in capsys.readouterr().err


def test_offline_dry_run_with_a_separate_tokenizer(fresh_machine: Path, tmp_path: Path, capsys):
    data = yaml.safe_load((ROOT / "build_configs/b200-nvfp4/qwen3-4b.yaml").read_text())
    data["model"].update(tokenizer="acme/qwen3-chat-tokenizer", recorded_configs=str(RECORDED_PATH))
    data["quantization"]["calibration"]["dataset"] = str(ROOT / "build_configs/calibration.jsonl")
    path = tmp_path / "tok.yaml"
    path.write_text(yaml.safe_dump(data))
    assert cli_main(["build", "--config", str(path), "--output_dir", str(tmp_path / "ws"), "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "offline: tokenizer acme/qwen3-chat-tokenizer: not downloaded" in out
    triton = shlex.split(_stage_commands(out)["triton"])
    assert triton[triton.index("--tokenizer_dir") + 1] == "acme/qwen3-chat-tokenizer"


def test_recorded_configs_parse_as_the_converter_reads_them():
    from dflash_trt.spec import parse_draft_config, parse_target_config

    for path in PROFILES:
        profile = load_profile(path)
        target = parse_target_config(RECORDED[profile.model.target])
        if "unknown" not in RECORDED[profile.model.draft]:
            draft = parse_draft_config(RECORDED[profile.model.draft], target)
            assert draft.block_size == profile.model.block_size and draft.num_hidden_layers == 5, path


# ---------------------------------------------------------------- a real run on CPU with a tiny pair


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    return make_pair(tmp_path_factory.mktemp("pair"), PairVariant())


BUILT, SKIPPED, NEEDS_GPU = Outcome.BUILT, Outcome.SKIPPED, Outcome.NEEDS_GPU


def _run(profile: Path, ws: Path, gpu: bool) -> tuple[list[StageResult], str]:
    """The stages' results and the command that resumes the build."""
    request = PipelineRequest(str(profile), str(ws), plugin_library="/opt/dflash/libdflash_trt_plugins.so")
    inp = resolve_inputs(request)
    return run_pipeline(stages(inp), gpu=gpu), resume_command(inp)


def _outcomes(results: list[StageResult]) -> list[tuple[str, Outcome]]:
    return [(r.stage.name, r.outcome) for r in results]


def test_cpu_run_stops_after_the_checkpoint_and_resumes(tiny_pair, tmp_path: Path, monkeypatch):
    profile = tiny_profile(tmp_path, tiny_pair)
    ws = tmp_path / "ws"
    results, resume = _run(profile, ws, gpu=False)
    assert _outcomes(results) == [("checkpoint", BUILT), ("engine", NEEDS_GPU)]
    assert json.loads((ws / "checkpoint/config.json").read_text())["max_draft_len"] == 7
    assert resume.startswith(f"dflash-trt build --config {profile} --output_dir {ws} --plugin_library /opt/dflash/")
    # The tiny pair's auto schedule keeps the full draft at every batch: the roofline is weight-bound throughout.
    engine = (
        "DFLASH_TRT_PLUGIN_LIB=/opt/dflash/libdflash_trt_plugins.so DFLASH_TRT_TARGET_SM=90 "
        f"DFLASH_TRT_DRAFT_LEN_SCHEDULE=none trtllm-build --checkpoint_dir {ws}"
    )
    assert results[1].stage.command.startswith(engine)

    results, _ = _run(profile, ws, gpu=False)
    assert _outcomes(results) == [("checkpoint", SKIPPED), ("engine", NEEDS_GPU)]

    (ws / "checkpoint/rank0.safetensors").unlink()  # damaged output: redone
    results, _ = _run(profile, ws, gpu=False)
    assert results[0].state is StageState.INCOMPLETE and results[0].outcome is BUILT
    assert (ws / "checkpoint/rank0.safetensors").is_file()

    data = yaml.safe_load(profile.read_text())
    data["checkpoint"] = {"dtype": "float16"}  # changed settings: stale, redone
    profile.write_text(yaml.safe_dump(data))
    results, _ = _run(profile, ws, gpu=False)
    assert results[0].state is StageState.STALE and results[0].outcome is BUILT
    assert json.loads((ws / "checkpoint/config.json").read_text())["dtype"] == "float16"


def test_gpu_run_builds_engine_and_repository_once(tiny_pair, tmp_path: Path, monkeypatch):
    """The engine stage's trtllm-build is replaced by a writer of what it leaves behind (config.json + manifest):
    this checks the pipeline's bookkeeping, not TensorRT-LLM."""
    calls: list[str] = []

    def fake_engine_build(plan, overwrite=False):
        calls.append(plan.output_dir)
        out = Path(plan.output_dir)
        out.mkdir(parents=True, exist_ok=overwrite)
        (out / "config.json").write_text(json.dumps({"build_config": plan.build_config}))
        (out / MANIFEST_NAME).write_text(json.dumps(plan.dflash_manifest))
        return out

    monkeypatch.setattr("dflash_trt.trtllm.build.run_engine_build", fake_engine_build)
    profile = tiny_profile(tmp_path, tiny_pair)
    ws = tmp_path / "ws"
    results, _ = _run(profile, ws, gpu=True)
    assert _outcomes(results) == [("checkpoint", BUILT), ("engine", BUILT), ("triton", BUILT)]
    params = (ws / "triton/tensorrt_llm/config.pbtxt").read_text()
    assert f'"gpt_model_path" value {{ string_value: "{(ws / "engine").absolute()}" }}' in params
    assert '"eagle_choices" value { string_value: "{0}, {0, 0}, {0, 0, 0}' in params

    results, _ = _run(profile, ws, gpu=True)
    assert [r.outcome for r in results] == [SKIPPED] * 3 and len(calls) == 1

    data = yaml.safe_load(profile.read_text())
    data["serving"]["instance_count"] = 2  # a serving knob only touches the repository
    profile.write_text(yaml.safe_dump(data))
    results, _ = _run(profile, ws, gpu=True)
    assert _outcomes(results) == [("checkpoint", SKIPPED), ("engine", SKIPPED), ("triton", BUILT)]

    data["engine"]["max_batch_size"] = 2  # an engine knob rebuilds the engine and what follows
    data["sweep"]["concurrency"] = [1, 2]
    profile.write_text(yaml.safe_dump(data))
    results, _ = _run(profile, ws, gpu=True)
    assert _outcomes(results) == [("checkpoint", SKIPPED), ("engine", BUILT), ("triton", BUILT)] and len(calls) == 2
    assert json.loads((ws / "engine" / MANIFEST_NAME).read_text())["max_batch_size"] == 2

    data["engine"]["draft_len_schedule"] = "2:3"  # a table: built into the engine, recorded by the repository
    profile.write_text(yaml.safe_dump(data))
    results, _ = _run(profile, ws, gpu=True)
    assert _outcomes(results) == [("checkpoint", SKIPPED), ("engine", BUILT), ("triton", BUILT)]
    assert json.loads((ws / "engine" / MANIFEST_NAME).read_text())["draft_len_schedule"] == "2:3"
    assert json.loads((ws / "triton/dflash_triton.json").read_text())["draft_len_schedule"] == "2:3"


def test_build_needs_a_checkpoint_or_a_profile(tmp_path: Path, capsys):
    assert cli_main(["build", "--dry_run"]) == 2
    assert "give --checkpoint_dir and --output_dir, or a build profile with --config" in capsys.readouterr().err
    path = ROOT / "build_configs/h100-fp8/qwen3-4b.yaml"
    assert cli_main(["build", "--config", str(path), "--checkpoint_dir", str(tmp_path), "--dry_run"]) == 2
    assert "--checkpoint_dir does not combine with --config" in capsys.readouterr().err
