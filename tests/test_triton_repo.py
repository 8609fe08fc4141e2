"""Triton repository: every config.pbtxt parses with Triton's own protobuf schema, the ensemble is wired end to end,
pre/post-processing round-trips a real tokenizer, the launch script preloads the plugin, and the client speaks the
real gRPC protocol to a loopback server."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import numpy as np
import pytest
import yaml
from google.protobuf import text_format
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dflash_trt.cli import main as cli_main
from dflash_trt.errors import DFlashTrtError
from dflash_trt.pipeline import settings_from_profile
from dflash_trt.profiles import load_profile, parse_profile
from dflash_trt.triton import client as triton_client
from dflash_trt.triton import processing as P
from dflash_trt.triton.repository import (
    CLIENT_FILE,
    LAUNCH_SCRIPT,
    PROCESSING_FILE,
    SETTINGS_FILE,
    RepositorySettings,
    settings_from_engine,
    write_repository,
)
from dflash_trt.triton.serving import ServingSettings

mc = pytest.importorskip("tritonclient.grpc.model_config_pb2")
ROOT = Path(__file__).resolve().parents[1]
EOS, PAD, IM_END = "<|end|>", "<|pad|>", "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A real byte-level BPE tokenizer, trained here in milliseconds, saved the way HF checkpoints ship one."""
    d = tmp_path_factory.mktemp("tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS, PAD, IM_END], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog", "speculative decoding drafts a block"] * 20, trainer
    )
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": PAD})
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return d


def _settings(tokenizer_dir: Path, **changes) -> RepositorySettings:
    base = dict(
        engine_dir="/engines/qwen3-8b",
        tokenizer_dir=str(tokenizer_dir),
        plugin_library="/opt/lib/x.so",
        max_batch_size=64,
        max_input_len=4096,
        max_draft_len=15,
        world_size=1,
        max_temperature=0.0,
    )
    return RepositorySettings(**{**base, **changes})


def _parse(path: Path):
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def _configs(repo: Path) -> dict:
    return {d.name: _parse(d / "config.pbtxt") for d in sorted(repo.iterdir()) if (d / "config.pbtxt").is_file()}


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
    configs = _configs(repo)
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
    configs = _configs(repo)
    params = _params(configs["tensorrt_llm"])
    assert params["decoding_mode"] == "eagle"
    assert (params["enable_chunked_context"], params["enable_kv_cache_reuse"]) == ("false", "false")
    assert configs["tensorrt_llm_bls"].instance_group[0].count == prof.serving.instance_count < 8
    assert configs["preprocessing"].instance_group[0].count == prof.serving.instance_count
    assert configs["postprocessing"].instance_group[0].count == 1  # it holds split characters in its own memory
    assert not configs["postprocessing"].HasField("dynamic_batching")


def test_paths_written_into_configs_are_absolute(tmp_path: Path, tokenizer_dir: Path, monkeypatch):
    """The backend refuses a relative gpt_model_path; Triton runs elsewhere than where the repository was made."""
    monkeypatch.chdir(tmp_path)
    tokenizer = Path(os.path.relpath(tokenizer_dir, tmp_path))
    repo = write_repository(
        _settings(tokenizer, engine_dir="demo_out/engine", plugin_library="plugins/build/libdflash_trt_plugins.so"),
        tmp_path / "repo",
    )
    configs = _configs(repo)
    assert _params(configs["tensorrt_llm"])["gpt_model_path"] == str(tmp_path / "demo_out/engine")
    for name in ("tensorrt_llm", "preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert _params(configs[name])["tokenizer_dir"] == str(tokenizer_dir), name
    recorded = json.loads((repo / SETTINGS_FILE).read_text())
    assert recorded["plugin_library"] == str(tmp_path / "plugins/build/libdflash_trt_plugins.so")
    assert f"DEFAULT_PLUGIN='{tmp_path}/plugins/build/libdflash_trt_plugins.so'" in (repo / LAUNCH_SCRIPT).read_text()


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--kv_cache_free_gpu_mem_fraction", "5", "--kv_cache_free_gpu_mem_fraction: Input should be less than 1"),
        (
            "--kv_cache_free_gpu_mem_fraction",
            "nan",
            "--kv_cache_free_gpu_mem_fraction: Input should be a finite number",
        ),
        ("--kv_cache_free_gpu_mem_fraction", "0", "--kv_cache_free_gpu_mem_fraction: Input should be greater than 0"),
        ("--instance_count", "0", "--instance_count: Input should be greater than or equal to 1"),
    ],
)
def test_cli_overrides_are_checked_by_the_profile_schema(
    tmp_path: Path, tokenizer_dir: Path, capsys, flag: str, value: str, message: str
):
    engine = _engine_dir(tmp_path / "eng")
    profile = ROOT / "build_configs/b200-nvfp4/qwen3-4b.yaml"
    for source in (["--engine_dir", str(engine)], ["--config", str(profile), "--work_dir", str(tmp_path / "ws")]):
        out = tmp_path / "repo"
        assert (
            cli_main(["triton", *source, "--tokenizer_dir", str(tokenizer_dir), "--output_dir", str(out), flag, value])
            == 2
        )
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
        assert not out.exists()


