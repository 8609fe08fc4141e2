"""Build profiles: every shipped one validates; each impossible combination fails with its own message."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from dflash_trt.analysis.gpus import GPUS
from dflash_trt.errors import DFlashTrtError
from dflash_trt.pipeline.profiles import (
    check_against_checkpoints,
    load_profile,
    parse_profile,
    resolve_model_dir,
)

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "build_configs").glob("*/*.yaml"))
GPU_DIRS = {"h100-fp8", "h200-fp8", "b200-nvfp4", "b300-nvfp4"}
MODELS = {"qwen3-4b", "qwen3-8b", "llama-3.1-8b-instruct", "qwen3-32b"}


# Qwen3-Coder-30B-A3B (mixture of experts) is FP8 on every GPU: 1.2.x cannot load NVFP4 experts from a checkpoint.
MOE_DIRS = {"h100-fp8", "h200-fp8", "b200-fp8", "b300-fp8"}


def test_the_full_matrix_is_shipped():
    dense = {(g, m) for g in GPU_DIRS for m in MODELS}
    assert {(p.parent.name, p.stem) for p in SHIPPED} == dense | {(g, "qwen3-coder-30b-a3b") for g in MOE_DIRS}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_profile_validates(path: Path):
    profile = load_profile(path)
    gpu_name, quant = path.parent.name.split("-")
    assert profile.name == f"{path.parent.name}-{path.stem}"
    assert profile.gpu == gpu_name
    assert profile.quantization.qformat == profile.quantization.dflash_qformat == quant
    assert profile.engine.gemm_plugin == quant
    assert profile.engine.max_draft_len == profile.model.block_size - 1
    # Room for a full batch of generation steps plus a whole prompt, with or without chunked context.
    eng = profile.engine
    assert eng.max_num_tokens >= eng.max_batch_size * profile.model.block_size + eng.max_input_len
    assert profile.sweep.concurrency[-1] == profile.engine.max_batch_size
    assert profile.engine.draft_len_schedule == "auto"  # derived for the profile's GPU, TP and format
    # One B200/B300 holds Qwen3-32B in NVFP4; two H100/H200 hold it in FP8 with room for KV.
    assert profile.checkpoint.tp_size == (2 if path.stem == "qwen3-32b" and gpu_name in ("h100", "h200") else 1)
    # A comment explains every non-obvious value: at least the quantization and engine sizing ones.
    text = path.read_text()
    assert text.count("#") >= 10


def _base() -> dict:
    return yaml.safe_load((ROOT / "build_configs/b300-nvfp4/qwen3-8b.yaml").read_text())


def _with(changes: dict) -> dict:
    data = copy.deepcopy(_base())
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return data


INVALID = [
    ({"gpu": "h100"}, "p.yaml: qformat is nvfp4, which needs Blackwell (SM100 or newer); h100 is SM90"),
    (
        {
            "gpu": "h200",
            "quantization.qformat": "fp8",
            "engine.gemm_plugin": "fp8",
            "quantization.dflash_qformat": "nvfp4",
        },
        "dflash_qformat is nvfp4, which needs Blackwell (SM100 or newer); h200 is SM90",
    ),
    (
        {"gpu": "a100", "quantization.qformat": "fp8", "engine.gemm_plugin": "fp8"},
        "gpu: must be one of h100, h200, b200, b300, got 'a100'",
    ),
    ({"quantization.draft_qformat": "nvfp4"}, "quantization.draft_qformat: Extra inputs are not permitted"),
    ({"engine.max_draft_len": 16}, "max_draft_len 16 exceeds block_size - 1 = 15"),
    ({"engine.max_draft_len": 7}, "max_draft_len 7 is below block_size - 1 = 15"),
    ({"quantization.dflash_qformat": "fp8"}, "dflash_qformat fp8 differs from qformat nvfp4"),
    (
        {"engine.max_num_tokens": 8192, "serving.enable_chunked_context": True},
        "max_num_tokens 8192 is below max_batch_size x block_size + one 32-token context chunk = 8224",
    ),
    (
        {"engine.max_num_tokens": 8224},
        "max_num_tokens 8224 is below max_batch_size x block_size + one max_input_len prompt (4096) = 12288",
    ),
    ({"checkpoint.tp_size": 3}, "tp_size must be 1, 2, 4 or 8, got 3"),
    ({"engine.gemm_plugin": "fp8"}, "gemm_plugin fp8 needs fp8 weights, but they are nvfp4"),
    ({"quantization.kv_cache_dtype": "none"}, "use_fp8_context_fmha needs kv_cache_dtype fp8"),
    # What TensorRT-LLM 1.2.x's builder would override or cannot run (builder.py, attentionOp.cpp).
    ({"engine.use_fp8_context_fmha": False}, "use_fp8_context_fmha cannot be off with nvfp4 weights"),
    ({"engine.gemm_plugin": "bfloat16"}, "gemm_plugin bfloat16 with nvfp4 weights"),
    (
        {
            "gpu": "h100",
            "quantization.qformat": "none",
            "quantization.dflash_qformat": "none",
            "engine.gemm_plugin": "auto",
            "engine.use_fp8_context_fmha": None,
        },
        "an FP8 KV cache needs fp8 or nvfp4 weights",
    ),  # fmt: skip
    ({"engine.use_paged_context_fmha": False}, "EAGLE-mode engines need --use_paged_context_fmha enable"),
    (
        {"engine.max_batch_size": 1024, "engine.max_num_tokens": 16384},
        "--max_batch_size must lie in [1, 512] for EAGLE-mode engines",
    ),
    ({"engine.max_input_len": 8193}, "--max_input_len must be at least 1 and at most --max_seq_len"),
    ({"sweep.concurrency": [1, 4, 2]}, "concurrency must be positive and strictly increasing"),
    ({"sweep.interactivity_band": [600, 400]}, "interactivity_band must be (low, high)"),
    ({"engine.max_batch_size": 128, "sweep.concurrency": [1, 256]}, "sweep concurrency 256 exceeds max_batch_size 128"),
    ({"engine.max_seqlen": 4}, "engine.max_seqlen: Extra inputs are not permitted"),
    ({"quantization.qformat": "int8"}, "quantization.qformat: must be one of none, fp8, nvfp4, got 'int8'"),
    ({"engine.draft_len_schedule": "1:8,16:9"}, "engine.draft_len_schedule: must be auto, none or N1:K1,N2:K2"),
    ({"engine.draft_len_schedule": 7}, "engine.draft_len_schedule: Input should be a valid string"),
    (
        {"engine.draft_len_schedule": "1:16"},
        "engine.draft_len_schedule 1:16 verifies 16 drafts per request but the engine verifies at most 15",
    ),
]


@pytest.mark.parametrize("changes,message", INVALID, ids=[m[:40] for _, m in INVALID])
def test_impossible_combination_is_rejected(changes: dict, message: str):
    with pytest.raises(DFlashTrtError) as err:
        parse_profile(_with(changes), "p.yaml")
    assert message in str(err.value)
    assert str(err.value).startswith("p.yaml: ")


def test_a_profiles_engine_follows_the_builds_rules_and_defaults():
    """One rule set: what `build` accepts (a prompt as long as max_seq_len, as trtllm-build allows) a profile
    accepts, and an engine setting a profile leaves out takes the build's default."""
    from dflash_trt.trtllm.build_settings import EngineBuildSettings

    full = parse_profile(_with({"engine.max_input_len": 8192, "engine.max_num_tokens": 16384}), "p.yaml").engine
    assert full.max_input_len == full.max_seq_len == 8192
    data = _base()
    for name in ("use_fp8_context_fmha", "multiple_profiles"):
        data["engine"].pop(name, None)
    engine = parse_profile(data, "p.yaml").engine.build_settings()
    defaults = EngineBuildSettings()
    assert (engine.multiple_profiles, engine.use_fp8_context_fmha) == (
        defaults.multiple_profiles,
        defaults.use_fp8_context_fmha,
    )


