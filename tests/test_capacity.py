"""Capacity planner: the worked example of docs/performance.md redone by hand, warnings, shipped profile comments."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from dflash_trt.capacity import capacity_warnings, plan_capacity
from dflash_trt.errors import DFlashTrtError
from dflash_trt.perf.published import PAIRS, pair_for_models
from dflash_trt.profiles import load_profile, parse_profile

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "build_configs").glob("*/*.yaml"))
H100_QWEN3_8B = ROOT / "build_configs/h100-fp8/qwen3-8b.yaml"


def _capacity(profile, shape=None):
    target, drafter = PAIRS[pair_for_models(profile.model.target, profile.model.draft)].load()
    return plan_capacity(profile, target, drafter, shape)


def test_worked_example_h100_fp8_qwen3_8b_by_hand():
    cap = _capacity(load_profile(H100_QWEN3_8B))
    # Weights: one Qwen3-8B layer = attention 4096 x (32 + 2 x 8) x 128 + 32 x 128 x 4096 = 41,943,040
    # plus MLP 3 x 4096 x 12288 = 150,994,944, i.e. 192,937,984; 36 target + 5 drafter layers, fc 5 x 4096^2,
    # all FP8 (1 B); untied embeddings + lm_head 2 x 151936 x 4096 at 2 B.
    layer = 4096 * 48 * 128 + 32 * 128 * 4096 + 3 * 4096 * 12288
    weights = (41 * layer + 5 * 4096**2) * 1 + 2 * 151936 * 4096 * 2
    assert layer == 192_937_984 and cap.weights_bytes == weights == 10_483_662_848
    # Activations: 8192 tokens x (2 x 4096 + 48 x 128 + 2 x 12288) x 2 B, plus fp32 logits for 128 x 16 rows.
    activations = 8192 * (2 * 4096 + 48 * 128 + 2 * 12288) * 2 + 128 * 16 * 151936 * 4
    assert cap.activation_bytes == activations == 1_882_193_920
    # Pool: 0.9 x (80 GB - weights - activations - 2 GB runtime); a token is 41 layers x K,V x 8 heads x 128 x 1 B.
    pool = 0.9 * (80e9 - weights - activations - 2e9)
    assert cap.kv_pool_bytes == pytest.approx(pool) and cap.kv_bytes_per_token == 41 * 2 * 8 * 128 == 83_968
    blocks = math.floor(pool / (83_968 * 32))
    assert cap.blocks == blocks == 21_984
    # A sequence reserves its length plus the 15 draft tokens, in whole 32-token blocks.
    assert cap.sequences_at_shape == blocks // math.ceil((1024 + 1024 + 15) / 32) == 338
    assert cap.sequences_at_max_seq_len == blocks // math.ceil((8192 + 15) / 32) == 85


def test_tensor_parallel_splits_weights_and_kv_heads():
    data = yaml.safe_load((ROOT / "build_configs/h200-fp8/qwen3-32b.yaml").read_text())
    tp2 = _capacity(parse_profile(data))
    data["checkpoint"]["tp_size"] = 8
    tp8 = _capacity(parse_profile(data))
    assert tp8.weights_bytes == pytest.approx(tp2.weights_bytes / 4)
    # 8 KV heads: 4 per rank at TP 2, 1 per rank at TP 8 (69 layers x K,V x 128 x 1 B per head).
    assert (tp2.kv_bytes_per_token, tp8.kv_bytes_per_token) == (69 * 2 * 4 * 128, 69 * 2 * 1 * 128)


def test_a_batch_the_pool_cannot_hold_is_warned_about():
    profile = load_profile(H100_QWEN3_8B)
    assert capacity_warnings(profile, _capacity(profile)) == []
    long = _capacity(profile, (4096, 4096))  # ceil((8192 + 15) / 32) = 257 blocks each: 85 sequences < 128
    (warning,) = capacity_warnings(profile, long)
    assert "max_batch_size 128 cannot be held at 4096/4096 tokens" in warning and "about 85" in warning


def test_weights_beyond_memory_are_one_clear_error():
    data = yaml.safe_load((ROOT / "build_configs/h100-fp8/qwen3-32b.yaml").read_text())
    data["quantization"].update(qformat="none", dflash_qformat="none")
    data["engine"]["gemm_plugin"] = "auto"
    data["checkpoint"]["tp_size"] = 1
    data["engine"]["max_num_tokens"] = 65536  # bf16 weights 70.5 GB + 9.4 GB of activations + 2 GB > 80 GB
    with pytest.raises(DFlashTrtError, match="exceed h100's 80 GB per GPU"):
        _capacity(parse_profile(data))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_profile_comment_states_the_computed_capacity(path: Path):
    profile = load_profile(path)
    cap = _capacity(profile)
    stated = re.search(r"# Capacity \(dflash-trt plan --config\): (\d+) sequences at (\d+)/(\d+) tokens, (\d+) at "
                       r"max_seq_len (\d+)\.", path.read_text())  # fmt: skip
    assert stated, "regenerate the capacity comment with `dflash-trt plan --config`"
    assert tuple(map(int, stated.groups())) == (
        cap.sequences_at_shape,
        *cap.shape,
        cap.sequences_at_max_seq_len,
        cap.max_seq_len,
    )
    assert cap.sequences_at_shape >= profile.engine.max_batch_size


def test_docs_table_states_every_shipped_profile_capacity():
    doc = (ROOT / "docs" / "performance.md").read_text()
    for path in SHIPPED:
        p = load_profile(path)
        c = _capacity(p)
        row = (f"| {p.name} | {p.gpu} x{p.checkpoint.tp_size} | {c.weights_bytes / 1e9:.2f} GB | "
               f"{c.kv_pool_bytes / 1e9:.2f} GB | {c.kv_bytes_per_token:,.0f} B | {c.sequences_at_shape} | "
               f"{c.sequences_at_max_seq_len} | {p.engine.max_batch_size} |")  # fmt: skip
        assert row in doc, row


def test_build_checks_warn_from_the_checkpoint_configs(tmp_path: Path):
    import json

    from dflash_trt.capacity import checkpoint_warnings
    from dflash_trt.perf import published

    for name, cfg in (("t", published.QWEN3_8B), ("d", published.QWEN3_8B_DFLASH_B16)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    data = yaml.safe_load(H100_QWEN3_8B.read_text())
    assert checkpoint_warnings(parse_profile(data), tmp_path / "t", tmp_path / "d") == []
    data["sweep"].update(input_len=4096, output_len=4096)
    (warning,) = checkpoint_warnings(parse_profile(data), tmp_path / "t", tmp_path / "d")
    assert "max_batch_size 128 cannot be held at 4096/4096 tokens" in warning


def test_plan_config_reads_local_model_folders(tmp_path: Path, capsys):
    """A profile naming local folders plans from their config.json, exactly as from the recorded configs."""
    from dflash_trt.cli import main
    from dflash_trt.recorded_configs import packaged_recorded_configs

    recorded = packaged_recorded_configs()
    data = yaml.safe_load(H100_QWEN3_8B.read_text())
    for role in ("target", "draft"):
        folder = tmp_path / role
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(recorded[data["model"][role]]))
    assert main(["plan", "--config", str(H100_QWEN3_8B), "--json"]) == 0
    from_recorded = json.loads(capsys.readouterr().out)
    data["model"] |= {"target": str(tmp_path / "target"), "draft": str(tmp_path / "draft")}
    data["quantization"]["calibration"]["dataset"] = str(ROOT / "build_configs/calibration.jsonl")
    local = tmp_path / "local.yaml"
    local.write_text(yaml.safe_dump(data))
    assert main(["plan", "--config", str(local), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["capacity"] == from_recorded["capacity"]
    data["model"]["target"] = str(tmp_path / "absent")
    local.write_text(yaml.safe_dump(data))
    assert main(["plan", "--config", str(local)]) == 2
    assert "not recorded and not on this machine" in capsys.readouterr().err
