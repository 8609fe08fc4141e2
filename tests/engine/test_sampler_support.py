"""The engine's sampler (`trtllm/verify.py` `sample_rows`, run through the emulated ops) never draws a token of
probability zero, and draws the inverse CDF's token, for every uniform where the outcome can change: 0+ (the
smallest fp32 and curand's 2^-32), 1.0 (curand's uniforms lie in (0, 1]), every block boundary of the two-level
CDF and its fp32 neighbours, and every token boundary; on rows whose fp32 prefix sums round below the block mass.

The oracle is float64: token probabilities of softmax(z / T) and exact (fraction) cumulative sums of them. A drawn
token must have positive probability, and its exact CDF interval must reach the uniform within the fp32 sampler's
rounding (a few ulps of the total mass)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from dflash_trt.emulation import functional
from dflash_trt.emulation.functional import Network, PluginConfig, net_guard
from dflash_trt.emulation.stand_ins import load_engine_module
from dflash_trt.reference.sampling import sample_by_uniform
from dflash_trt.sampling_rules import MIN_SAMPLING_TEMPERATURE
from dflash_trt.trtllm.inverse_cdf import vocab_blocks

VOCAB = 1000  # 32 blocks of 32
ROUNDING = 2.0**-18  # the fp32 sampler's error on a cumulative mass, relative to the total (generous)


def engine_sample(logits: torch.Tensor, temperature: float, uniforms: list[float], vocab: int) -> list[int]:
    """`sample_rows` of the real verify.py under the stand-ins: one row per uniform."""
    sample_rows = load_engine_module().verify_drafts.__globals__["sample_rows"]
    rows = len(uniforms)
    with net_guard(Network(PluginConfig())):
        tokens = sample_rows(
            functional.Tensor(data=logits.float()[None].expand(rows, -1).contiguous()),
            functional.Tensor(data=torch.full((rows, 1), temperature)),
            functional.Tensor(data=torch.tensor(uniforms, dtype=torch.float32)[:, None]),
            vocab,
        )
        return tokens.data[:, 0].tolist()


def exact_cdf(logits: torch.Tensor, temperature: float, vocab: int) -> tuple[np.ndarray, list[Fraction]]:
    """float64 probabilities of the real vocabulary, and their exact cumulative sums."""
    z = logits[:vocab].double() / temperature
    probs = torch.softmax(z, dim=0).numpy()
    cumulative, total = [], Fraction(0)
    for p in probs:
        total += Fraction(float(p))
        cumulative.append(total)
    return probs, cumulative


def boundary_uniforms(logits: torch.Tensor, temperature: float, vocab: int) -> list[float]:
    """0+, 1.0, and each token's and each block's cumulative mass (as a fraction of the total) with both fp32
    neighbours."""
    real = logits[:vocab].double()
    cumulative = torch.cumsum(torch.exp((real - real.max()) / temperature), 0)
    count, width = vocab_blocks(logits.shape[0])
    points = cumulative / cumulative[-1]
    block_ends = points[[min((j + 1) * width, vocab) - 1 for j in range(count) if j * width < vocab]]
    uniforms = {float(np.float32(2.0**-149)), 2.0**-32, 1.0}
    for point in torch.cat([points, block_ends]).float():
        for value in (point, torch.nextafter(point, torch.tensor(0.0)), torch.nextafter(point, torch.tensor(2.0))):
            if 0.0 < float(value) <= 1.0:
                uniforms.add(float(value))
    return sorted(uniforms)


def check(logits: torch.Tensor, temperature: float, vocab: int = VOCAB) -> int:
    """Every boundary uniform draws a positive-probability token whose exact CDF interval holds the uniform
    (within ROUNDING); returns how many uniforms were checked."""
    uniforms = boundary_uniforms(logits, temperature, vocab)
    tokens = engine_sample(logits, temperature, uniforms, vocab)
    probs, cumulative = exact_cdf(logits, temperature, vocab)
    total = cumulative[-1]
    for u, token in zip(uniforms, tokens, strict=True):
        assert 0 <= token < vocab, f"u={u!r}: token {token} outside the vocabulary"
        assert probs[token] > 0, f"u={u!r}: token {token} has probability zero"
        low = cumulative[token - 1] if token else Fraction(0)
        target = Fraction(u) * total
        slack = Fraction(ROUNDING) * total
        assert low - slack <= target <= cumulative[token] + slack, f"u={u!r}: token {token} is not the inverse CDF"
    return len(uniforms)


def _row(seed: int, padded: int = VOCAB) -> torch.Tensor:
    return torch.rand(padded, generator=torch.Generator().manual_seed(seed)) * 4.0


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_a_zero_probability_tail_is_never_drawn(temperature):
    """The reported case: tokens 500-999 at -1e4 (weight 0 in fp32); u = 1.0 once drew token 511."""
    logits = _row(1)
    logits[500:] = -1e4
    assert check(logits, temperature) > 2 * 500
    assert engine_sample(logits, temperature, [1.0], VOCAB) == [499]


def test_leading_zero_probability_tokens_at_u_near_zero():
    """Whole blocks and part of the next one at zero weight: 0+ must land on the first positive token, 40."""
    logits = _row(2)
    logits[:40] = -1e4
    check(logits, 1.0)
    assert engine_sample(logits, 1.0, [float(np.float32(2.0**-149)), 2.0**-32], VOCAB) == [40, 40]


def test_zero_probability_islands_between_positive_tokens():
    logits = _row(3)
    for start in range(0, VOCAB, 97):
        logits[start : start + 45] = -torch.inf
    check(logits, 1.3)


def test_sums_that_round_above_the_block_prefix_sums():
    """Block 0 holds one token of weight 1, block 1 eight tokens of 0.2 ulp(1) each (1.6 ulp in all), the rest
    nothing. In fp32 block 1's cumulative mass rounds up to 1 + 2 ulp and its start `cdf - mass` rounds down to 1,
    so at u = 1.0 the threshold inside block 1 (2 ulp) exceeds every prefix sum of it (at most 1.6 ulp). The last
    positive token, 39, must be drawn, not the block's zero-weight tail."""
    ulp = 2.0**-23
    logits = torch.full((VOCAB,), -1e4)
    logits[0] = 0.0
    logits[32:40] = float(np.log(0.2 * ulp))
    mass = torch.exp(logits[32:40].float()).sum()
    cdf = torch.tensor(1.0) + mass
    assert cdf - (cdf - mass) > mass  # the rounding this test is about (scalar IEEE fp32, any CPU)
    check(logits, 1.0)
    assert engine_sample(logits, 1.0, [1.0], VOCAB) == [39]