def test_recorded_configs_default_to_the_packaged_file():
    packaged = ROOT / "dflash_trt/assets/recorded_configs.yaml"
    assert parse_profile(_base(), "d/p.yaml").recorded_configs_path("d/p.yaml") == packaged
    named = parse_profile(_with({"model.recorded_configs": "mine.yaml"}), "d/p.yaml")
    assert named.recorded_configs_path("d/p.yaml") == Path("d/mine.yaml")
    assert parse_profile(_with({"model.recorded_configs": None}), "d/p.yaml").recorded_configs_path("d/p.yaml") is None


def test_load_profile_reports_missing_file_and_bad_yaml(tmp_path: Path):
    with pytest.raises(DFlashTrtError, match="does not exist"):
        load_profile(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(DFlashTrtError, match="not valid YAML"):
        load_profile(bad)
    bad.write_text("- a list\n")
    with pytest.raises(DFlashTrtError, match="must be a YAML mapping"):
        load_profile(bad)


def test_gpu_facts_match_hardware():
    assert (GPUS["h100"].sm, GPUS["h200"].sm, GPUS["b200"].sm, GPUS["b300"].sm) == (90, 90, 100, 103)
    assert [g for g, f in GPUS.items() if f.nvfp4_flops] == ["b200", "b300"]


def _write_config(path: Path, **cfg) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "vocab_size": 151936,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
}
DRAFTER = {**QWEN3_32B, "architectures": ["DFlashDraftModel"], "num_hidden_layers": 5}