def test_repository_settings_refuse_kv_block_reuse_however_built(tokenizer_dir: Path):
    with pytest.raises(DFlashTrtError, match="enable_kv_cache_reuse: must stay false"):
        _settings(tokenizer_dir, enable_kv_cache_reuse=True)


def test_serving_settings_refuse_an_attention_window(tokenizer_dir: Path):
    with pytest.raises(DFlashTrtError, match="max_attention_window_size: must stay unset .* makes the KV cache cyclic"):
        _settings(tokenizer_dir, max_attention_window_size=4096)
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

    repo = write_repository(_settings(tokenizer_dir), tmp_path / "repo")
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
    write_repository(_settings(tokenizer_dir), tmp_path / "repo")
    with pytest.raises(DFlashTrtError, match="already exists"):
        write_repository(_settings(tokenizer_dir), tmp_path / "repo")
    write_repository(_settings(tokenizer_dir, max_draft_len=9), tmp_path / "repo", overwrite=True)
    params = _params(_configs(tmp_path / "repo")["tensorrt_llm"])
    assert len(parse_eagle_choices(params["eagle_choices"])) == 9


def _engine_dir(path: Path, **manifest) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"build_config": {"max_batch_size": 128, "max_input_len": 2048}}))
    base = {
        "max_batch_size": 128,
        "max_draft_len": 9,
        "tp_size": 2,
        "plugin_library": "/p/lib.so",
        "max_temperature": 0.0,
    }
    (path / "dflash_trt.json").write_text(json.dumps({**base, **manifest}))
    return path


def test_settings_from_engine_reads_the_manifest(tmp_path: Path, tokenizer_dir: Path):
    s = settings_from_engine(_engine_dir(tmp_path / "eng"), tokenizer_dir, ServingSettings(instance_count=3))
    assert (s.max_batch_size, s.max_input_len, s.max_draft_len, s.world_size) == (128, 2048, 9, 2)
    assert (s.plugin_library, s.instance_count, s.max_temperature) == ("/p/lib.so", 3, 0.0)
    with pytest.raises(DFlashTrtError, match="not a DFlash engine directory"):
        settings_from_engine(tmp_path, tokenizer_dir)
    broken = tmp_path / "broken"
    _engine_dir(broken)
    (broken / "dflash_trt.json").write_text(json.dumps({"max_batch_size": 1}))
    with pytest.raises(DFlashTrtError, match="lacks 'plugin_library'"):
        settings_from_engine(broken, tokenizer_dir)


def test_cli_writes_a_repository_from_an_engine_and_from_a_profile(tmp_path: Path, tokenizer_dir: Path, capsys):
    engine = _engine_dir(tmp_path / "eng")
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
    assert _params(_configs(tmp_path / "r1")["tensorrt_llm"])["gpt_model_path"] == str(engine.absolute())
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
    configs = _configs(tmp_path / "r2")
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


# ---------------------------------------------------------------- pre/post-processing with a real tokenizer


@pytest.fixture(scope="module")
def pre(tokenizer_dir: Path) -> P.Preprocessor:
    return P.Preprocessor.from_dir(str(tokenizer_dir), add_special_tokens=False, max_input_len=32, max_temperature=0.0)


