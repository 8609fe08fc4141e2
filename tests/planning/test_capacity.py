"""Capacity planner: the worked example of docs/performance.md redone by hand, warnings, shipped profile comments."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from dflash_trt.analysis.published import PAIRS, pair_for_models
from dflash_trt.errors import DFlashTrtError
from dflash_trt.pipeline.capacity import capacity_warnings, plan_capacity
from dflash_trt.pipeline.profiles import load_profile, parse_profile

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "build_configs").glob("*/*.yaml"))
H100_QWEN3_8B = ROOT / "build_configs/h100-fp8/qwen3-8b.yaml"


def _capacity(profile, shape=None):
    target, drafter = PAIRS[pair_for_models(profile.model.target, profile.model.draft)].load()
    return plan_capacity(profile, target, drafter, shape)


def test_worked_example_h100_fp8_qwen3_8b_by_hand():
    cap = _capacity(load_profile(H100_QWEN3_8B))
    # The device reports 81559 MiB, not 80 decimal GB.
    assert cap.budget.memory_bytes == 81559 * 2**20 == 85_520_809_984
    # Weights: one Qwen3-8B layer = attention 4096 x (32 + 2 x 8) x 128 + 32 x 128 x 4096 = 41,943,040
    # plus MLP 3 x 4096 x 12288 = 150,994,944, i.e. 192,937,984; 36 target + 5 drafter layers in FP8 (1 B).
    # In bf16 and on every rank: the embedding 151936 x 4096 and the drafter's fc 5 x 4096^2 (both replicated by
    # the converter, the fc excluded from quantization); the lm_head 151936 x 4096 (its own tensor).
    layer = 4096 * 48 * 128 + 32 * 128 * 4096 + 3 * 4096 * 12288
    weights = 41 * layer * 1 + 151936 * 4096 * 2 + 5 * 4096**2 * 2 + 151936 * 4096 * 2
    assert layer == 192_937_984 and cap.budget.weights_bytes == weights == 10_567_548_928
    # Activations: 8192 tokens x (2 x 4096 + 48 x 128 + 2 x 12288) x 2 B, plus fp32 logits for 128 x 16 rows.
    activations = 8192 * (2 * 4096 + 48 * 128 + 2 * 12288) * 2 + 128 * 16 * 151936 * 4
    assert cap.budget.activation_bytes == activations == 1_882_193_920
    # Pool: 0.9 x (85.52 GB - weights - activations - 2 GB runtime); a token is 41 layers x K,V x 8 heads x 128 B.
    pool = 0.9 * (85_520_809_984 - weights - activations - 2e9)
    assert cap.budget.kv_pool_bytes == pytest.approx(pool)
    assert cap.budget.kv_bytes_per_token == 41 * 2 * 8 * 128 == 83_968
    blocks = math.floor(pool / (83_968 * 32))
    assert cap.budget.blocks == blocks == 23_805
    # A sequence reserves prompt + output, plus the EAGLE-mode step headroom maxPathLen + maxDecodingTokens =
    # 2 x (15 + 1) = 32 tokens, in whole 32-token blocks.
    assert cap.headroom_tokens == 32
    assert cap.sequences_at_shape == blocks // math.ceil((1024 + 1024 + 32) / 32) == 366
    assert cap.sequences_at_max_seq_len == blocks // math.ceil((8192 + 32) / 32) == 92


def test_a_draft_tree_reserves_its_nodes_beside_the_chains_positions():
    """The same profile with 32-node trees at 64 requests: the logits rows are 64 x 33, and a sequence's step
    headroom maxPathLen + maxDecodingTokens = (15 + 1) + (32 + 1) = 49 tokens."""
    data = yaml.safe_load(H100_QWEN3_8B.read_text())
    data["engine"].update(max_batch_size=64, draft_tree=32, draft_len_schedule="none")
    data["sweep"]["concurrency"] = [1, 64]
    cap = _capacity(parse_profile(data))
    activations = 8192 * (2 * 4096 + 48 * 128 + 2 * 12288) * 2 + 64 * 33 * 151936 * 4
    assert cap.budget.activation_bytes == activations
    assert cap.headroom_tokens == 49
    assert cap.sequences_at_shape == cap.budget.blocks // math.ceil((1024 + 1024 + 49) / 32)
    assert cap.sequences_at_max_seq_len == cap.budget.blocks // math.ceil((8192 + 49) / 32)


def test_tied_target_still_pays_for_its_own_lm_head_and_tp_replicates_the_embedding():
    data = yaml.safe_load((ROOT / "build_configs/h100-fp8/qwen3-4b.yaml").read_text())
    tp1 = _capacity(parse_profile(data))
    target, drafter = PAIRS["qwen3-4b"].load()
    assert target.tied_embeddings  # Qwen3-4B ties them; the converter writes lm_head from embed_tokens anyway
    t = target.stack
    linears = t.num_layers * t.layer_params(False) + drafter.stack.num_layers * drafter.stack.layer_params(False)
    embedding, fc = target.vocab * t.hidden * 2, drafter.num_taps * t.hidden**2 * 2
    assert tp1.budget.weights_bytes == linears + embedding + fc + target.vocab * t.hidden * 2
    data["checkpoint"]["tp_size"] = 2
    tp2 = _capacity(parse_profile(data))
    assert tp2.budget.weights_bytes == linears / 2 + embedding + fc + math.ceil(target.vocab / 2) * t.hidden * 2


def test_tensor_parallel_splits_weights_and_kv_heads():
    data = yaml.safe_load((ROOT / "build_configs/h200-fp8/qwen3-32b.yaml").read_text())
    tp2 = _capacity(parse_profile(data))
    data["checkpoint"]["tp_size"] = 8
    tp8 = _capacity(parse_profile(data))
    target, drafter = PAIRS["qwen3-32b"].load()
    replicated = (target.vocab + drafter.num_taps * target.stack.hidden) * target.stack.hidden * 2
    assert tp8.budget.weights_bytes - replicated == pytest.approx((tp2.budget.weights_bytes - replicated) / 4)
    # 8 KV heads: 4 per rank at TP 2, 1 per rank at TP 8 (69 layers x K,V x 128 x 1 B per head).
    assert (tp2.budget.kv_bytes_per_token, tp8.budget.kv_bytes_per_token) == (69 * 2 * 4 * 128, 69 * 2 * 1 * 128)


def test_a_batch_the_pool_cannot_hold_is_warned_about():
    profile = load_profile(H100_QWEN3_8B)
    assert capacity_warnings(profile, _capacity(profile)) == []
    long = _capacity(profile, (4096, 4096))  # ceil((8192 + 32) / 32) = 257 blocks each: 92 sequences < 128
    (warning,) = capacity_warnings(profile, long)
    assert "max_batch_size 128 cannot be held at 4096/4096 tokens" in warning and "about 92" in warning


def test_weights_beyond_memory_are_one_clear_error():
    data = yaml.safe_load((ROOT / "build_configs/h100-fp8/qwen3-32b.yaml").read_text())
    data["quantization"].update(qformat="none", dflash_qformat="none", kv_cache_dtype="none")
    data["engine"]["gemm_plugin"] = "auto"
    del data["engine"]["use_fp8_context_fmha"]
    data["checkpoint"]["tp_size"] = 1
    data["engine"]["max_num_tokens"] = 131072  # bf16 weights 70.2 GB + 21.3 GB of activations + 2 GB > 85.5 GB
    with pytest.raises(DFlashTrtError, match="exceed h100's 85.5 GB per GPU"):
        _capacity(parse_profile(data))


def test_a_pool_without_room_for_one_full_sequence_is_refused():
    """1.2.x would clamp the attention window below max_seq_len (a cyclic cache against absolute KV-injection
    pages). The worked example's pool is 23,805 blocks of 32 tokens: max_seq_len 761,728 (+ 32 tokens of EAGLE
    headroom) needs exactly 23,805 of them, 761,729 one more than the pool holds."""
    data = yaml.safe_load(H100_QWEN3_8B.read_text())
    data["engine"]["max_seq_len"] = 23_805 * 32 - 32
    assert _capacity(parse_profile(data)).sequences_at_max_seq_len == 1
    data["engine"]["max_seq_len"] += 1
    with pytest.raises(DFlashTrtError, match="cannot hold one sequence of max_seq_len 761729, so TensorRT-LLM would"):
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
        b = c.budget
        row = (f"| {p.name} | {p.gpu} x{p.checkpoint.tp_size} | {b.weights_bytes / 1e9:.2f} GB | "
               f"{b.kv_pool_bytes / 1e9:.2f} GB | {b.kv_bytes_per_token:,.0f} B | {c.sequences_at_shape} | "
               f"{c.sequences_at_max_seq_len} | {p.engine.max_batch_size} |")  # fmt: skip
        assert row in doc, row


def test_build_checks_warn_from_the_checkpoint_configs(tmp_path: Path):
    import json

    from dflash_trt.analysis import published
    from dflash_trt.pipeline.capacity import checkpoint_warnings

    for name, cfg in (("t", published.QWEN3_8B), ("d", published.QWEN3_8B_DFLASH_B16)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    data = yaml.safe_load(H100_QWEN3_8B.read_text())
    assert checkpoint_warnings(parse_profile(data), tmp_path / "t", tmp_path / "d") == []
    data["sweep"].update(input_len=4096, output_len=4096)
    (warning,) = checkpoint_warnings(parse_profile(data), tmp_path / "t", tmp_path / "d")
    assert "max_batch_size 128 cannot be held at 4096/4096 tokens" in warning


def test_a_shape_longer_than_max_seq_len_holds_no_sequence():
    data = yaml.safe_load(H100_QWEN3_8B.read_text())
    data["engine"].update(max_seq_len=128, max_input_len=64)
    profile = parse_profile(data)
    cap = _capacity(profile, (1024, 1024))
    assert (
        cap.budget.blocks > 20_000 and cap.sequences_at_shape == 0
    )  # plenty of blocks, but no 2048-token request runs
    (warning,) = capacity_warnings(profile, cap)
    assert "1024/1024 tokens exceed max_seq_len 128" in warning


def _feasible(method_name: str, concurrency: list[int], lengths=(1024, 1024), limits=None, gpu="h100", **dep_kw):
    from dflash_trt.analysis.gpus import get_gpu
    from dflash_trt.analysis.memory import EngineLimits, feasible_curve
    from dflash_trt.analysis.model import Acceptance, Deployment, Method

    target, drafter = PAIRS[dep_kw.pop("pair", "qwen3-8b")].load()
    method = Method("ar") if method_name == "ar" else Method("dflash", drafter, Acceptance.from_mean(5.0, 16))
    dep = Deployment(get_gpu(gpu), dep_kw.get("precision", "fp8"), dep_kw.get("kv_dtype", "fp8"), dep_kw.get("tp", 1))
    return feasible_curve(method, target, dep, concurrency, lengths, limits or EngineLimits(max(concurrency)))


def test_every_curve_point_is_capped_at_what_the_kv_pool_holds():
    from dflash_trt.analysis.memory import EngineLimits

    # Qwen3-8B DFlash in FP8 on one H100, 2048 users at 8k/8k. By hand, per GPU: weights 10,567,548,928 B (as in
    # the worked example); activations 8192 x 38,912 x 2 + 2048 x 16 x 151,936 x 4 = 20,551,041,024 B; the pool
    # 0.9 x (85,520,809,984 - weights - activations - 2e9) = 46,962,997,228.8 B = 17,478 blocks of 2,686,976 B; a
    # sequence needs ceil((16,384 + 32) / 32) = 513 blocks, so 34 sequences run.
    pool = 0.9 * (85_520_809_984 - 10_567_548_928 - (8192 * 38_912 * 2 + 2048 * 16 * 151_936 * 4) - 2e9)
    assert int(pool // 2_686_976) // 513 == 34
    (point,) = _feasible("dflash", [2048], (8192, 8192), EngineLimits(2048, 8192))
    assert (point.requested, point.batch, point.fits) == (2048, 34, False)
    assert "KV pool holds 34 sequences of 8192+8192 tokens" in point.reason
    assert point.point is not None and point.point.concurrency == 2048  # reported at the request, computed at 34
    # A billion users run no more than the pool holds either.
    (huge,) = _feasible("ar", [10**9], (1024, 1024), EngineLimits())
    assert not huge.fits and 0 < huge.batch < 2048 and "KV pool holds" in huge.reason


def test_engine_limits_cap_the_batch_too():
    from dflash_trt.analysis.memory import EngineLimits

    # max_num_tokens 1024 holds 1024 // 16 = 64 DFlash sequences per step (a 16-token block each), AR 1024.
    tokens = _feasible("dflash", [32, 128], limits=EngineLimits(256, 1024))
    assert [(p.batch, p.fits) for p in tokens] == [(32, True), (64, False)]
    assert "max_num_tokens 1024 holds 64 sequences of 16 tokens per step" in tokens[1].reason
    batch = _feasible("ar", [32, 128], limits=EngineLimits(100, 8192))
    assert [(p.batch, p.fits) for p in batch] == [(32, True), (100, False)] and "max_batch_size 100" in batch[1].reason


def test_weights_that_do_not_fit_leave_no_point():
    # gpt-oss-120b in bf16: 116.8 B parameters x 2 B = 234 GB on one 85.5 GB H100.
    curve = _feasible("ar", [1, 8], pair="gpt-oss-120b", precision="bf16", kv_dtype="bf16")
    assert all(p.batch == 0 and p.point is None and not p.fits for p in curve)
    assert "exceed H100 SXM's 85.5 GB per GPU at tp 1" in curve[0].reason
    # On eight H200s in MXFP4 the same model fits.
    assert all(p.fits for p in _feasible("ar", [1, 8], pair="gpt-oss-120b", precision="mxfp4", gpu="h200", tp=8))


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
