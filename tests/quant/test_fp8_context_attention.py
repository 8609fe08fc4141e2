"""FP8 context attention (`reference.quantized.fp8_context_attention`, docs/engine.md §9) against a float64 oracle that
rounds to e4m3 by its own table of the format's values, not through torch's float8 type.

The rule as read in the 1.2.x sources: Q is rounded to e4m3 under the KV cache's scale, the logits are taken in full
precision, every probability exp(s - rowmax) is rounded to e4m3 after mapping 1 to 448 (e4m3's largest value), and
the row is normalised by the unrounded sum. Both the golden model and the emulation call this one function, so
comparing them cannot catch a wrong rule; this test can.
"""

from __future__ import annotations

import math

import pytest
import torch

from dflash_trt.reference.quantized import fp8_context_attention

E4M3_MAX = 448.0


def e4m3_values() -> list[float]:
    """Every finite non-negative e4m3fn value: 4 exponent bits (bias 7), 3 mantissa bits, subnormals at exponent 0,
    and no infinity (exponent 15 with mantissa 7 is NaN)."""
    values = [m * 2.0**-9 for m in range(8)]
    values += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if (e, m) != (15, 7)]
    return values


VALUES = e4m3_values()


def round_e4m3(x: float) -> float:
    """Nearest e4m3 value, ties to the even mantissa, saturating at 448."""
    magnitude = min(abs(x), E4M3_MAX)
    below = max(v for v in VALUES if v <= magnitude)
    above = min((v for v in VALUES if v >= magnitude), default=below)
    if magnitude - below != above - magnitude:
        nearest = below if magnitude - below < above - magnitude else above
    else:
        nearest = below if VALUES.index(below) % 2 == 0 else above
    return math.copysign(nearest, x)


def near_midpoint(x: float) -> bool:
    """Whether `x` lies so close to a rounding midpoint that a last-bit difference upstream could flip it."""
    magnitude = min(abs(x), E4M3_MAX)
    below = max(v for v in VALUES if v <= magnitude)
    above = min((v for v in VALUES if v >= magnitude), default=below)
    return above > below and abs(magnitude - (below + above) / 2) < 1e-4 * (above - below)


def oracle(q, k, v, visible, scale, kv_scale):
    q64, k64, v64 = q.double(), k.double(), v.double()
    rounded_q = q64.clone().apply_(lambda x: round_e4m3(x / kv_scale) * kv_scale)
    logits = (rounded_q @ k64.T * scale).masked_fill(~visible, float("-inf"))
    probabilities = torch.exp(logits - logits.amax(-1, keepdim=True))
    scaled = probabilities * E4M3_MAX
    assert not any(near_midpoint(x) for x in scaled.flatten().tolist()), "pick data away from rounding midpoints"
    rounded = scaled.clone().apply_(round_e4m3) / E4M3_MAX
    return (rounded @ v64) / probabilities.sum(-1, keepdim=True)


def test_the_table_is_e4m3():
    assert len(VALUES) == 127 and max(VALUES) == E4M3_MAX and VALUES[1] == 2.0**-9
    assert [round_e4m3(x) for x in (1.0625, 1.1875, 500.0, -0.3)] == [1.0, 1.25, 448.0, -0.3125]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_context_attention_rounds_queries_and_probabilities_to_e4m3(seed):
    generator = torch.Generator().manual_seed(seed)
    tokens, keys, head_dim = 5, 7, 16
    kv_scale = 0.05
    q = torch.randn(tokens, head_dim, generator=generator) * 3
    k = torch.randn(keys, head_dim, generator=generator)
    v = torch.randn(keys, head_dim, generator=generator)
    visible = torch.arange(keys)[None, :] <= torch.arange(tokens)[:, None] + keys - tokens  # causal over a past
    scale = head_dim**-0.5
    expected = oracle(q, k, v, visible, scale, kv_scale)
    got = fp8_context_attention(q, k, v, visible, scale, torch.tensor([kv_scale]))
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-6)
    plain = torch.softmax((q @ k.T * scale).masked_fill(~visible, float("-inf")), -1) @ v
    assert (plain.double() - expected).abs().max() > 1e-2  # the rounding is visible at this size