def decode_word_list(row: np.ndarray) -> list[list[int]]:
    """The backend's convertWordList: the second half of the flattened [2, L] row holds end offsets until -1."""
    flat = row.reshape(-1).tolist()
    ids, offsets = flat[: len(flat) // 2], flat[len(flat) // 2 :]
    words, start = [], 0
    for end in offsets:
        if end == -1:
            break
        words.append(ids[start:end])
        start = end
    return words


def _request(texts: list[str], **extra) -> dict:
    inputs = {
        P.QUERY: np.array([[t.encode()] for t in texts], dtype=object),
        P.REQUEST_OUTPUT_LEN: np.array([[8]] * len(texts), dtype=np.int32),
    }
    inputs.update(extra)
    return inputs


def test_preprocess_tokenizes_like_the_tokenizer(pre: P.Preprocessor):
    tok = pre.tokenizer
    texts = ["the quick brown fox", "a block é"]
    out = pre.preprocess(_request(texts))
    expected = [tok.encode(t, add_special_tokens=False) for t in texts]
    assert out[P.REQUEST_INPUT_LEN].tolist() == [[len(e)] for e in expected]
    for row, length, e in zip(out[P.INPUT_ID], out[P.REQUEST_INPUT_LEN][:, 0], expected, strict=True):
        assert row[:length].tolist() == e and (row[length:] == pre.pad_id).all()
    assert out[P.INPUT_ID].dtype == np.int32 and out[P.OUT_REQUEST_OUTPUT_LEN].tolist() == [[8], [8]]
    assert out[P.OUT_END_ID].tolist() == [[tok.convert_tokens_to_ids(EOS)]] * 2
    assert out[P.OUT_PAD_ID].tolist() == [[tok.convert_tokens_to_ids(PAD)]] * 2


def test_stop_and_bad_words_use_trtllm_word_lists(pre: P.Preprocessor):
    tok = pre.tokenizer
    stops = np.array([[b"lazy dog", b"fox"], [b"block", b""]], dtype=object)
    out = pre.preprocess(_request(["the fox", "a block"], **{P.STOP_WORDS: stops}))
    assert out[P.STOP_WORDS_IDS].shape[:2] == (2, 2)
    im_end = tok.convert_tokens_to_ids(IM_END)  # generation_config's second eos id becomes a stop word
    first = decode_word_list(out[P.STOP_WORDS_IDS][0])
    assert first == [
        tok.encode("lazy dog", add_special_tokens=False),
        tok.encode("fox", add_special_tokens=False),
        [im_end],
    ]
    assert decode_word_list(out[P.STOP_WORDS_IDS][1]) == [tok.encode("block", add_special_tokens=False), [im_end]]
    assert [decode_word_list(r) for r in out[P.BAD_WORDS_IDS]] == [[], []]
    assert tok.decode(first[0]) == "lazy dog"


def test_bad_words_are_refused_empty_ones_accepted(pre: P.Preprocessor):
    """The EAGLE decoding mode bans no words: a request sending some is refused rather than silently unbanned."""
    empty = np.array([[b""], [b""]], dtype=object)
    out = pre.preprocess(_request(["the fox", "a block"], **{P.BAD_WORDS: empty}))
    assert [decode_word_list(r) for r in out[P.BAD_WORDS_IDS]] == [[], []]
    bad = np.array([[b""], [b"fox"]], dtype=object)
    with pytest.raises(ValueError, match="^bad_words refused: it bans words, which TensorRT-LLM's EAGLE decoding mode"):
        pre.preprocess(_request(["the fox", "a block"], **{P.BAD_WORDS: bad}))


def test_explicit_end_and_pad_ids_pass_through(pre: P.Preprocessor):
    out = pre.preprocess(
        _request(["the dog"], **{P.END_ID: np.array([[7]], np.int32), P.PAD_ID: np.array([[9]], np.int32)})
    )
    assert (out[P.OUT_END_ID].tolist(), out[P.OUT_PAD_ID].tolist()) == ([[7]], [[9]])


def test_sampling_requests_are_refused_greedy_accepted(pre: P.Preprocessor, tokenizer_dir: Path):
    with pytest.raises(ValueError, match="temperature 0.7 refused: this DFlash engine verifies drafts greedily"):
        pre.preprocess(_request(["the dog"], **{P.TEMPERATURE: np.array([[0.7]], np.float32)}))
    pre.preprocess(_request(["the dog"], **{P.TEMPERATURE: np.array([[0.0]], np.float32)}))
    lossless = P.Preprocessor.from_dir(
        str(tokenizer_dir), add_special_tokens=False, max_input_len=32, max_temperature=float("inf")
    )
    lossless.preprocess(_request(["the dog"], **{P.TEMPERATURE: np.array([[0.7]], np.float32)}))


def test_bad_prompts_are_refused(pre: P.Preprocessor):
    with pytest.raises(ValueError, match="empty prompt"):
        pre.preprocess(_request([""]))
    with pytest.raises(ValueError, match="the engine accepts at most 32"):
        pre.preprocess(_request(["the quick brown fox jumps over the lazy dog " * 8]))
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        pre.preprocess(_request(["the dog"], **{P.REQUEST_OUTPUT_LEN: np.array([[0]], np.int32)}))


def test_postprocess_detokenizes_streamed_chunks(pre: P.Preprocessor, tokenizer_dir: Path):
    post = P.Postprocessor.from_dir(str(tokenizer_dir), skip_special_tokens=True)
    tok = pre.tokenizer
    ids = tok.encode("speculative decoding é", add_special_tokens=False) + [tok.convert_tokens_to_ids(EOS)]
    padded = np.array([[ids + [5, 5]]], dtype=np.int32)  # [batch, beam, L] with junk past the length
    out = post.postprocess({P.TOKENS_BATCH: padded, P.SEQUENCE_LENGTH: np.array([[len(ids)]], np.int32)})
    assert out[P.OUTPUT].shape == (1, 1) and out[P.OUTPUT][0, 0].decode() == "speculative decoding é"
    two_d = post.postprocess({P.TOKENS_BATCH: np.array([ids[:3]], np.int32), P.SEQUENCE_LENGTH: np.array([3])})
    assert two_d[P.OUTPUT][0, 0].decode() == tok.decode(ids[:3])


# ---------------------------------------------------------------- launch script


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
        _settings(tokenizer_dir, plugin_library=str(plugin), world_size=world_size), tmp_path / "repo"
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


# ---------------------------------------------------------------- client over the real gRPC protocol

TYPE_TO_WIRE = {
    "TYPE_STRING": "BYTES",
    "TYPE_INT32": "INT32",
    "TYPE_BOOL": "BOOL",
    "TYPE_FP32": "FP32",
    "TYPE_UINT64": "UINT64",
}


def _bytes_tensor(values: list[bytes]) -> bytes:
    return b"".join(len(v).to_bytes(4, "little") + v for v in values)


def _loopback_server(ensemble, pieces: list[str]):
    grpc = pytest.importorskip("grpc")
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    seen: list = []
    declared = {t.name: (mc.DataType.Name(t.data_type), list(t.dims), t.optional) for t in ensemble.input}

    def response(request, outputs, final=False):
        resp = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        for name, wire, shape, raw in outputs:
            resp.outputs.add(name=name, datatype=wire, shape=shape)
            resp.raw_output_contents.append(raw)
        if final:
            resp.parameters["triton_final_response"].bool_param = True
        return service_pb2.ModelStreamInferResponse(infer_response=resp)

    class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        def ServerLive(self, request, context):
            return service_pb2.ServerLiveResponse(live=True)

        def ModelStreamInfer(self, request_iterator, context):
            for request in request_iterator:
                seen.append(request)
                names = [t.name for t in request.inputs]
                for t in request.inputs:  # every input is declared by the ensemble, with its type and [1, dims]
                    dtype, dims, _ = declared[t.name]
                    assert t.datatype == TYPE_TO_WIRE[dtype] and len(t.shape) == 1 + len(dims)
                    assert all(d in (-1, n) for d, n in zip(dims, t.shape[1:], strict=True))
                assert {n for n, (_, _, opt) in declared.items() if not opt} <= set(names)
                for piece in pieces:
                    yield response(request, [("text_output", "BYTES", [1, 1], _bytes_tensor([piece.encode()]))])
                yield response(
                    request,
                    [
                        ("acceptance_rate", "FP32", [1, 1], np.array([0.6], np.float32).tobytes()),
                        ("total_accepted_draft_tokens", "INT32", [1, 1], np.array([27], np.int32).tobytes()),
                        ("total_draft_tokens", "INT32", [1, 1], np.array([45], np.int32).tobytes()),
                    ],
                )
                yield response(request, [], final=True)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, seen


def test_client_streams_text_and_acceptance(tmp_path: Path, tokenizer_dir: Path):
    repo = write_repository(_settings(tokenizer_dir), tmp_path / "repo")
    ensemble = _configs(repo)["ensemble"]
    server, port, seen = _loopback_server(ensemble, ["Draft", "ing é", "!"])
    try:
        chunks: list[str] = []
        gen = triton_client.stream_generate(
            f"127.0.0.1:{port}",
            "the fox",
            16,
            temperature=0.7,
            stop_words=["dog"],
            on_text=chunks.append,
            timeout_s=30,
            seed=42,
        )
    finally:
        server.stop(0)
    assert gen.errors == [] and gen.text == "Drafting é!" and chunks == ["Draft", "ing é", "!"]
    assert (gen.acceptance_rate, gen.accepted_draft_tokens, gen.draft_tokens) == (pytest.approx(0.6), 27, 45)
    request = seen[0]
    assert request.model_name == "ensemble"
    sent = {t.name: raw for t, raw in zip(request.inputs, request.raw_input_contents, strict=True)}
    assert sent["text_input"] == _bytes_tensor([b"the fox"]) and sent["stop_words"] == _bytes_tensor([b"dog"])
    assert np.frombuffer(sent["max_tokens"], np.int32).tolist() == [16]
    assert np.frombuffer(sent["random_seed"], np.uint64).tolist() == [42]
    assert np.frombuffer(sent["temperature"], np.float32).tolist() == [pytest.approx(0.7)]
    assert sent["stream"] == b"\x01" and sent["return_perf_metrics"] == b"\x01"
    # 45 drafted tokens over steps of 15 drafts = 3 steps; (27 accepted + 3 bonus) / 3 = 10 tokens per step.
    assert "mean acceptance length 10.00" in triton_client.summary(gen, 15)
    assert triton_client.acceptance_length_from_counts(27, 45, 15) == pytest.approx(10.0)


def test_client_main_reads_draft_len_from_the_repository(tmp_path: Path, tokenizer_dir: Path, capsys, monkeypatch):
    repo = write_repository(_settings(tokenizer_dir, max_draft_len=9), tmp_path / "repo")
    server, port, _ = _loopback_server(_configs(repo)["ensemble"], ["ok"])
    spec = importlib.util.spec_from_file_location("repo_client", repo / CLIENT_FILE)
    copied = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "repo_client", copied)
    try:
        spec.loader.exec_module(copied)
        rc = copied.main(["--url", f"127.0.0.1:{port}", "--prompt", "hi"])
    finally:
        server.stop(0)
    captured = capsys.readouterr()
    assert rc == 0 and captured.out == "ok\n"
    # 45 drafted / 9 per step = 5 steps: (27 + 5) / 5 = 6.4
    assert "mean acceptance length 6.40" in captured.err