def _pair(tmp_path: Path, *, heads=64, kv=8, d_heads=32, d_kv=8, block=16, max_pos=40960):
    target = _write_config(
        tmp_path / "t", num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max_pos, **QWEN3_32B
    )
    draft = _write_config(
        tmp_path / "d",
        num_attention_heads=d_heads,
        num_key_value_heads=d_kv,
        block_size=block,
        dflash_config={"mask_token_id": 1, "target_layer_ids": [1, 2, 3, 4, 5]},
        **DRAFTER,
    )
    return target, draft


def _tp8_profile():
    data = yaml.safe_load((ROOT / "build_configs/h200-fp8/qwen3-32b.yaml").read_text())
    data["checkpoint"]["tp_size"] = 8
    return parse_profile(data)


def test_checkpoint_checks_accept_a_matching_pair(tmp_path: Path):
    profile = load_profile(ROOT / "build_configs/h200-fp8/qwen3-32b.yaml")
    check_against_checkpoints(profile, *_pair(tmp_path))
    check_against_checkpoints(_tp8_profile(), *_pair(tmp_path))


@pytest.mark.parametrize(
    "pair,message",
    [
        ({"heads": 36, "kv": 4}, "target: 36 attention heads cannot be split over tp_size 8"),
        ({"kv": 12, "heads": 48}, "target: 12 KV heads cannot be split or replicated over tp_size 8"),
        ({"d_heads": 20, "d_kv": 4}, "drafter: 20 attention heads cannot be split over tp_size 8"),
        ({"block": 10}, "was sized for block_size 16 but"),
    ],
)
def test_checkpoint_checks_reject(tmp_path: Path, pair: dict, message: str):
    profile = _tp8_profile()
    with pytest.raises(DFlashTrtError, match=message.replace("(", r"\(")):
        check_against_checkpoints(profile, *_pair(tmp_path, **pair))


def test_weights_must_fit_the_gpu(tmp_path: Path):
    data = yaml.safe_load((ROOT / "build_configs/h100-fp8/qwen3-32b.yaml").read_text())
    data["quantization"].update(qformat="none", dflash_qformat="none", kv_cache_dtype="none")
    data["engine"]["gemm_plugin"] = "auto"
    del data["engine"]["use_fp8_context_fmha"]  # the builder's own choice: off without FP8 weights
    data["checkpoint"]["tp_size"] = 1
    unquantized = parse_profile(data)
    # 64 layers x (attention 94.4M + MLP 393.2M) + 5 drafter layers + fc = 33.6B linear weights at 2 bytes,
    # plus untied embeddings and lm_head 2 x 151936 x 5120 at 2 bytes: 70.5 GB > 0.8 x 85.5 GB (81559 MiB).
    with pytest.raises(DFlashTrtError, match="the weights need about 70 GB per GPU but h100 has 86 GB"):
        check_against_checkpoints(unquantized, *_pair(tmp_path))
    data["quantization"].update(qformat="fp8", dflash_qformat="fp8", kv_cache_dtype="fp8")
    data["engine"]["gemm_plugin"] = "fp8"
    check_against_checkpoints(parse_profile(data), *_pair(tmp_path))  # FP8: 36.7 GB fits one H100


def test_block_size_nested_in_dflash_config_is_read(tmp_path: Path):
    profile = load_profile(ROOT / "build_configs/b200-nvfp4/qwen3-4b.yaml")
    target = _write_config(tmp_path / "t", num_attention_heads=32, num_key_value_heads=8, **QWEN3_32B)
    draft = _write_config(
        tmp_path / "d",
        num_attention_heads=32,
        num_key_value_heads=8,
        dflash_config={"block_size": 8, "mask_token_id": 1},
        **DRAFTER,
    )
    with pytest.raises(DFlashTrtError, match="trained with block_size 8"):
        check_against_checkpoints(profile, target, draft)


