"""The RoPE tables `Attention.create_attention_const_params` registers (1.2.x `RopeEmbeddingUtils`
`create_sinusoidal_positions_for_attention_plugin`, `apply_llama3_scaling`), computed the way that code does:
inverse frequencies in float64 then float32, angles and cos/sin in float32. Written independently of
`dflash_trt.rope` so the comparison with the golden model also checks the scaling formulas.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dflash_trt.emulation.functional import EmulationError


def _llama3(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(freq)
        elif wavelen > old / low:
            out.append(freq / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out, dtype=np.float64)


def inverse_frequencies(dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = scaling or {}
    kind = scaling.get("type", "default")
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    else:
        raise EmulationError(f"the emulation implements default, linear and llama3 RoPE, not {kind!r}")
    return inv_freq.astype(np.float32)


def cos_sin_table(max_positions: int, dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """float32 `[max_positions, dim/2, 2]`: (cos, sin) of position x inverse frequency."""
    angles = np.einsum(
        "i,j->ij",
        np.arange(max_positions, dtype=np.float32),
        inverse_frequencies(dim, theta, scaling),
        dtype=np.float32,
    )
    return np.stack([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)