# ---------------------------------------------------------------- the Python models' glue


class _StandInPbUtils:
    """The slice of Triton's `triton_python_backend_utils` API the two model.py files call, recording responses.
    Triton itself is not involved: this checks that model.py reads the parameters and tensors its config.pbtxt
    declares and routes errors into the response."""

    class Tensor:
        def __init__(self, name, array):
            self._name, self._array = name, array

        def name(self):
            return self._name

        def as_numpy(self):
            return self._array

    class TritonError:
        def __init__(self, message):
            self.message = message

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.outputs = {t.name(): t.as_numpy() for t in output_tensors}
            self.error = error

        def has_error(self):
            return self.error is not None

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    engine_responses: list[dict] = []  # what the stand-in tensorrt_llm streams back to a BLS request
    llm_requests: list = []

    class InferenceRequest:
        def __init__(self, model_name, inputs, requested_output_names):
            self.model_name, self.requested = model_name, requested_output_names
            self.inputs = {t.name(): t.as_numpy() for t in inputs}
            _StandInPbUtils.llm_requests.append(self)

        async def async_exec(self, decoupled):
            assert decoupled  # the python backend answers with a blocking iterator over the responses
            return iter(
                _StandInPbUtils.InferenceResponse([_StandInPbUtils.Tensor(k, v) for k, v in outputs.items()])
                for outputs in _StandInPbUtils.engine_responses
            )

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return _StandInPbUtils.Tensor(name, request[name]) if name in request else None

    @staticmethod
    def get_output_tensor_by_name(response, name):
        return _StandInPbUtils.Tensor(name, response.outputs[name]) if name in response.outputs else None


