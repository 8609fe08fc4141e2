"""Roofline model: hand-computed pass costs, acceptance distributions, published shapes, the docs table."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dflash_trt.errors import DFlashTrtError
from dflash_trt.perf import published
from dflash_trt.perf.gpus import GPUS, GpuSpec, get_gpu
from dflash_trt.perf.model import (
    Acceptance,
    Calibration,
    Deployment,
    Method,
    StackShape,
    TargetShape,
    pass_time,
    predict_curve,
    stack_pass,
)
from dflash_trt.perf.pareto import crossover_concurrency
from dflash_trt.perf.shapes import dflash_from_spec
from dflash_trt.spec import parse_draft_config, parse_target_config

TINY = StackShape(num_layers=2, hidden=4, intermediate=8, num_heads=2, num_kv_heads=1, head_dim=2)
UNIT_GPU = GpuSpec("unit", 1e9, 1000.0, 1000.0, 2000.0, None, 100.0, "test", sm=100)


def test_acceptance_from_position_rates_and_histogram():
    acc = Acceptance.from_position_rates([0.5, 0.5])
    assert acc.probs == pytest.approx((0.5, 0.25, 0.25)) and acc.mean() == pytest.approx(1.75)
    assert Acceptance.from_histogram([1, 1, 2]).probs == pytest.approx((0.25, 0.25, 0.5))
    assert acc.truncated(2).probs == pytest.approx((0.5, 0.5))
    assert acc.truncated(5) is acc


@pytest.mark.parametrize(("mean", "length"), [(6.55, 16), (1.0, 16), (2.9, 4), (10.0, 10)])
def test_acceptance_from_mean_reproduces_the_mean(mean, length):
    acc = Acceptance.from_mean(mean, length)
    assert acc.max_length == length and acc.mean() == pytest.approx(mean, abs=1e-9)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Acceptance((0.5, 0.4)),
        lambda: Acceptance.from_position_rates([1.2]),
        lambda: Acceptance.from_mean(17.0, 16),
        lambda: Acceptance.from_histogram([0, 0]),
    ],
)
def test_bad_acceptance_inputs_are_refused(make):
    with pytest.raises(DFlashTrtError):
        make()


def test_pass_cost_matches_hand_computation():
    dep = Deployment(UNIT_GPU, "bf16", "bf16", 1, Calibration(bandwidth_efficiency=0.8, compute_efficiency=0.6))
    cost = stack_pass(TINY, batch=1, q=1, ctx=0, dep=dep, logits_rows=1, vocab=10)
    # attn = 4*(4+2+2) + 4*4 = 48, mlp = 3*4*8 = 96; weights 2*(48+96)*2 B + lm_head 10*4*2 B = 656 B;
    # KV: 2 layers * 1 key * (2 * 1 head * 2 dims * 2 B) = 16 B.
    assert cost.bytes == 672
    assert cost.linear_flops == 2 * 2 * (48 + 96) + 2 * 10 * 4
    assert cost.attention_flops == 4 * 2 * 1 * 1 * 2 * 2
    assert cost.allreduces == 0
    # memory 672 / 800 = 0.84 s; compute (656 + 32) / 1000 / 0.6 = 1.1467 s -> compute-bound.
    assert pass_time(cost, dep) == pytest.approx(688 / 1000 / 0.6)


def test_tensor_parallel_splits_work_and_adds_ring_allreduces():
    dep = Deployment(UNIT_GPU, "bf16", "bf16", 2, Calibration(allreduce_latency_s=0.5))
    cost = stack_pass(TINY, batch=1, q=1, ctx=0, dep=dep, logits_rows=1, vocab=10)
    # Weights halve; the single KV head is replicated on both GPUs.
    assert cost.bytes == 656 / 2 + 16
    assert cost.allreduces == 4 and cost.allreduce_bytes == 1 * 4 * 2
    single = replace(cost, allreduces=0)
    # Ring all-reduce: 2 (tp-1)/tp * 8 B / 100 B/s = 0.08 s each, plus 0.5 s latency.
    assert pass_time(cost, dep) == pytest.approx(pass_time(single, dep) + 4 * (0.5 + 0.08))


def test_moe_reads_only_touched_experts():
    moe = replace(TINY, num_experts=4, experts_per_token=1)
    assert moe.experts_touched(1) == pytest.approx(1.0)
    assert moe.experts_touched(2) == pytest.approx(4 * (1 - 0.75**2))
    assert moe.experts_touched(10_000) == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("shape", "published_params"),
    [
        (published.target(published.QWEN3_8B), 8.19e9),  # Qwen3-8B model card: 8.2B
        (published.target(published.LLAMA31_8B), 8.03e9),  # Llama 3.1 8B: 8.03B
        (published.GPT_OSS_120B, 116.8e9),  # gpt-oss-120b model card: 117B total
    ],
)
def test_shapes_reproduce_published_parameter_counts(shape: TargetShape, published_params: float):
    s = shape.stack
    experts = s.num_experts or 1
    layer = s.attn_params() + experts * s.expert_params() + s.hidden * s.num_experts
    total = s.num_layers * layer + 2 * shape.vocab * s.hidden
    assert total == pytest.approx(published_params, rel=0.01)


def test_ar_single_stream_is_weight_bandwidth_bound():
    tgt = published.target(published.QWEN3_8B)
    dep = Deployment(get_gpu("b200"), "bf16", "bf16", 1, Calibration(bandwidth_efficiency=1.0))
    it = Method("ar").iteration(tgt, 1, 1000, dep)
    weights = 2 * (tgt.stack.num_layers * (tgt.stack.attn_params() + tgt.stack.expert_params()) + tgt.vocab * 4096)
    kv = 36 * 1001 * 2 * 8 * 128 * 2
    assert it.seconds == pytest.approx((weights + kv) / 8e12, rel=1e-6)


def test_speculation_pays_at_low_concurrency_and_stops_paying_when_compute_bound():
    tgt = published.target(published.QWEN3_8B)
    drafter = published.dflash(published.QWEN3_8B, published.QWEN3_8B_DFLASH_B16)
    dep = Deployment(get_gpu("h100"), "fp8", "fp8", 1)
    conc = [1, 4, 16, 64, 256, 1024]
    ar = predict_curve(Method("ar"), tgt, dep, conc, 1024)
    weak = predict_curve(Method("dflash", drafter, Acceptance.from_mean(1.5, 16)), tgt, dep, conc, 1024)
    strong = predict_curve(Method("dflash", drafter, Acceptance.from_mean(6.5, 16)), tgt, dep, conc, 1024)
    assert strong[0].tok_s_user > 3 * ar[0].tok_s_user
    cross = crossover_concurrency(weak, ar)
    assert cross.concurrency is not None and 1 in cross.pays_at and 1024 in cross.loses_at
    # More accepted tokens per iteration never lowers throughput at equal concurrency.
    assert all(s.tok_s_gpu > w.tok_s_gpu for s, w in zip(strong, weak, strict=True))


def test_deployment_refuses_nvfp4_on_hopper_and_unknown_precisions():
    with pytest.raises(DFlashTrtError, match="NVFP4"):
        Deployment(get_gpu("h200"), "nvfp4")
    with pytest.raises(DFlashTrtError, match="precision"):
        Deployment(get_gpu("b300"), "int4")
    with pytest.raises(DFlashTrtError, match="unknown GPU"):
        get_gpu("a100")
    assert set(GPUS) == {"h100", "h200", "b200", "b300"}


def test_drafter_shape_counts_sliding_layers_from_the_spec():
    cfg = published.QWEN3_8B_DFLASH_B16 | {
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "use_sliding_window": True,
        "sliding_window": 2048,
    }
    drafter = dflash_from_spec(parse_draft_config(cfg, parse_target_config(published.QWEN3_8B)))
    assert drafter.stack.num_sliding_layers == 4 and drafter.stack.sliding_window == 2048
    assert drafter.num_taps == 5 and drafter.block_size == 16


@pytest.fixture(scope="module")
def validation():
    return published.all_rows()


def test_each_harness_is_fitted_on_exactly_one_number(validation):
    calibrations, rows = validation
    fits = [r for r in rows if r.role == "fit"]
    assert len(fits) == 3 and {r.source for r in fits} == {published.ZLAB, published.SGLANG, published.BLOG}
    assert all(abs(r.error) < 1e-3 for r in fits)
    assert calibrations["hf-transformers"].spec_overhead_s > 0
    assert calibrations["sglang"].step_overhead_s > 0
    checks = [r for r in rows if r.role == "check"]
    assert len(checks) >= 30 and all(r.predicted is not None or r.source == published.BLOG for r in checks)


def test_docs_carry_the_current_model_vs_published_table(validation):
    _, rows = validation
    doc = (Path(__file__).parents[1] / "docs" / "performance.md").read_text()
    assert published.markdown_table(rows) in doc, "regenerate the table with `dflash-trt plan --validate`"


def _plan(argv: list[str], capsys) -> dict:
    import argparse
    import json

    from dflash_trt.commands import plan

    parser = argparse.ArgumentParser()
    plan.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv, "--json"])
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_predicts_all_three_methods_from_checkpoint_configs(tmp_path, capsys):
    import json

    (tmp_path / "t").mkdir()
    (tmp_path / "d").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(published.QWEN3_8B))
    (tmp_path / "d" / "config.json").write_text(json.dumps(published.QWEN3_8B_DFLASH_B16))
    out = _plan(
        ["--model_dir", str(tmp_path / "t"), "--dflash_model_dir", str(tmp_path / "d"), "--gpu", "h100",
         "--qformat", "fp8", "--acceptance_length", "6", "--eagle3_acceptance_length", "2.9",
         "--concurrency", "1,8,64", "--calibration", "sglang"],
        capsys,
    )  # fmt: skip
    assert set(out["curves"]) == {"ar", "dflash", "eagle3"}
    dep = Deployment(get_gpu("h100"), "fp8", "bf16", 1, published.fitted_calibration("sglang"))
    tgt, drafter = published.PRESETS["qwen3-8b"]()
    expected = predict_curve(Method("dflash", drafter, Acceptance.from_mean(6, 16)), tgt, dep, [1, 8, 64], 1536)
    assert [p["tok_s_gpu"] for p in out["curves"]["dflash"]] == pytest.approx([p.tok_s_gpu for p in expected])
    assert out["speedup_vs_ar"][0]["speedup"]["dflash"] > 1


def test_plan_reads_an_acceptance_histogram_and_truncates_the_draft(tmp_path, capsys):
    import json

    hist = tmp_path / "acc.json"
    hist.write_text(json.dumps({"histogram": [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]}))
    full = _plan(["--preset", "gpt-oss-120b", "--gpu", "b300", "--qformat", "nvfp4", "--tp_size", "8",
                  "--acceptance_json", str(hist), "--concurrency", "1"], capsys)  # fmt: skip
    short = _plan(["--preset", "gpt-oss-120b", "--gpu", "b300", "--qformat", "nvfp4", "--tp_size", "8",
                   "--acceptance_json", str(hist), "--max_draft_len", "3", "--concurrency", "1"], capsys)  # fmt: skip
    # Uniform over 1..10 tokens has mean 5.5; cut to 4 tokens: (1+2+3)/10 + 4 * 0.7 = 3.4 tokens per step.
    ar = full["curves"]["ar"][0]["tok_s_user"]
    assert full["curves"]["dflash"][0]["tok_s_user"] > short["curves"]["dflash"][0]["tok_s_user"] > ar


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "qwen3-8b"], "exactly one"),
        (["--preset", "qwen3-8b", "--acceptance_length", "20"], r"\[1, 16\]"),
        (["--preset", "qwen3-8b", "--acceptance_length", "5", "--gpu", "h100", "--qformat", "nvfp4"], "NVFP4"),
        (["--preset", "qwen3-8b", "--acceptance_length", "5", "--max_draft_len", "16"], "max_draft_len"),
        (["--acceptance_length", "5"], "--model_dir"),
    ],
)
def test_plan_bad_input_gives_one_clear_error(argv, message, capsys):
    with pytest.raises(DFlashTrtError, match=message):
        _plan(argv, capsys)
