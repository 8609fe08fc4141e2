"""Roofline model: hand-computed pass costs, acceptance distributions, published shapes, the docs table."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dflash_trt.analysis import published
from dflash_trt.analysis.comm import nccl_fit
from dflash_trt.analysis.gpus import GPUS, GpuSpec, get_gpu
from dflash_trt.analysis.model import (
    Acceptance,
    Calibration,
    Deployment,
    DFlashShape,
    Method,
    StackShape,
    TargetShape,
    collective_seconds,
    predict_curve,
    roofline_seconds,
    stack_pass,
)
from dflash_trt.analysis.pareto import crossover_concurrency
from dflash_trt.analysis.shapes import dflash_from_spec
from dflash_trt.errors import DFlashTrtError
from dflash_trt.spec import parse_draft_config, parse_target_config

TINY = StackShape(num_layers=2, hidden=4, intermediate=8, num_heads=2, num_kv_heads=1, head_dim=2)
UNIT_GPU = GpuSpec("unit", 1e9, 1000.0, 1000.0, 2000.0, None, "nvlink4", "test", sm=100)


def test_acceptance_from_position_rates_and_histogram():
    acc = Acceptance.from_position_rates([0.5, 0.5])
    assert acc.probs == pytest.approx((0.5, 0.25, 0.25)) and acc.mean() == pytest.approx(1.75)
    assert Acceptance.from_histogram([1, 1, 2]).probs == pytest.approx((0.25, 0.25, 0.5))
    assert acc.resized(2).probs == pytest.approx((0.5, 0.5))
    assert acc.resized(3).probs == pytest.approx(acc.probs)


def test_a_mean_measured_at_a_shorter_draft_extends_at_its_own_rate():
    # A drafter measured with 7 drafts at a constant per-position rate r, run with 15 drafts: the same rate
    # continues, so the 15-draft distribution is the truncated geometric with rate r over 15 positions.
    short = Acceptance.from_mean(5.0, 8)
    rate = short.conditional_rate(0)
    assert all(short.conditional_rate(i) == pytest.approx(rate) for i in range(7))
    longer = short.resized(16)
    assert longer.probs == pytest.approx(Acceptance.from_position_rates([rate] * 15).probs)
    assert longer.mean() > short.mean()
    # Back to 7 drafts it is the measured distribution again; a histogram continues at its last position's rate.
    assert longer.resized(8).probs == pytest.approx(short.probs)
    hist = Acceptance.from_histogram([1, 1, 2])  # rates: 3/4 at the first draft, 2/3 at the second
    assert hist.resized(4).probs == pytest.approx(Acceptance.from_position_rates([0.75, 2 / 3, 2 / 3]).probs)


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
    assert cost.allreduce_calls == 0 and cost.gather_bytes == 0
    # memory 672 / 800 = 0.84 s; compute (656 + 32) / 1000 / 0.6 = 1.1467 s -> compute-bound.
    assert roofline_seconds(cost, dep) == pytest.approx(688 / 1000 / 0.6)
    assert collective_seconds(cost, dep) == 0.0


def test_tensor_parallel_splits_work_and_adds_priced_collectives():
    dep = Deployment(UNIT_GPU, "bf16", "bf16", 2)
    cost = stack_pass(TINY, batch=1, q=1, ctx=0, dep=dep, logits_rows=1, vocab=10)
    # Weights halve; the single KV head is replicated on both GPUs.
    assert cost.bytes == 656 / 2 + 16
    assert cost.allreduce_calls == 4 and cost.allreduce_bytes == 1 * 4 * 2
    assert cost.gather_bytes == 1 * 10 * 2  # one row of bf16 logits gathered over the vocabulary split
    # Four one-shot all-reduces of 8 B at TP 2: 3.7 us each (the published table's smallest size); the logits
    # all-gather pays NCCL's latency plus half of 20 B over its effective bus bandwidth (test_comm checks both).
    latency, efficiency = nccl_fit()
    gather = latency + 0.5 * 20 / (efficiency * 450e9)
    assert collective_seconds(cost, dep) == pytest.approx(4 * 3.7e-6 + gather)
    # A runtime's slowdown multiplies the collectives and nothing else.
    step = Method("ar").step(TargetShape(stack=TINY, vocab=10), 1, 0, dep)
    slow = Calibration(collective_slowdown=3.0)
    assert slow.seconds(step) - Calibration().seconds(step) == pytest.approx(2.0 * step.collective_s)


def test_moe_reads_only_touched_experts():
    moe = replace(TINY, num_experts=4, experts_per_token=1)
    assert moe.experts_touched(1) == pytest.approx(1.0)
    assert moe.experts_touched(2) == pytest.approx(4 * (1 - 0.75**2))
    assert moe.experts_touched(10_000) == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("shape", "published_params"),
    [
        (published.target(published.QWEN3_8B), 8.19e9),  # Qwen3-8B model card: 8.2B
        (published.target(published.QWEN3_32B), 32.8e9),  # Qwen3-32B model card: 32.8B
        (published.target(published.LLAMA31_8B), 8.03e9),  # Llama 3.1 8B: 8.03B
        (published.GPT_OSS_120B, 116.8e9),  # gpt-oss-120b model card: 117B total
    ],
)
def test_shapes_reproduce_published_parameter_counts(shape: TargetShape, published_params: float):
    assert shape.params() == pytest.approx(published_params, rel=0.01)


def test_zlab_taps_follow_the_dflash_package_and_the_recorded_drafters():
    from dflash.model import build_target_layer_ids

    for layers in (32, 36, 48, 64):
        assert published.zlab_taps(layers) == build_target_layer_ids(layers, 5)
    for drafter in (published.QWEN3_4B_DFLASH_B16, published.QWEN3_8B_DFLASH_B16):
        assert published.zlab_taps(36) == drafter["dflash_config"]["target_layer_ids"]


def test_assumed_drafters_take_the_recorded_targets_values():
    # Equal to the shapes written out by hand before they were derived (hidden, MLP, KV heads, taps, block).
    for target, drafter, expected in [
        (published.LLAMA31_8B, published.LLAMA31_8B_DFLASH, (5, 4096, 14336, 32, 8, 10, [1, 8, 15, 22, 29])),
        (published.QWEN3_32B, published.QWEN3_32B_DFLASH, (5, 5120, 25600, 32, 8, 16, [1, 16, 31, 46, 61])),
        (
            published.QWEN3_CODER_30B_A3B,
            published.QWEN3_CODER_30B_A3B_DFLASH,
            (8, 2048, 6144, 32, 4, 16, [1, 12, 23, 34, 45]),
        ),
    ]:
        shape = published.dflash(target, drafter)
        s = shape.stack
        got = (s.num_layers, s.hidden, s.intermediate, s.num_heads, s.num_kv_heads, shape.block_size)
        assert got + (drafter["dflash_config"]["target_layer_ids"],) == expected
        assert s.head_dim == 128 and drafter["rope_theta"] == target["rope_theta"]


def test_moe_active_parameters_per_token():
    # gpt-oss-120b model card: 5.1B active parameters per token (embeddings counted once, as the card does).
    active = published.GPT_OSS_120B.params(active=True) - published.GPT_OSS_120B.vocab * 2880
    assert active == pytest.approx(5.1e9, rel=0.03)


def test_ar_single_stream_is_weight_bandwidth_bound():
    tgt = published.target(published.QWEN3_8B)
    dep = Deployment(get_gpu("b200"), "bf16", "bf16", 1, Calibration(bandwidth_efficiency=1.0))
    it = Method("ar").iteration(tgt, 1, 1000, dep)
    assert it.cost.collective_s == 0.0
    weights = 2 * (tgt.stack.num_layers * (tgt.stack.attn_params() + tgt.stack.expert_params()) + tgt.vocab * 4096)
    kv = 36 * 1001 * 2 * 8 * 128 * 2
    assert it.seconds == pytest.approx((weights + kv) / 7.7e12, rel=1e-6)  # HGX B200: 7.7 TB/s per GPU


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


def test_concurrency_regime_matches_a_hand_computed_roofline():
    """One 1-layer target (144 params, vocab 10) and a drafter reduced to its lm_head rows, B = 2, tau = 2,
    bandwidth 1000 B/s, tensor rate 10^4 FLOP/s, no overheads. By hand, per iteration at concurrency c:
      AR:     max((368 + 8c) / 1000, 384c / 10^4)                      weights+lm_head 368 B, KV 8 B/key
      verify: max((368 + 16c) / 1000, (736c + 64c) / 10^4)            2 tokens/seq: GEMMs 736c, attention 64c
      draft:  max(80 / 1000, 80c / 10^4)                               lm_head on c x (B - 1) rows
    so AR turns compute-bound above c = 12.1, the verify above c = 5.75, and DFlash (2 tokens per iteration)
    stops paying where 2 (0.368 + 0.008c) = 0.088c, i.e. c = 10.22."""
    gpu = GpuSpec("unit", 1e9, 1000.0, 1e4, 2e4, None, "nvlink4", "test", sm=100)
    dep = Deployment(gpu, "bf16", "bf16", 1, Calibration(bandwidth_efficiency=1.0, compute_efficiency=1.0))
    tgt = TargetShape(stack=replace(TINY, num_layers=1), vocab=10)
    drafter = DFlashShape(stack=replace(TINY, num_layers=0), num_taps=0, block_size=2)
    dflash, ar = Method("dflash", drafter, Acceptance.from_mean(2.0, 2)), Method("ar")

    def hand(c: int) -> tuple[float, float]:
        t_ar = max((368 + 8 * c) / 1000, 384 * c / 1e4)
        t_df = max((368 + 16 * c) / 1000, 800 * c / 1e4) + max(80 / 1000, 80 * c / 1e4)
        return c / t_ar, 2 * c / t_df

    for c in (1, 4, 10, 11, 64):
        want_ar, want_df = hand(c)
        assert c / ar.iteration(tgt, c, 0, dep).seconds == pytest.approx(want_ar)
        it = dflash.iteration(tgt, c, 0, dep)
        assert c * it.tokens_per_seq / it.seconds == pytest.approx(want_df)
    assert hand(10)[1] > hand(10)[0] and hand(11)[1] < hand(11)[0]  # the crossover lies between 10 and 11
    curve = {m.name: predict_curve(m, tgt, dep, [8, 16], 0) for m in (ar, dflash)}
    cross = crossover_concurrency(curve["dflash"], curve["ar"])
    assert cross.pays_at == (8,) and cross.loses_at == (16,)