class _Sender:
    def __init__(self):
        self.sent: list = []

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))


class _BlsRequest(dict):
    def __init__(self, tensors: dict):
        super().__init__(tensors)
        self.sender = _Sender()

    def get_response_sender(self):
        return self.sender


def _load_model(repo: Path, name: str, monkeypatch):
    from google.protobuf import json_format

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _StandInPbUtils)
    monkeypatch.syspath_prepend(str(repo / name / "1"))
    monkeypatch.delitem(sys.modules, "dflash_processing", raising=False)
    spec = importlib.util.spec_from_file_location(f"{name}_model", repo / name / "1/model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = json_format.MessageToJson(_parse(repo / name / "config.pbtxt"), preserving_proto_field_name=True)
    model = module.TritonPythonModel()
    model.initialize({"model_config": config})
    return model


def test_python_models_run_their_configs(tmp_path: Path, tokenizer_dir: Path, monkeypatch):
    repo = write_repository(_settings(tokenizer_dir, max_input_len=6), tmp_path / "repo")
    pre = _load_model(repo, "preprocessing", monkeypatch)
    ok, hot, long = (
        _request(["the fox"]),
        _request(["the fox"], **{P.TEMPERATURE: np.array([[1.0]], np.float32)}),
        _request(["the quick brown fox jumps over the lazy dog"]),
    )
    responses = pre.execute([ok, hot, long])
    declared = {t.name for t in _configs(repo)["preprocessing"].output}
    assert responses[0].error is None and set(responses[0].outputs) == declared
    assert "temperature 1 refused" in responses[1].error.message
    assert "accepts at most 6" in responses[2].error.message
    post = _load_model(repo, "postprocessing", monkeypatch)
    ids = responses[0].outputs[P.INPUT_ID]
    chunk = {P.TOKENS_BATCH: ids[:, None, :], P.SEQUENCE_LENGTH: np.array([[ids.shape[1]]])}
    [done] = post.execute([_IdentifiedRequest(chunk, "")])
    assert done.outputs[P.OUTPUT][0, 0] == b"the fox"


class _IdentifiedRequest(dict):
    """A request's tensors and the client's request id, which the ensemble copies onto each composing request."""

    def __init__(self, tensors: dict, request_id: str):
        super().__init__(tensors)
        self.id = request_id

    def request_id(self) -> str:
        return self.id


def _post_chunk(post, ids: list[int], request_id: str) -> str:
    chunk = {P.TOKENS_BATCH: np.array([[ids]], np.int32), P.SEQUENCE_LENGTH: np.array([[len(ids)]], np.int32)}
    [response] = post.execute([_IdentifiedRequest(chunk, request_id)])
    return response.outputs[P.OUTPUT][0, 0].decode("utf-8")


def test_postprocessing_holds_a_split_character_back_per_request_id(
    tmp_path: Path, tokenizer_dir: Path, pre: P.Preprocessor, monkeypatch
):
    repo = write_repository(_settings(tokenizer_dir), tmp_path / "repo")
    post = _load_model(repo, "postprocessing", monkeypatch)
    texts = {"a": "drafts é 日本 block 🚀 done", "b": "naïve 数据 🙂 café"}
    ids = {rid: pre.tokenizer.encode(text, add_special_tokens=False) for rid, text in texts.items()}
    pieces: dict[str, list[str]] = {"a": [], "b": []}
    for step in range(max(len(v) for v in ids.values())):  # two requests' one-token chunks, interleaved
        for rid, row in ids.items():
            if step < len(row):
                pieces[rid].append(_post_chunk(post, row[step : step + 1], rid))
    for rid, text in texts.items():
        assert "".join(pieces[rid]) == text and not any("\ufffd" in p for p in pieces[rid])
        assert "" in pieces[rid]  # a lead byte was held back until its continuation arrived
    anonymous = [_post_chunk(post, ids["a"][i : i + 1], "") for i in range(len(ids["a"]))]
    assert any("\ufffd" in p for p in anonymous)  # without a request id each chunk is decoded on its own


def test_stream_detokenizer_never_splits_a_character(pre: P.Preprocessor):
    tok = pre.tokenizer
    text = "drafts é 日本 block 🚀 done"
    ids = tok.encode(text, add_special_tokens=False)
    detok = P.StreamDetokenizer(tok, skip_special_tokens=True)
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # byte-level tokens of multi-byte characters were held back
    naive = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in naive)  # what decoding each chunk alone would have printed


