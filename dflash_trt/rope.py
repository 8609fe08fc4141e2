"""Rotary position embeddings as Qwen3 / Llama 3.x define them (neox, rotate-half layout).

One definition serves the golden model, the KV-injection reference and the host-compiled kernel tests, so the
frequency table of every supported scaling type (default, linear, llama3, yarn) is spelled exactly once. The
config is read by torch-free modules too (`spec`, build plans, `--help`), so torch is imported only where cos/sin are
computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# The RopeConfig fields each scaling type reads; every other field keeps its default for that type.
SCALING_FIELDS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    ),
}


@dataclass(frozen=True)
class RopeConfig:
    """Everything that determines cos/sin for a position; field names follow HF `rope_parameters`."""

    head_dim: int
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _base_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    import torch

    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).to(torch.float32) / cfg.head_dim
    return 1.0 / (cfg.theta**exponents)


def _original_context(cfg: RopeConfig) -> int:
    """llama3 and yarn scale relative to the pre-training context; the spec parser makes sure it is given."""
    if cfg.original_max_position_embeddings is None:
        raise ValueError(f"{cfg.rope_type} RoPE needs original_max_position_embeddings")
    return cfg.original_max_position_embeddings


def _llama3_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    import torch

    inv_freq = _base_inv_freq(cfg)
    old_context = _original_context(cfg)
    low_freq_wavelen = old_context / cfg.low_freq_factor
    high_freq_wavelen = old_context / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / cfg.factor, inv_freq)
    smooth = (old_context / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq_and_scale(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    import torch

    dim, base, factor, old_context = cfg.head_dim, cfg.theta, cfg.factor, _original_context(cfg)
    if cfg.attention_factor is not None:
        attention = cfg.attention_factor
    elif cfg.mscale and cfg.mscale_all_dim:
        attention = _yarn_mscale(factor, cfg.mscale) / _yarn_mscale(factor, cfg.mscale_all_dim)
    else:
        attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, float(attention)


def inv_freq_and_scale(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim/2]` (float32) and the factor that multiplies cos/sin."""
    if cfg.rope_type == "default":
        return _base_inv_freq(cfg), 1.0
    if cfg.rope_type == "linear":
        return _base_inv_freq(cfg) / cfg.factor, 1.0
    if cfg.rope_type == "llama3":
        return _llama3_inv_freq(cfg), 1.0
    if cfg.rope_type == "yarn":
        return _yarn_inv_freq_and_scale(cfg)
    raise ValueError(f"unsupported rope type {cfg.rope_type!r}")


def rope_cos_sin(positions: torch.Tensor, cfg: RopeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape `positions.shape + (head_dim,)` in float32, halves duplicated (rotate-half layout)."""
    import torch

    inv_freq, scale = inv_freq_and_scale(cfg)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * scale, angles.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x[..., head_dim]`; cos/sin must broadcast against x. Computed in x's dtype like HF does."""
    import torch

    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