@pytest.mark.parametrize("padded", [1024, 1000 + 7])
def test_lm_head_padding_is_never_drawn(padded):
    """Columns past the vocabulary (TP padding of lm_head) have no mass, even at u = 1.0."""
    logits = _row(4, padded)
    check(logits, 1.0, vocab=VOCAB)
    assert engine_sample(logits, 1.0, [1.0], VOCAB) == [VOCAB - 1]


UNIFORMS = [float(np.float32(2.0**-149)), 0.5, 1.0]


@pytest.mark.parametrize(
    "temperature", [0.0, 1e-45, 1e-40, 5e-324, 9.9e-6, float(np.nextafter(np.float32(1e-5), np.float32(0)))]
)
def test_temperatures_too_small_to_invert_take_the_argmax_in_graph_and_in_the_golden_rule(temperature):
    """Tokens 7 and 8 a hair apart: at 1e-40 the float32 inverse is inf and the weights NaN (the sampler used to
    gather index -1). Below the minimum both the network and `sample_by_uniform` take the argmax, 8, at any uniform."""
    logits = _row(5)
    logits[7], logits[8] = 9.0, 9.0 + 2e-6
    assert engine_sample(logits, temperature, UNIFORMS, VOCAB) == [8, 8, 8]
    golden = [
        int(sample_by_uniform(logits[None], temperature, torch.tensor([u], dtype=torch.float64))) for u in UNIFORMS
    ]
    assert golden == [8, 8, 8]


def test_the_minimum_temperature_itself_samples_in_graph_and_in_the_golden_rule():
    """At T = 1e-5 the two tokens weigh 1 and exp(-0.2) (z differ by 2e-6): u = 1.0 falls in token 8's interval
    and u = 0+ in token 7's, so the sample is not the argmax everywhere; the golden rule agrees."""
    logits = _row(5)
    logits[7], logits[8] = 9.0, 9.0 + 2e-6
    assert engine_sample(logits, MIN_SAMPLING_TEMPERATURE, UNIFORMS, VOCAB) == [7, 8, 8]
    golden = [
        int(sample_by_uniform(logits[None], MIN_SAMPLING_TEMPERATURE, torch.tensor([u], dtype=torch.float64)))
        for u in UNIFORMS
    ]
    assert golden == [7, 8, 8]


@pytest.mark.parametrize("temperature", [1e30, 3e38, math.inf])
def test_huge_temperatures_sample_uniformly_never_a_padding_column(temperature):
    """3e38's float32 inverse is a denormal (zero where flushed) and 1e39 reaches the engine as inf; the network caps
    the temperature at the maximum, so lm_head padding keeps zero weight and the finite logits are all but equally
    likely: the uniform in the middle of token k's 1/V share draws token k."""
    logits = _row(6, VOCAB + 7)
    middles = [(k + 0.5) / VOCAB for k in (0, 333, VOCAB - 1)]
    assert engine_sample(logits, temperature, [*middles, 1.0], VOCAB) == [0, 333, VOCAB - 1, VOCAB - 1]
