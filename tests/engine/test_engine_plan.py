"""Engine build planning: the trtllm-build command, BuildConfig, chain constants and every refusal, on CPU.

Expected values are hand-derived from the TensorRT-LLM 1.2.x sources cited in docs/engine.md (builder.build(),
commands/build.py, PluginConfig, EagleForCausalLM.prepare_inputs), not from the code under test.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from _engine_checkpoints import DRAFT_HF, TARGET_HF, write_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

import dflash_trt.trtllm as trtllm_package
from dflash_trt.checkpoint.trtllm_config import checkpoint_config, specs_from_config
from dflash_trt.commands import build as build_command
from dflash_trt.draft_schedule import DraftLenSchedule
from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.loop_rules import built_engine_longest_request
from dflash_trt.spec import parse_draft_config, parse_target_config
from dflash_trt.trtllm.attention_route import TARGET_SM_ENV
from dflash_trt.trtllm.build import run_engine_build
from dflash_trt.trtllm.build_plan import plan_engine_build
from dflash_trt.trtllm.build_settings import EngineBuildSettings
from dflash_trt.trtllm.eagle_layout import block_packed_mask, chain_draft_paths, chain_eagle_choices
from dflash_trt.trtllm.network_environment import SCHEDULE_ENV, TREE_ENV, engine_tree_nodes


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "ckpt")


def flag_values(command: list[str]) -> dict[str, str]:
    return {command[i]: command[i + 1] for i in range(1, len(command) - 1) if command[i].startswith("--")}


def test_command_is_the_exact_trtllm_build_call(ckpt: Path, tmp_path: Path):
    plan = plan_engine_build(ckpt, tmp_path / "engine", EngineBuildSettings(), plugin_library="/opt/lib.so")
    assert plan.command[0] == "trtllm-build"
    flags = flag_values(plan.command)
    assert flags["--checkpoint_dir"] == str(ckpt)
    assert flags["--output_dir"] == str(tmp_path / "engine")
    assert flags["--model_cls_name"] == "DFlashForCausalLM"
    assert Path(flags["--model_cls_file"]) == Path(trtllm_package.__file__).with_name("model.py")
    assert Path(flags["--model_cls_file"]).is_file()
    assert flags["--speculative_decoding_mode"] == "eagle"
    assert flags["--max_draft_len"] == "15"  # block_size 16 - 1
    assert flags["--kv_cache_type"] == "paged"
    assert flags["--use_paged_context_fmha"] == "enable"
    assert flags["--max_beam_width"] == "1"
    assert flags["--workers"] == "1"
    assert flags["--logits_dtype"] == "float32"
    assert shlex.split(plan.shell_command()) == ["DFLASH_TRT_DRAFT_LEN_SCHEDULE=none", *plan.command]
    assert plan.plugin_library == "/opt/lib.so"


def test_build_config_matches_what_trtllm_build_passes(ckpt: Path, tmp_path: Path):
    settings = EngineBuildSettings(max_batch_size=8, max_seq_len=2048, max_input_len=1024, max_num_tokens=4096)
    config = plan_engine_build(ckpt, tmp_path / "e", settings).build_config
    assert config["max_draft_len"] == 15
    assert config["speculative_decoding_mode"] == 32  # SpeculativeDecodingMode.EAGLE: sixth IntFlag auto() member
    assert config["max_batch_size"] == 8 and config["max_seq_len"] == 2048 and config["max_num_tokens"] == 4096
    assert config["kv_cache_type"] == "PAGED"
    assert config["plugin_config"]["paged_kv_cache"] is True
    assert config["plugin_config"]["use_paged_context_fmha"] is True
    assert config["plugin_config"]["tokens_per_block"] == 32
    assert config["gather_context_logits"] is False


def test_manifest_records_what_runners_need(ckpt: Path, tmp_path: Path):
    settings = EngineBuildSettings(max_seq_len=2048, max_input_len=1024)
    manifest = plan_engine_build(ckpt, tmp_path / "e", settings, plugin_library="/x.so").dflash_manifest
    assert manifest["block_size"] == 16 and manifest["max_draft_len"] == 15
    assert manifest["target_layer_ids"] == [1, 4] and manifest["mask_token_id"] == 999
    assert manifest["draft_kv_layer_offset"] == 6
    assert manifest["eagle_choices"] == [[0] * d for d in range(1, 16)]
    assert manifest["sampling"] == "exact_match" and manifest["honoured_sampling_parameters"] == ["temperature", "seed"]
    # builder.build(): max_seq_len += max_draft_len (15), then += num_eagle_layers (15 for one chain)
    assert manifest["max_seq_len"] == 2048 + 15 + 15
    assert manifest["plugin_library"] == "/x.so" and manifest["plugin_namespace"] == "dflash_trt"


def test_chain_choices_and_paths():
    assert chain_eagle_choices(3) == [[0], [0, 0], [0, 0, 0]]
    assert chain_draft_paths(3) == [[0, 1, 2, 3], [-1] * 4, [-1] * 4, [-1] * 4]
    k = 15
    paths = np.array(chain_draft_paths(k))
    assert paths.shape == (k + 1, k + 1)  # [max_draft_len + 1, num_eagle_layers + 1] as prepare_inputs declares


def unpack(words: list[list[int]], width: int) -> np.ndarray:
    bits = np.array(words, dtype=np.int64) & 0xFFFFFFFF
    out = np.zeros((len(words), width), dtype=bool)
    for q in range(len(words)):
        for key in range(width):
            out[q, key] = (bits[q, key // 32] >> (key % 32)) & 1
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=2, max_value=80), st.booleans())
def test_packed_mask_round_trips(block_size: int, causal: bool):
    packed = block_packed_mask(block_size, causal)
    assert len(packed) == block_size and all(len(row) == -(-block_size // 32) for row in packed)
    assert all(-(2**31) <= w < 2**31 for row in packed for w in row)  # fits the int32 engine input
    expected = np.tril(np.ones((block_size, block_size), bool)) if causal else np.ones((block_size, block_size), bool)
    np.testing.assert_array_equal(unpack(packed, block_size), expected)


def test_packed_mask_known_words():
    assert block_packed_mask(16, causal=False) == [[0xFFFF]] * 16
    assert block_packed_mask(32, causal=False)[0] == [-1]
    assert block_packed_mask(4, causal=True) == [[0b1], [0b11], [0b111], [0b1111]]


def test_refuses_draft_kv_geometry_unlike_the_target(tmp_path: Path):
    draft = {**DRAFT_HF, "num_key_value_heads": 4}
    ckpt = write_checkpoint(tmp_path / "c", draft_hf=draft)
    with pytest.raises(DFlashTrtError, match="KV geometry"):
        plan_engine_build(ckpt, tmp_path / "e", EngineBuildSettings())
    draft = {**DRAFT_HF, "head_dim": 128}
    ckpt = write_checkpoint(tmp_path / "d", draft_hf=draft)
    with pytest.raises(DFlashTrtError, match=r"2 kv heads x 128\) differs from the target's \(2 x 64\)"):
        plan_engine_build(ckpt, tmp_path / "e", EngineBuildSettings())


def test_refuses_drafter_quantized_unlike_the_target(tmp_path: Path):
    target = parse_target_config(TARGET_HF)
    draft = parse_draft_config({**DRAFT_HF, "num_attention_heads": 8}, target)  # 4 q per KV head: 64 XQA rows
    fp8 = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "group_size": 16, "exclude_modules": ["lm_head"]}
    root = tmp_path / "q"
    root.mkdir()
    (root / "rank0.safetensors").touch()
    (root / "config.json").write_text(json.dumps(checkpoint_config(target, draft, "bfloat16", quantization=fp8)))
    with pytest.raises(DFlashTrtError, match=r"one engine applies one quantization"):
        plan_engine_build(root, tmp_path / "e", EngineBuildSettings())
    (root / "config.json").write_text(
        json.dumps(checkpoint_config(target, draft, "bfloat16", quantization=fp8, draft_quantization=fp8))
    )
    plan = plan_engine_build(root, tmp_path / "e", EngineBuildSettings(use_fp8_context_fmha=True))
    assert plan.dflash_manifest["quant_algo"] == "FP8" and plan.dflash_manifest["kv_cache_quant_algo"] == "FP8"


# Keys TensorRT-LLM 1.2.x reads per rotary scaling type (layers/attention.py: yarn's .get() calls;
# functional.py RopeEmbeddingUtils: factor, and apply_llama3_scaling's four keys), plus yarn's `truncate` that the
# golden model reads; None-valued parameters must be absent, since `.get(key, default)` returns a present None.
ROPE_KEYS = {
    "linear": ({"rope_type": "linear", "factor": 2.0}, {"type", "factor"}),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    ),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        {"type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate"},
    ),
}


@pytest.mark.parametrize("rope_type", sorted(ROPE_KEYS))
def test_rotary_scaling_carries_only_the_keys_its_type_uses(tmp_path: Path, rope_type: str):
    scaling, keys = ROPE_KEYS[rope_type]
    ckpt = write_checkpoint(
        tmp_path / "c", {**TARGET_HF, "rope_scaling": scaling}, {**DRAFT_HF, "rope_scaling": scaling}
    )
    config = json.loads((ckpt / "config.json").read_text())
    for rotary in (config["rotary_scaling"], config["dflash_config"]["rotary_scaling"]):
        assert set(rotary) == keys and None not in rotary.values()
        assert rotary["type"] == rope_type and rotary["factor"] == scaling["factor"]
    target, draft = specs_from_config(config)
    assert target.rope == parse_target_config({**TARGET_HF, "rope_scaling": scaling}).rope  # nothing lost
    assert plan_engine_build(ckpt, tmp_path / "e", EngineBuildSettings()).command


def test_refuses_yarn_parameters_trtllm_does_not_read(tmp_path: Path):
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "attention_factor": 1.2}
    ckpt = write_checkpoint(
        tmp_path / "c", {**TARGET_HF, "rope_scaling": scaling}, {**DRAFT_HF, "rope_scaling": scaling}
    )
    assert json.loads((ckpt / "config.json").read_text())["rotary_scaling"]["attention_factor"] == 1.2
    with pytest.raises(DFlashTrtError, match="attention_factor or truncate=false"):
        plan_engine_build(ckpt, tmp_path / "e", EngineBuildSettings())


def test_a_drafter_with_its_own_rope_builds_but_its_yarn_is_checked_too(tmp_path: Path):
    """The drafter gets its own RoPE tables (model.py); its yarn parameters face the same 1.2.x table builder."""
    ckpt = write_checkpoint(tmp_path / "c", draft_hf={**DRAFT_HF, "rope_theta": 10000.0})
    assert plan_engine_build(ckpt, tmp_path / "e", EngineBuildSettings()).checkpoint_dir == str(ckpt.resolve())
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    ckpt = write_checkpoint(tmp_path / "y", draft_hf={**DRAFT_HF, "rope_scaling": {**yarn, "truncate": False}})
    with pytest.raises(DFlashTrtError, match="the drafter's yarn RoPE sets attention_factor or truncate=false"):
        plan_engine_build(ckpt, tmp_path / "e2", EngineBuildSettings())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_num_tokens": 100, "max_batch_size": 8}, r"max_batch_size x \(drafts \+ 1\) = 8 x 16 = 128"),
        ({"max_beam_width": 2}, "max_beam_width 1"),
        ({"max_batch_size": 513, "max_num_tokens": 513 * 16}, r"\[1, 512\]"),
        ({"workers": 0}, "--workers must be at least 1"),
        ({"use_paged_context_fmha": False}, "use_paged_context_fmha"),
        ({"kv_cache_type": "continuous"}, "paged"),
        ({"logits_dtype": "bfloat16"}, "float32 or float16"),
        ({"gemm_plugin": "int4"}, "--gemm_plugin"),
        ({"max_input_len": 9000}, "max_input_len"),
        ({"tokens_per_block": 24}, "tokens_per_block"),
        (
            {"tokens_per_block": 8},
            "--tokens_per_block must be one of 16, 32, 64, 128: speculative decoding generates through XQA",
        ),
        (
            {"max_seq_len": 40960 - 44},
            r"reaches position 40960, past the 40960 rows .* --max_seq_len <= 40915",
        ),
        ({"gemm_plugin": "fp8"}, "gemm_plugin fp8 needs fp8 weights, but they are none"),
        ({"gemm_plugin": "nvfp4"}, "gemm_plugin nvfp4 needs nvfp4 weights, but they are none"),
        ({"use_fp8_context_fmha": True}, "needs kv_cache_dtype fp8 and fp8 or nvfp4 weights"),
        ({"max_batch_size": 2, "max_seq_len": 64, "max_input_len": 32, "max_num_tokens": 129}, "clip it to"),
    ],
)
def test_refuses_settings_the_runtime_would_reject(ckpt: Path, tmp_path: Path, change: dict, message: str):
    with pytest.raises(DFlashTrtError, match=message):
        plan_engine_build(ckpt, tmp_path / "e", replace(EngineBuildSettings(), **change))


def test_refuses_a_checkpoint_missing_rank_files(tmp_path: Path, capsys):
    ckpt = write_checkpoint(tmp_path / "tp2", mapping={"world_size": 2, "tp_size": 2, "pp_size": 1})
    assert plan_engine_build(ckpt, tmp_path / "e", EngineBuildSettings()).command
    (ckpt / "rank1.safetensors").unlink()
    with pytest.raises(DFlashTrtError, match=r"lacks rank1.safetensors \(tp_size 2\)"):
        plan_engine_build(ckpt, tmp_path / "e", EngineBuildSettings())


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--gemm_plugin", "nvfp4"], "gemm_plugin nvfp4 needs nvfp4 weights"),
        (["--max_seq_len", "50000", "--max_input_len", "1024"], "past the 40960 rows of the target's"),
        (["--tokens_per_block", "8"], "--tokens_per_block must be one of 16, 32, 64, 128"),
    ],
)
def test_checkpoint_dir_dry_run_applies_the_profile_checks(ckpt: Path, tmp_path: Path, capsys, argv, message):
    """`build --dry_run --checkpoint_dir` refuses what a profile-driven build refuses (one set of checks)."""
    from dflash_trt.cli import main as cli_main

    assert (
        cli_main(["build", "--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "e"), *argv, "--dry_run"]) == 2
    )
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_max_num_tokens_boundary(ckpt: Path, tmp_path: Path):
    ok = EngineBuildSettings(max_batch_size=8, max_num_tokens=128)
    assert plan_engine_build(ckpt, tmp_path / "e", ok).build_config["max_num_tokens"] == 128


SLIDING_DRAFT = {
    **DRAFT_HF,
    "use_sliding_window": True,
    "sliding_window": 4096,
    "layer_types": ["full_attention", "sliding_attention"],
}


@pytest.mark.parametrize("gpu", ["h100", "b200"])
def test_sliding_window_drafters_build_past_their_window(tmp_path: Path, gpu: str):
    """The window is applied by DFlashAttention on every GPU, so it no longer caps max_seq_len."""
    ckpt = write_checkpoint(tmp_path / "c", draft_hf=SLIDING_DRAFT)
    plan = plan_engine_build(ckpt, tmp_path / "e", EngineBuildSettings(max_seq_len=8192, gpu=gpu))
    attention = plan.dflash_manifest["attention"]
    assert attention["draft_block_sliding_attention"] == "DFlashAttention"
    assert attention["draft_block_full_attention"] == ("GPTAttention" if gpu == "h100" else "DFlashAttention")


def test_windows_shorter_than_the_block_build(tmp_path: Path):
    draft = {**DRAFT_HF, "use_sliding_window": True, "sliding_window": 12, "layer_types": ["sliding_attention"] * 2}
    ckpt = write_checkpoint(tmp_path / "c", draft_hf=draft)
    assert plan_engine_build(
        ckpt, tmp_path / "e", EngineBuildSettings(max_seq_len=64, max_input_len=32, max_num_tokens=1024)
    ).command


def test_the_default_max_seq_len_ignores_the_window(tmp_path: Path, capsys):
    """Without --max_seq_len the build takes min(8192, the target's positions), whatever the drafter's window."""
    draft = {**SLIDING_DRAFT, "layer_types": ["sliding_attention"] * 2}
    ckpt = write_checkpoint(tmp_path / "c", draft_hf=draft)
    from dflash_trt.cli import main as cli_main

    argv = ["build", "--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "e"), "--dry_run", "--json"]
    assert cli_main(argv) == 0
    config = json.loads(capsys.readouterr().out)["build_config"]
    assert (config["max_seq_len"], config["max_input_len"]) == (8192, 4096)


@pytest.mark.parametrize(
    ("gpu", "sm", "target"),
    [
        ("h100", 90, "GPTAttention"),
        ("h200", 90, "GPTAttention"),
        ("b200", 100, "DFlashAttention"),
        ("b300", 103, "DFlashAttention"),
    ],
)
def test_each_gpu_gets_its_attention_route(tmp_path: Path, gpu: str, sm: int, target: str):
    """Blackwell: both generation passes on DFlashAttention (1.2.x has no spec-decoding kernel there); context
    always on the stock plugin; the build is told the GPU through its environment, the manifest says all of it."""
    ckpt = write_checkpoint(tmp_path / "c")
    plan = plan_engine_build(ckpt, tmp_path / "e", EngineBuildSettings(gpu=gpu))
    manifest = plan.dflash_manifest
    assert (manifest["gpu"], manifest["sm"]) == (gpu, sm)
    assert manifest["attention"] == {
        "target_context": "GPTAttention",
        "target_verification": target,
        "draft_block_full_attention": target,
    }
    assert plan.build_env()["DFLASH_TRT_TARGET_SM"] == str(sm)
    # The line shown for running by hand leaves the GPU to the host it runs on.
    assert "DFLASH_TRT_TARGET_SM" not in plan.shell_command()
    assert plan.shell_command(with_library=True).startswith(
        f"DFLASH_TRT_PLUGIN_LIB={shlex.quote(plan.plugin_library)} DFLASH_TRT_TARGET_SM={sm} "
        "DFLASH_TRT_DRAFT_LEN_SCHEDULE=none trtllm-build "
    )


def test_blackwell_needs_head_dims_the_kernels_take(tmp_path: Path):
    odd = {"head_dim": 96}
    ckpt = write_checkpoint(tmp_path / "c", target_hf={**TARGET_HF, **odd}, draft_hf={**DRAFT_HF, **odd})
    assert plan_engine_build(ckpt, tmp_path / "e", EngineBuildSettings(gpu="h200")).command
    with pytest.raises(
        DFlashTrtError, match=r"on b300 the target's generation attention runs on DFlashAttention, .*not 96"
    ):
        plan_engine_build(ckpt, tmp_path / "e", EngineBuildSettings(gpu="b300"))


def test_dry_run_names_the_gpu_and_each_pass(tmp_path: Path, capsys, monkeypatch):
    from dflash_trt import gpu_targets
    from dflash_trt.cli import main as cli_main

    monkeypatch.setattr(gpu_targets, "visible_gpu", lambda: None)
    ckpt = write_checkpoint(tmp_path / "c")
    argv = ["build", "--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "e"), "--dry_run"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "# GPU: h200 (assumed: no GPU is visible here; pass --gpu h100|h200|b200|b300 to choose)" in out
    assert "# attention on h200: target_context GPTAttention, target_verification GPTAttention" in out
    assert "DFLASH_TRT_TARGET_SM=90 DFLASH_TRT_DRAFT_LEN_SCHEDULE=none trtllm-build" in out
    assert cli_main([*argv, "--gpu", "b300"]) == 0
    out = capsys.readouterr().out
    assert "# GPU: b300 (as given)" in out
    assert "# attention on b300: target_context GPTAttention, target_verification DFlashAttention" in out
    # What the route rests on: the stock kernels' limits as read, ours as far as they ran.
    assert "[read in its sources, docs/engine.md §13]" in out and "not yet on a GPU" in out
    assert "DFLASH_TRT_TARGET_SM=103 DFLASH_TRT_DRAFT_LEN_SCHEDULE=none trtllm-build" in out
    monkeypatch.setattr(gpu_targets, "visible_gpu", lambda: ("b200", 100))
    assert cli_main([*argv, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["gpu_chosen"] == "the GPU of this host" and planned["dflash_manifest"]["gpu"] == "b200"


def test_a_real_build_refuses_a_host_of_another_gpu(tmp_path: Path, monkeypatch):
    from dflash_trt.trtllm import build as engine_build

    plan = plan_engine_build(write_checkpoint(tmp_path / "c"), tmp_path / "e", EngineBuildSettings(gpu="b300"))
    monkeypatch.setattr(engine_build, "visible_gpu", lambda: ("h100", 90))
    with pytest.raises(DFlashTrtError, match=r"planned for b300 \(SM103\) but this host's GPU is h100 \(SM90\)"):
        engine_build.check_build_gpu(plan)
    monkeypatch.setattr(engine_build, "visible_gpu", lambda: ("b300", 103))
    engine_build.check_build_gpu(plan)


@pytest.mark.parametrize(
    ("draft_changes", "max_seq_len", "held"),
    [
        ({}, 40960 - 45 - 100, "the target's max_position_embeddings RoPE tables hold positions 0..40959"),
        (  # the window bounds nothing: DFlashAttention applies it
            {"use_sliding_window": True, "sliding_window": 4096, "layer_types": ["sliding_attention"] * 2},
            40960 - 45 - 100,
            "the target's max_position_embeddings RoPE tables hold positions 0..40959",
        ),
    ],
    ids=["rope-tables", "sliding-window"],
)
def test_the_dry_run_says_why_the_engine_records_a_longer_max_seq_len(
    tmp_path, capsys, draft_changes, max_seq_len, held
):
    """builder.build() records max_seq_len + 2K (K = 15); the executor runs requests of that less K, and their last
    step reaches 2K positions past their last token (hand-computed: S + 2K, S + K, S + 3K - 1)."""
    from dflash_trt.cli import main as cli_main

    ckpt = write_checkpoint(tmp_path / "c", draft_hf={**DRAFT_HF, **draft_changes})
    argv = ["build", "--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "e"), "--dry_run"]
    assert cli_main([*argv, "--max_seq_len", str(max_seq_len), "--max_input_len", "1024"]) == 0
    last = capsys.readouterr().out.splitlines()[-2:]
    assert last == [
        "# lengths",
        f"--max_seq_len {max_seq_len}: the engine records max_seq_len {max_seq_len + 30} = {max_seq_len} + 2 x 15 "
        "(TensorRT-LLM 1.2.x's builder adds max_draft_len, and num_eagle_layers for EAGLE); its executor runs "
        f"requests of up to {max_seq_len + 15} tokens (prompt + output + 15 drafts <= {max_seq_len + 30}), whose last "
        f"step reaches position {max_seq_len + 44} ({held})",
    ]
    assert cli_main([*argv, "--max_seq_len", str(max_seq_len), "--max_input_len", "1024", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["dflash_manifest"]["max_seq_len"] == plan["lengths"]["engine_max_seq_len"] == max_seq_len + 30
    assert plan["lengths"]["longest_request"] == max_seq_len + 15


@pytest.mark.parametrize(
    ("nodes", "last_slot", "served"),
    [(40, 192 + 15 - 2 + 40, 192 + 15), (20, 192 + 15 + 2 * 15 - 1, 192 + 20 + 15 - 2 * 15)],
)
def test_a_draft_trees_lengths_are_the_chains_positions_and_its_nodes_slots(tmp_path, capsys, nodes, last_slot, served):
    """A tree of N nodes over K = 15 positions, --max_seq_len 192: the builder adds N + K (engine 192 + N + 15); the
    executor clips prompt + output + N to that, so it runs the chain's 192 + 15 = 207 tokens, whose last step still
    reaches position 207 - 1 + 2K = 236 (depth <= K); the verified tree writes KV slots up to its anchor (the
    last-but-one token, 205) + N before the rewind: 245 for N = 40, under the next block's 236 for N = 20. A server on
    that engine (`built_engine_longest_request`) admits what its window holds past the next block (window - 2K) and
    the executor runs (window - N): 207 for N = 40; 197 for N = 20 (as the chain's 192: window - 2K binds)."""
    from dflash_trt.cli import main as cli_main

    ckpt = write_checkpoint(tmp_path / "c")
    argv = ["build", "--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "e"), "--dry_run"]
    argv += ["--max_seq_len", "192", "--max_input_len", "128", "--draft_tree", str(nodes)]
    assert cli_main(argv) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(
        f"--max_seq_len 192: a draft tree of {nodes} nodes over 15 positions: the engine records max_seq_len "
        f"{192 + nodes + 15} = 192 + {nodes} + 15 "
    )
    assert f"requests of up to 207 tokens (prompt + output + {nodes} drafts <= {192 + nodes + 15})" in last
    assert f"reaches position 236 and KV slot {last_slot} (the verified tree" in last
    assert cli_main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    lengths = plan["lengths"]
    assert plan["dflash_manifest"]["max_seq_len"] == lengths["engine_max_seq_len"] == 192 + nodes + 15
    assert (lengths["longest_request"], lengths["last_position"], lengths["last_slot"]) == (207, 236, last_slot)
    window = plan["dflash_manifest"]["max_seq_len"]
    assert built_engine_longest_request(window, 40960, 15, nodes) == served
    assert built_engine_longest_request(window, served + 30, 15, nodes) == served  # positions exactly holding it
    assert built_engine_longest_request(window, served + 29, 15, nodes) == served - 1


def test_an_unset_max_num_tokens_is_written_out_as_the_builder_clips_it(ckpt: Path, tmp_path: Path, capsys):
    """builder.build() clips max_num_tokens to max_seq_len x max_batch_size (_utils.py `check_max_num_tokens`, read):
    the default 8192 is written out clipped (64 x 8 = 512), a value given above the clip is refused."""
    from dflash_trt.cli import main as cli_main

    argv = ["build", "--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "e"), "--dry_run", "--json"]
    lengths = ["--max_batch_size", "8", "--max_seq_len", "64", "--max_input_len", "32"]
    assert cli_main([*argv, *lengths]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["build_config"]["max_num_tokens"] == 512
    assert plan["command"][plan["command"].index("--max_num_tokens") + 1] == "512"
    assert cli_main([*argv, *lengths, "--max_num_tokens", "513"]) == 2
    assert "--max_num_tokens (513) exceeds max_seq_len x max_batch_size = 512" in capsys.readouterr().err


def test_refuses_pipeline_parallel_and_foreign_checkpoints(tmp_path: Path):
    ckpt = write_checkpoint(tmp_path / "pp", mapping={"world_size": 2, "tp_size": 1, "pp_size": 2})
    with pytest.raises(DFlashTrtError, match="pipeline parallelism"):
        plan_engine_build(ckpt, tmp_path / "e", EngineBuildSettings())
    foreign = write_checkpoint(tmp_path / "llama", architecture="LlamaForCausalLM")
    with pytest.raises(DFlashTrtError, match="not a dflash-trt checkpoint"):
        plan_engine_build(foreign, tmp_path / "e", EngineBuildSettings())
    with pytest.raises(DFlashTrtError, match="no config.json"):
        plan_engine_build(tmp_path / "missing", tmp_path / "e", EngineBuildSettings())
    bad_k = write_checkpoint(tmp_path / "k", max_draft_len=7)
    with pytest.raises(DFlashTrtError, match="max_draft_len must equal the drafter's drafts per step, 15"):
        plan_engine_build(bad_k, tmp_path / "e", EngineBuildSettings())


def cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    build_command.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["build", *argv])


def test_dry_run_prints_command_config_and_manifest(ckpt: Path, tmp_path: Path, capsys):
    args = cli(
        [
            "--checkpoint_dir",
            str(ckpt),
            "--output_dir",
            str(tmp_path / "e"),
            "--max_batch_size",
            "4",
            "--multiple_profiles",
            "enable",
            "--dry_run",
            "--",
            "--strip_plan",
        ]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    command = shlex.split(lines[lines.index("# trtllm-build command") + 1])
    assert command[-1] == "--strip_plan"
    assert flag_values(command)["--max_batch_size"] == "4"
    assert flag_values(command)["--multiple_profiles"] == "enable"
    assert '"speculative_decoding_mode": 32' in out and '"eagle_choices"' in out
    assert not (tmp_path / "e").exists()


def test_dry_run_json(ckpt: Path, tmp_path: Path, capsys):
    args = cli(["--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "e"), "--dry_run", "--json"])
    args.func(args)
    data = json.loads(capsys.readouterr().out)
    assert data["build_config"]["max_draft_len"] == 15
    assert data["command"][0] == "trtllm-build"


def test_typed_flags_override_a_base_profile(ckpt: Path, tmp_path: Path):
    args = cli(["--checkpoint_dir", str(ckpt), "--output_dir", "e", "--max_seq_len", "1024"])
    base = EngineBuildSettings(max_batch_size=16, max_input_len=512, gemm_plugin="fp8")
    merged = build_command.settings_from_args(args, base)
    assert (merged.max_batch_size, merged.max_seq_len, merged.gemm_plugin) == (16, 1024, "fp8")


def test_real_build_needs_tensorrt_llm(ckpt: Path, tmp_path: Path):
    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("tensorrt_llm is installed: the GPU self-test covers the real build")
    plan = plan_engine_build(ckpt, tmp_path / "e", EngineBuildSettings())
    with pytest.raises(DFlashTrtError, match=r"tensorrt_llm 1\.2\.x is not installed"):
        run_engine_build(plan)
    assert not (tmp_path / "e").exists()


def test_selftest_refuses_without_tensorrt_llm_before_any_work(tmp_path: Path):
    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("tensorrt_llm is installed: tests/gpu/test_engine_selftest.py covers the real run")
    from dflash_trt.cli import main

    out = tmp_path / "selftest"
    assert main(["selftest", "--output_dir", str(out)]) == 2
    assert not out.exists()


def test_real_build_never_overwrites_silently(ckpt: Path, tmp_path: Path):
    out = tmp_path / "e"
    out.mkdir()
    (out / "rank0.engine").write_bytes(b"x")
    plan = plan_engine_build(ckpt, out, EngineBuildSettings())
    with pytest.raises(DFlashTrtError, match="--overwrite"):
        run_engine_build(plan)
    assert (out / "rank0.engine").read_bytes() == b"x"


def engine_bookkeeping(position_ids, context_lengths, draft_lens, accepted_tokens, num_accepted):
    """The ops of DFlashForCausalLM.bookkeeping, one for one in numpy (where, cumsum, compare-and-sum, gathers)."""
    is_generation = draft_lens > 0
    in_len = np.where(is_generation, draft_lens + 1, context_lengths)
    valid_len = np.where(is_generation, num_accepted, in_len)
    ends = np.cumsum(in_len)
    starts = ends - in_len
    position_rows = np.where(is_generation, 1, in_len)
    first_position = position_ids[np.cumsum(position_rows) - position_rows]
    rows = np.arange(int(in_len.sum()))
    request = (ends[None, :] < rows[:, None] + 1).astype(np.int32).sum(axis=1)
    local = rows - starts[request]
    valid = local < valid_len[request]
    positions = first_position[request] + local
    anchor = np.take_along_axis(accepted_tokens, (num_accepted - 1)[:, None], axis=1)[:, 0]
    return request, valid, positions, first_position + valid_len, anchor


def test_step_bookkeeping_mirrors_the_golden_loop(tmp_path: Path):
    """Pack one engine step from a golden-model run (a context request next to generation requests) and check the
    engine's rule gives exactly the golden loop's injected positions, next context length and next anchor."""
    from _pairs import PairVariant, make_pair

    from dflash_trt.conversion.convert import convert_checkpoint
    from dflash_trt.reference.decode import speculative_generate
    from dflash_trt.reference.model import load_golden_model

    target_dir, draft_dir = make_pair(tmp_path, PairVariant(block_size=6))
    convert_checkpoint(target_dir, draft_dir, tmp_path / "ckpt", dtype="float32")
    golden = load_golden_model(tmp_path / "ckpt")
    k = golden.draft.spec.block_size - 1
    prompts = [[3, 4, 5, 6, 7], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    results = speculative_generate(golden, prompts, max_new_tokens=20)

    checked = generation_checked = 0
    for step in range(1, 4):
        # Request 0 is (re)submitted as a context request; requests 1 and 2 are generation requests at `step`.
        # Position ids as the runtime packs them: one per context token, one (the anchor's) per generation request.
        position_ids, ctx_lens, drafts, accepted, counts, expect = [], [], [], [], [], []
        prompt = prompts[0]
        position_ids += list(range(len(prompt)))
        ctx_lens.append(len(prompt))
        drafts.append(0)
        accepted.append([results[0].output_ids[0]] + [0] * k)
        counts.append(1)
        expect.append((set(range(len(prompt))), len(prompt), results[0].output_ids[0]))
        for r in (1, 2):
            res = results[r]
            if step >= len(res.steps) or res.steps[step].accepted + 1 != res.acceptance_lengths[step]:
                continue  # finished, or capped at max_new_tokens by the golden loop (the runtime truncates instead)
            trace = res.steps[step]
            generation_checked += 1
            tokens = res.input_ids + res.output_ids
            # The golden loop's anchor index before and after this step (_Sequence.start).
            start = len(res.input_ids) + sum(res.acceptance_lengths[:step])
            next_start = start + res.acceptance_lengths[step]
            n = trace.accepted + 1  # what the accept plugin reports: accepted drafts + the bonus token
            position_ids.append(start)
            ctx_lens.append(len(res.input_ids) + k)
            drafts.append(k)
            accepted.append(trace.draft_ids[: trace.accepted] + [tokens[start + n]] + [0] * (k + 1 - n))
            counts.append(n)
            expect.append((set(range(start, next_start)), next_start, tokens[next_start]))
        request, valid, positions, ctx_len, anchor = engine_bookkeeping(
            np.array(position_ids), np.array(ctx_lens), np.array(drafts), np.array(accepted), np.array(counts)
        )
        for b, (injected, next_ctx, next_anchor) in enumerate(expect):
            assert set(positions[(request == b) & valid].tolist()) == injected
            assert ctx_len[b] == next_ctx and anchor[b] == next_anchor
            checked += 1
    assert generation_checked >= 2 and checked == 3 + generation_checked


@pytest.mark.slow  # loads the tiny tokenizer through transformers
@pytest.mark.parametrize("chunked", [False, True])
def test_selftest_workload_fits_the_tiny_target_and_exceeds_one_chunk(tmp_path: Path, chunked: bool):
    """The self-test's engine stays within the tiny target's 256 positions; with --chunked_context two prompts are
    longer than max_num_tokens, so their prefill needs several context chunks."""
    from dflash_trt.commands.selftest import LONG_PROMPTS, selftest_workload
    from dflash_trt.spec import load_draft_spec, load_target_spec
    from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir
    from dflash_trt.tokenizer import load_tokenizer

    target = load_target_spec(target_dir())
    draft = load_draft_spec(draft_dir(), target)
    ckpt = tmp_path / "c"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(checkpoint_config(target, draft, "float16")))
    (ckpt / "rank0.safetensors").touch()
    tokenizer = load_tokenizer(target_dir())
    settings, prompts = selftest_workload(
        [p.text for p in load_heldout(limit=64)],
        tokenizer,
        8,
        draft.block_size,
        chunked,
        target.max_position_embeddings,
    )
    plan_engine_build(ckpt, tmp_path / "e", settings)
    assert len(prompts) == 8 and all(0 < len(p) <= settings.max_input_len for p in prompts)
    assert settings.max_seq_len <= target.max_position_embeddings
    longer_than_a_chunk = [p for p in prompts if len(p) > settings.max_num_tokens]
    assert len(longer_than_a_chunk) == (LONG_PROMPTS if chunked else 0)


MIXED_LAYERS = ["full_attention", "sliding_attention"]


@pytest.mark.parametrize(
    ("heads", "block", "tp", "refused"),
    [
        (4, 16, 1, True),  # 2 query heads per KV head x 16 tokens = 32 rows: Hopper XQA's small-batch layout
        (8, 16, 1, False),  # 4 x 16 = 64
        (4, 8, 1, True),
        (8, 16, 2, False),  # per rank 4 query heads and 1 KV head: 64 rows
    ],
)
def test_an_fp8_cache_refuses_drafts_in_xqa_s_causal_small_batch_layout(tmp_path, heads, block, tp, refused):
    """mha_sm90.cu's SWAP_AB spec-decoding layout (rows = block x query heads per KV head <= 32) hard-codes a causal
    mask; with an FP8 cache the drafter's all-ones block mask could meet it. A bf16 cache or a causal drafter is
    never refused."""
    fp8 = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "group_size": 16}
    draft_hf = {**DRAFT_HF, "num_attention_heads": heads, "block_size": block}
    mapping = {"world_size": tp, "tp_size": tp, "pp_size": 1}
    ckpt = write_checkpoint(tmp_path / "c", draft_hf=draft_hf, quantization=fp8, mapping=mapping)
    config = json.loads((ckpt / "config.json").read_text())
    config["dflash_config"]["quantization"] = fp8
    (ckpt / "config.json").write_text(json.dumps(config))
    settings = EngineBuildSettings(max_batch_size=8, max_num_tokens=256, gemm_plugin="fp8")
    if refused:
        with pytest.raises(DFlashTrtError, match=r"small-batch spec-decoding layout, whose mask is hard-coded causal"):
            plan_engine_build(ckpt, tmp_path / "e", settings)
    else:
        plan_engine_build(ckpt, tmp_path / "e", settings)
    for gpu in ("b200", "b300"):  # DFlashAttention runs the block there and applies the all-ones mask itself
        assert plan_engine_build(ckpt, tmp_path / "e", replace(settings, gpu=gpu)).dflash_manifest["gpu"] == gpu
    config["quantization"] = config["dflash_config"]["quantization"] = {**fp8, "kv_cache_quant_algo": None}
    (ckpt / "config.json").write_text(json.dumps(config))
    plan_engine_build(ckpt, tmp_path / "e", settings)  # no FP8 cache: the HMMA kernels read the mask


@pytest.mark.parametrize(
    ("gpu", "nodes", "refused"), [("h100", 16, True), ("h100", 40, False), ("b200", 16, False), ("b300", 16, False)]
)
def test_an_fp8_cache_refuses_trees_in_xqa_s_causal_small_batch_layout(tmp_path, gpu, nodes, refused):
    """A tree verified on Hopper XQA with an FP8 cache in the small-batch layout (here 1 query head per KV head per
    rank at tp 4: N + 1 rows) would be verified as a chain; DFlashAttention (B200 / B300) reads the tree mask."""
    fp8 = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "group_size": 16}
    mapping = {"world_size": 4, "tp_size": 4, "pp_size": 1}
    target_hf = {**TARGET_HF, "num_key_value_heads": 4}
    draft_hf = {**DRAFT_HF, "num_key_value_heads": 4, "is_causal": True}
    ckpt = write_checkpoint(tmp_path / "c", target_hf, draft_hf, quantization=fp8, mapping=mapping)
    config = json.loads((ckpt / "config.json").read_text())
    config["dflash_config"]["quantization"] = fp8
    (ckpt / "config.json").write_text(json.dumps(config))
    settings = EngineBuildSettings(max_batch_size=8, max_num_tokens=512, gemm_plugin="fp8", gpu=gpu, draft_tree=nodes)
    if refused:
        with pytest.raises(DFlashTrtError, match=rf"--draft_tree {nodes}: .*17 rows <= 32.*verified as a chain"):
            plan_engine_build(ckpt, tmp_path / "e", settings)
    else:
        assert plan_engine_build(ckpt, tmp_path / "e", settings).dflash_manifest["draft_tree"] == nodes


@pytest.mark.parametrize(("layer_types", "refused"), [(["sliding_attention"] * 2, False), (MIXED_LAYERS, True)])
def test_only_blocks_left_on_hopper_xqa_meet_its_causal_layout(tmp_path, layer_types, refused):
    """On H100 sliding draft layers run on DFlashAttention, so a bidirectional drafter whose layers are all sliding
    never meets XQA's hard-coded causal layout (2 x 16 = 32 rows); one full-attention layer left on XQA does."""
    fp8 = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "group_size": 16}
    draft_hf = {**DRAFT_HF, "num_attention_heads": 4, "use_sliding_window": True, "sliding_window": 64}
    draft_hf["is_causal"] = False
    ckpt = write_checkpoint(tmp_path / "c", draft_hf={**draft_hf, "layer_types": layer_types}, quantization=fp8)
    config = json.loads((ckpt / "config.json").read_text())
    config["dflash_config"]["quantization"] = fp8
    (ckpt / "config.json").write_text(json.dumps(config))
    settings = EngineBuildSettings(max_batch_size=8, max_num_tokens=256, gemm_plugin="fp8", gpu="h100")
    if refused:
        with pytest.raises(DFlashTrtError, match=r"hard-coded causal"):
            plan_engine_build(ckpt, tmp_path / "e", settings)
    else:
        plan_engine_build(ckpt, tmp_path / "e", settings)


SPECULATORS_DFLASH2_HF = {
    "speculators_model_type": "dflash2",
    "transformer_layer_config": {k: v for k, v in DRAFT_HF.items() if k not in ("architectures", "dflash_config")},
    "aux_hidden_state_layer_ids": [0, 6],
    "mask_token_id": 999,
    "block_size": 8,
    "draft_vocab_size": 1000,
    "sample_from_anchor": True,
    "selector_top_k": 32,
}


def test_a_speculators_dflash2_drafter_plans_its_drafts_and_records_its_kind(tmp_path: Path):
    ckpt = write_checkpoint(tmp_path / "k", draft_hf=SPECULATORS_DFLASH2_HF)
    plan = plan_engine_build(ckpt, tmp_path / "engine", EngineBuildSettings())
    assert plan.dflash_manifest["max_draft_len"] == 8  # the anchor's slot drafts too
    assert plan.build_config["max_draft_len"] == 8 and "--max_draft_len 8" in plan.shell_command()
    assert plan.dflash_manifest["target_layer_ids"] == [-1, 5]  # the embeddings and the last layer
    drafter = plan.dflash_manifest["drafter"]
    assert (drafter["architecture"], drafter["checkpoint_format"], drafter["sample_from_anchor"]) == (
        "DFlash2DraftModel",
        "speculators",
        True,
    )
    assert drafter["dflash2"] == {
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 256,
        "selector_top_k": 32,
    }


def test_a_selector_beyond_tensorrts_topk_limit_is_refused(tmp_path: Path):
    target = {**TARGET_HF, "vocab_size": 5000}
    draft = {**SPECULATORS_DFLASH2_HF, "draft_vocab_size": 5000, "selector_top_k": 4000}
    draft["transformer_layer_config"] = {**draft["transformer_layer_config"], "vocab_size": 5000}
    ckpt = write_checkpoint(tmp_path / "k", target_hf=target, draft_hf=draft)
    with pytest.raises(DFlashTrtError, match="selector's top-k \\(4000\\) exceeds TensorRT's TopK limit of 3840"):
        plan_engine_build(ckpt, tmp_path / "engine", EngineBuildSettings())


@pytest.mark.parametrize(
    ("nodes", "dflash2", "expected"),
    [(None, False, 0), (7, False, 0), (8, False, 8), (256, False, 256), (6, False, "at least the chain's 7"),
     (257, False, "at most 256 drafts"), (8, True, "DFlash2 drafter's selector walks one chain")],
)  # fmt: skip
def test_the_tree_node_rule_of_an_engine(nodes, dflash2, expected, monkeypatch):
    """A drafter of 7 drafts: its node count is the chain, a tree above it up to max_draft_len's limit, nothing else."""
    monkeypatch.delenv(TREE_ENV, raising=False)
    if isinstance(expected, str):
        with pytest.raises(DFlashTrtError, match=expected):
            engine_tree_nodes(nodes, 7, dflash2)
    else:
        assert engine_tree_nodes(nodes, 7, dflash2) == expected


def test_the_tree_node_count_reaches_trtllm_build_through_the_environment(monkeypatch):
    monkeypatch.setenv(TREE_ENV, "12")
    assert engine_tree_nodes(None, 7, False) == 12
    monkeypatch.setenv(TREE_ENV, "many")
    with pytest.raises(DFlashTrtError, match=TREE_ENV):
        engine_tree_nodes(None, 7, False)


def test_a_draft_tree_build_verifies_its_nodes_over_the_chain_positions(ckpt: Path, tmp_path: Path, capsys):
    """`--draft_tree 40` on a drafter of 15 drafts: trtllm-build gets max_draft_len 40 and the node count in the
    model class's environment; the manifest keeps the 15-deep chain as the EAGLE choices (num_eagle_layers)."""
    args = cli(["--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "e"), "--draft_tree", "40"])
    settings = build_command.settings_from_args(args)
    plan = plan_engine_build(ckpt, tmp_path / "e", settings)
    assert flag_values(plan.command)["--max_draft_len"] == "40"
    assert plan.build_config["max_draft_len"] == 40
    assert plan.build_env() == {TARGET_SM_ENV: "90", SCHEDULE_ENV: "none", TREE_ENV: "40"}
    assert f" {TREE_ENV}=40 trtllm-build " in f" {plan.shell_command()}"
    manifest = plan.dflash_manifest
    assert (manifest["max_draft_len"], manifest["draft_tree"], len(manifest["eagle_choices"])) == (40, 40, 15)
    assert manifest["max_seq_len"] == settings.max_seq_len + 40 + 15  # max_draft_len + num_eagle_layers
    chain = plan_engine_build(ckpt, tmp_path / "e", build_command.settings_from_args(cli(["--draft_tree", "15"])))
    assert TREE_ENV not in chain.build_env() and chain.build_config["max_draft_len"] == 15


def test_a_draft_tree_needs_tokens_for_every_node(ckpt: Path, tmp_path: Path):
    settings = EngineBuildSettings(max_batch_size=64, max_num_tokens=64 * 16, draft_tree=40)
    with pytest.raises(DFlashTrtError, match=r"64 x 41"):
        plan_engine_build(ckpt, tmp_path / "e", settings)


def test_a_draft_trees_schedule_is_node_budgets(ckpt: Path, tmp_path: Path):
    """A tree engine's schedule counts nodes per request (draft_schedule.py): up to the tree's 40, recorded in the
    manifest and handed to the model class; 41 is refused."""
    settings = EngineBuildSettings(draft_tree=40, draft_len_schedule=DraftLenSchedule(((1, 40), (4, 8))))
    plan = plan_engine_build(ckpt, tmp_path / "e", settings)
    assert plan.dflash_manifest["draft_len_schedule"] == "1:40,4:8"
    assert plan.build_env()[SCHEDULE_ENV] == "1:40,4:8"
    with pytest.raises(DFlashTrtError, match="verifies 41 drafts per request but the engine verifies at most 40"):
        plan_engine_build(ckpt, tmp_path / "e", replace(settings, draft_len_schedule=DraftLenSchedule(((2, 41),))))


@pytest.mark.parametrize(
    ("gpu", "kernel"),
    [("h100", "GPTAttention"), ("h200", "GPTAttention"), ("b200", "DFlashAttention"), ("b300", "DFlashAttention")],
)
def test_a_draft_tree_builds_on_every_gpu_and_the_route_names_its_mask(ckpt: Path, tmp_path: Path, capsys, gpu, kernel):
    """The stock kernel (Hopper) and DFlashAttention (B200 / B300) both verify a tree with the runtime's packed tree
    mask: the plan builds it everywhere, the manifest and the dry run say which kernel reads the mask; the chain
    node count is the chain and its verification stays the plain kernel."""
    from dflash_trt.cli import main as cli_main

    settings = EngineBuildSettings(draft_tree=40, gpu=gpu)
    manifest = plan_engine_build(ckpt, tmp_path / "e", settings).dflash_manifest
    assert manifest["draft_tree"] == 40
    assert manifest["attention"]["target_verification"] == f"{kernel} with the packed tree mask"
    chain = plan_engine_build(ckpt, tmp_path / "e", replace(settings, draft_tree=15))
    assert chain.build_config["max_draft_len"] == 15
    assert chain.dflash_manifest["attention"]["target_verification"] == kernel
    argv = ["build", "--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "e"), "--dry_run", "--gpu", gpu]
    assert cli_main([*argv, "--draft_tree", "40"]) == 0
    out = capsys.readouterr().out
    assert "DFLASH_TRT_DRAFT_TREE=40 trtllm-build" in out
    assert f"target_verification {kernel} with the packed tree mask," in out