def _dtype_name(array: np.ndarray) -> str:
    return {
        np.dtype(np.int32): "TYPE_INT32",
        np.dtype(np.float32): "TYPE_FP32",
        np.dtype(bool): "TYPE_BOOL",
        np.dtype(object): "TYPE_STRING",
    }[array.dtype]


def test_bls_model_streams_whole_characters_to_the_engine_interface(tmp_path: Path, tokenizer_dir: Path, monkeypatch):
    repo = write_repository(_settings(tokenizer_dir), tmp_path / "repo")
    configs = _configs(repo)
    bls = _load_model(repo, "tensorrt_llm_bls", monkeypatch)
    tok = bls.preprocessor.tokenizer
    answer = "a block é 日本"
    ids = tok.encode(answer, add_special_tokens=False)
    chunks = [ids[i : i + 3] for i in range(0, len(ids), 3)]  # blocks of accepted tokens, split mid-character
    _StandInPbUtils.engine_responses = [
        {"output_ids": np.array([[c]], np.int32), "sequence_length": np.array([[len(c)]], np.int32)} for c in chunks
    ] + [
        {
            "acceptance_rate": np.array([[0.5]], np.float32),
            "total_accepted_draft_tokens": np.array([[3]], np.int32),
            "total_draft_tokens": np.array([[6]], np.int32),
        }
    ]
    _StandInPbUtils.llm_requests = []
    request = _BlsRequest(
        {
            "text_input": np.array([[b"the fox"]], object),
            "max_tokens": np.array([[16]], np.int32),
            "stream": np.array([[True]]),
            "return_perf_metrics": np.array([[True]]),
        }
    )
    assert asyncio.run(bls.execute([request])) is None
    [llm] = _StandInPbUtils.llm_requests
    trt = {t.name: t for t in configs["tensorrt_llm"].input}
    assert llm.model_name == "tensorrt_llm" and set(llm.inputs) <= set(trt)
    assert {n for n, t in trt.items() if not t.optional} <= set(llm.inputs)
    for name, array in llm.inputs.items():  # [batch, *dims] with the declared type
        assert _dtype_name(array) == mc.DataType.Name(trt[name].data_type), name
        assert array.ndim == 1 + len(trt[name].dims), name
    assert set(llm.requested) <= {o.name for o in configs["tensorrt_llm"].output}
    responses = [r for r, _ in request.sender.sent if r is not None]
    text = "".join(r.outputs["text_output"][0, 0].decode() for r in responses if "text_output" in r.outputs)
    assert text == answer and all(r.error is None for r in responses)
    assert responses[-2].outputs["total_draft_tokens"].tolist() == [[6]]
    last, flags = request.sender.sent[-1]  # the final flag closes the stream, on an empty response
    assert (last.outputs, flags) == ({}, 1) and all(f == 0 for _, f in request.sender.sent[:-1])

    hot = _BlsRequest(
        {
            "text_input": np.array([[b"the fox"]], object),
            "max_tokens": np.array([[4]], np.int32),
            "temperature": np.array([[0.9]], np.float32),
        }
    )
    asyncio.run(bls.execute([hot]))
    [(error_response, flags)] = hot.sender.sent
    assert "temperature 0.9 refused" in error_response.error.message and flags == 1


