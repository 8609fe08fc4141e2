"""The shape of the engine's two-level inverse CDF (trtllm/verify.py), in pure Python so that the tests check it
without TensorRT-LLM."""

from __future__ import annotations

import math


def vocab_blocks(padded_vocab: int) -> tuple[int, int]:
    """(blocks, block width) of the engine's two-level inverse CDF (trtllm/verify.py), about sqrt(V) each: every fp32
    prefix sum then runs over a small mass, so rounding moves a token's probability by ~1e-7 of its block's mass
    rather than of the whole distribution."""
    width = math.isqrt(padded_vocab - 1) + 1
    return -(-padded_vocab // width), width
