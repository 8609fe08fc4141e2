"""QuantConfig / QuantMode as 1.2.x reads a checkpoint's `quantization` dict (tensorrt_llm/models/modeling_utils.py
`QuantConfig`, quantization/mode.py). A leaf of the emulation: the module swap that applies a config to a model's
linears is `models.quantize`, next to its only caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FP8, NVFP4 = "FP8", "NVFP4"
SUPPORTED_ALGOS = (None, FP8, NVFP4)


@dataclass
class QuantConfig:
    quant_algo: str | None = None
    kv_cache_quant_algo: str | None = None
    group_size: int = 128
    exclude_modules: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, config: dict[str, Any] | None) -> QuantConfig:
        config = dict(config or {})
        known = {
            k: config.pop(k)
            for k in ("quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules")
            if k in config
        }
        result = cls(**{k: v for k, v in known.items() if v is not None})
        if result.quant_algo not in SUPPORTED_ALGOS or result.kv_cache_quant_algo not in (None, FP8):
            raise ValueError(
                f"the emulation runs FP8 / NVFP4 weights and FP8 KV caches, got "
                f"{result.quant_algo} / {result.kv_cache_quant_algo}"
            )
        return result

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_algo": self.quant_algo,
            "kv_cache_quant_algo": self.kv_cache_quant_algo,
            "group_size": self.group_size,
            "exclude_modules": list(self.exclude_modules),
        }

    @property
    def quant_mode(self) -> QuantMode:
        return QuantMode(self.quant_algo, self.kv_cache_quant_algo)


@dataclass(frozen=True)
class QuantMode:
    weights: str | None = None
    kv_cache: str | None = None

    def has_fp8_qdq(self) -> bool:
        return self.weights == FP8

    def has_nvfp4(self) -> bool:
        return self.weights == NVFP4

    def has_fp8_kv_cache(self) -> bool:
        return self.kv_cache == FP8

    def has_kv_cache_quant(self) -> bool:
        return self.kv_cache is not None