# ---------------------------------------------------------------- sampling parameters (engines with exact sampling)


@pytest.fixture(scope="module")
def sampler(tokenizer_dir: Path) -> P.Preprocessor:
    return P.Preprocessor.from_dir(
        str(tokenizer_dir), add_special_tokens=False, max_input_len=32, max_temperature=float("inf")
    )


def test_temperature_reaches_the_engine_and_defaults_to_greedy(sampler: P.Preprocessor):
    """Without a temperature the runtime would sample at its default of 1.0, so preprocessing always sends one."""
    out = sampler.preprocess(_request(["the dog", "the fox"]))
    assert out[P.OUT_TEMPERATURE].tolist() == [[0.0], [0.0]] and out[P.OUT_TEMPERATURE].dtype == np.float32
    hot = sampler.preprocess(_request(["the dog", "the fox"], **{P.TEMPERATURE: np.array([[0.7], [0.0]], np.float32)}))
    assert hot[P.OUT_TEMPERATURE].tolist() == [[pytest.approx(0.7)], [0.0]]


@pytest.mark.parametrize(
    "name, value, dtype",
    [
        ("top_k", 40, np.int32),
        ("top_p", 0.9, np.float32),
        ("repetition_penalty", 1.2, np.float32),
        ("presence_penalty", 0.5, np.float32),
        ("frequency_penalty", 0.5, np.float32),
        ("length_penalty", 2.0, np.float32),
        ("min_tokens", 5, np.int32),
        ("beam_width", 4, np.int32),
        ("num_return_sequences", 2, np.int32),
    ],
)
def test_unsupported_sampling_parameters_are_refused(sampler: P.Preprocessor, name: str, value, dtype):
    neutral = {
        "top_k": 0,
        "top_p": 1.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "length_penalty": 1.0,
        "min_tokens": 1,
        "beam_width": 1,
        "num_return_sequences": 1,
    }[name]
    sampler.preprocess(_request(["a", "b"], **{name: np.array([[neutral], [neutral]], dtype)}))
    with pytest.raises(ValueError, match=f"^{name} .* refused: a DFlash engine samples with temperature and seed"):
        sampler.preprocess(_request(["a", "b"], **{name: np.array([[neutral], [value]], dtype)}))