def _fake_hub(cache: Path, repo: str, revs: list[str], main: str | None) -> None:
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    for rev in revs:
        _write_config(repo_dir / "snapshots" / rev, rev=rev)
    if main:
        (repo_dir / "refs").mkdir(parents=True)
        (repo_dir / "refs" / "main").write_text(main + "\n")


def test_resolve_model_dir_uses_the_hf_cache_layout(tmp_path: Path):
    cache = tmp_path / "hub"
    _fake_hub(cache, "z-lab/Qwen3-8B-DFlash-b16", ["aaa", "bbb"], main="bbb")
    got = resolve_model_dir("z-lab/Qwen3-8B-DFlash-b16", cache_dir=cache)
    assert got == cache / "models--z-lab--Qwen3-8B-DFlash-b16/snapshots/bbb"
    pinned = resolve_model_dir("z-lab/Qwen3-8B-DFlash-b16", revision="aaa", cache_dir=cache)
    assert json.loads((pinned / "config.json").read_text())["rev"] == "aaa"


def test_resolve_model_dir_prefers_paths_and_never_downloads_unasked(tmp_path: Path, monkeypatch):
    local = _write_config(tmp_path / "Qwen" / "Qwen3-8B")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("Qwen/Qwen3-8B", cache_dir=tmp_path / "empty") == Path("Qwen/Qwen3-8B")
    assert resolve_model_dir(str(local)) == local
    with pytest.raises(DFlashTrtError, match="is not in the HF cache .* --download"):
        resolve_model_dir("Qwen/Qwen3-4B", cache_dir=tmp_path / "empty")
    with pytest.raises(DFlashTrtError, match="does not exist"):
        resolve_model_dir("./missing/dir/here")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _fake_hub(tmp_path / "hub", "Qwen/Qwen3-4B", ["only"], main=None)
    assert resolve_model_dir("Qwen/Qwen3-4B").name == "only"


def test_nvfp4_with_float16_is_one_rule_for_profiles_convert_and_build(tmp_path: Path, capsys):
    """TensorRT-LLM 1.2.x's FP4 GEMM plugin writes float, half or bfloat16 outputs (read in its sources), and the
    NVFP4 quantizer is exact for float16 weights: profiles, convert and build all accept the pair."""
    from dflash_trt.cli import main
    from dflash_trt.commands.demo import write_calibration_prompts
    from dflash_trt.tiny.heldout import draft_dir, target_dir

    assert parse_profile(_with({"checkpoint": {"dtype": "float16"}}), "p.yaml").checkpoint.dtype == "float16"
    calibration = write_calibration_prompts(tmp_path / "calib.jsonl", count=4)
    checkpoint = tmp_path / "ckpt"
    convert = ["convert", "--model_dir", str(target_dir()), "--dflash_model_dir", str(draft_dir()),
               "--output_dir", str(checkpoint), "--dtype", "float16", "--qformat", "nvfp4",
               "--calib_dataset", str(calibration), "--calib_size", "4"]  # fmt: skip
    assert main(convert) == 0
    build = ["build", "--checkpoint_dir", str(checkpoint), "--output_dir", str(tmp_path / "engine"),
             "--max_batch_size", "8", "--max_input_len", "128", "--max_seq_len", "211", "--max_num_tokens", "512",
             "--gpu", "b300", "--dry_run", "--json"]  # fmt: skip
    capsys.readouterr()
    assert main(build) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["dflash_manifest"]["quant_algo"] == "NVFP4"
    # builder.build() would turn `auto` into nvfp4 for NVFP4 weights: the command says so itself.
    assert plan["command"][plan["command"].index("--gemm_plugin") + 1] == "nvfp4"
    assert json.loads((checkpoint / "config.json").read_text())["dtype"] == "float16"
    hopper = [*build[: build.index("--gpu") + 1], "h100", "--dry_run", "--json"]
    assert main(hopper) == 2
    assert "the checkpoint's quantization is nvfp4, which needs Blackwell (SM100 or newer); h100 is SM90" in (
        capsys.readouterr().err
    )