def test_every_sampling_input_has_a_rule():
    from dflash_trt.sampling_rules import NEUTRAL

    assert set(P.SAMPLING_INPUTS) <= set(NEUTRAL)


def test_top_k_one_is_greedy_only(sampler: P.Preprocessor):
    sampler.preprocess(_request(["a"], top_k=np.array([[1]], np.int32)))
    with pytest.raises(ValueError, match="top_k 1 refused"):
        sampler.preprocess(
            _request(["a"], top_k=np.array([[1]], np.int32), **{P.TEMPERATURE: np.array([[0.5]], np.float32)})
        )
    with pytest.raises(ValueError, match="temperature -1.0 refused: it must be a finite number >= 0"):
        sampler.preprocess(_request(["a"], **{P.TEMPERATURE: np.array([[-1.0]], np.float32)}))


def test_settings_from_an_exact_sampling_engine_take_any_temperature(tmp_path: Path, tokenizer_dir: Path):
    engine = _engine_dir(tmp_path / "eng", sampling="exact_match")
    assert settings_from_engine(engine, tokenizer_dir).max_temperature == float("inf")


def test_bls_sends_temperature_and_seed_and_refuses_top_p(tmp_path: Path, tokenizer_dir: Path, monkeypatch):
    """Inside Triton dflash_trt may be absent: the models use the rules file copied next to them."""
    monkeypatch.setitem(sys.modules, "dflash_trt.sampling_rules", None)
    repo = write_repository(_settings(tokenizer_dir, max_temperature=float("inf")), tmp_path / "repo")
    bls = _load_model(repo, "tensorrt_llm_bls", monkeypatch)
    assert sys.modules["dflash_processing"].sampling_refusal.__module__ == "dflash_sampling_rules"
    assert sys.modules["dflash_processing"].encode_chat.__module__ == "dflash_chat"  # chats work there too

    def refuse(name: str):
        raise ValueError(f"not strict JSON: {name}")

    # Strict JSON: "any temperature" is null, not Infinity.
    assert json.loads((repo / "dflash_triton.json").read_text(), parse_constant=refuse)["max_temperature"] is None
    _StandInPbUtils.engine_responses, _StandInPbUtils.llm_requests = [], []
    request = _BlsRequest(
        {
            "text_input": np.array([[b"the fox"]], object),
            "max_tokens": np.array([[4]], np.int32),
            "temperature": np.array([[0.8]], np.float32),
            "random_seed": np.array([[1234]], np.uint64),
        }
    )
    asyncio.run(bls.execute([request]))
    [llm] = _StandInPbUtils.llm_requests
    assert llm.inputs["temperature"].tolist() == [[pytest.approx(0.8)]]
    assert llm.inputs["random_seed"].tolist() == [[1234]]
    refused = _BlsRequest(
        {
            "text_input": np.array([[b"the fox"]], object),
            "max_tokens": np.array([[4]], np.int32),
            "top_p": np.array([[0.5]], np.float32),
        }
    )
    asyncio.run(bls.execute([refused]))
    [(error, flags)] = refused.sender.sent
    assert error.error.message.startswith("top_p 0.5 refused") and flags == 1
    pre = _load_model(repo, "preprocessing", monkeypatch)
    [response] = pre.execute([_request(["the fox"], top_k=np.array([[3]], np.int32))])
    assert response.error.message.startswith("top_k 3 refused")


def test_triton_json_output_is_strict_json(tmp_path: Path, tokenizer_dir: Path, capsys):
    """An exact-sampling engine takes any temperature: `--json` says so with null, never Infinity."""
    engine = _engine_dir(tmp_path / "eng", sampling="exact_match")
    argv = ["triton", "--engine_dir", str(engine), "--tokenizer_dir", str(tokenizer_dir),
            "--output_dir", str(tmp_path / "repo"), "--json"]  # fmt: skip
    assert cli_main(argv) == 0

    def refuse(name: str):
        raise ValueError(f"not strict JSON: {name}")

    printed = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert printed["max_temperature"] is None and printed["chat_template_kwargs"] == "{}"
