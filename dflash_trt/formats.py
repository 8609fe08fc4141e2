"""Number formats of a converted checkpoint: weight dtypes, quantization formats, the TensorRT-LLM `quantization`
config and which modules stay in high precision. Every layer speaks this vocabulary, spelled as users type it
(`--dtype`, `--qformat none|fp8|nvfp4`); the quantizers themselves live in `quant`.

Public:
- `DTYPES`: the `--dtype` choices of a checkpoint (`torch_dtypes()`: as torch dtypes, also the float types a source
  weight may have; built on first use, so that reading this vocabulary, as `--help` does, never imports torch);
  `ENGINE_DTYPES`: those an engine is built in (half precision: the KV-injection plugin's activations, and what
  build profiles accept).
- `BYTES_PER_WEIGHT[qformat]`: storage of one linear weight, scales included ("none" keeps 16-bit weights).
- `QFORMATS` ("none", "fp8", "nvfp4") and `KV_CACHE_DTYPES` ("none", "fp8"): the `--qformat` /
  `--dflash_qformat` / `--kv_cache_dtype` choices; `quant_algo(qformat)` is TensorRT-LLM's name (or None).
- `EXCLUDE_MODULES`: engine modules kept in the checkpoint dtype (why: docs/quantization.md).
- `quantization_config(qformat, kv_cache_dtype)`: the `quantization` dict of config.json (top level and
  `dflash_config`), as TensorRT-LLM 1.2.x's `QuantConfig.from_dict` reads it.
- `is_excluded(module, exclude_modules)`: TensorRT-LLM's rule (fnmatch on the full module name).
- `quantized_linear(tensor_name)`: the module of a linear weight the format quantizes, else None.
- `fused_partners(module)`: modules TensorRT-LLM runs as one GEMM with it (mlp.fc with mlp.gate).
- `NVFP4_BLOCK_SIZE`: values per NVFP4 scale (the config's `group_size`).
- `fp8_context_fmha(weights, kv_cache)`: whether a TensorRT-LLM 1.2.x EAGLE engine of these formats runs context
  attention in FP8 (its builder decides it, whatever the flag says); `checkpoint_fp8_context_fmha(config)`: the
  same for a converted checkpoint's config.json (the golden model and the emulation follow it).
- `RESOLUTION`: the relative logit resolution of each dtype and quantization format (a few of its ulps, see the
  table); `resolution(config)` is the coarsest a converted checkpoint computes with, the scale below which two
  implementations' logits may legitimately order a near-tie differently.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from dflash_trt import tensor_names as names
from dflash_trt.errors import DFlashTrtError

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "float16", "bfloat16")
ENGINE_DTYPES = ("float16", "bfloat16")

NONE, FP8, NVFP4 = "none", "fp8", "nvfp4"
QFORMATS = (NONE, FP8, NVFP4)
KV_CACHE_DTYPES = (NONE, FP8)
_QUANT_ALGO = {NONE: None, FP8: "FP8", NVFP4: "NVFP4"}
NVFP4_BLOCK_SIZE = 16
# Relative logit resolution of a network computing in each dtype: 4 ulps (machine epsilon 2^-23, 2^-10, 2^-7), twice
# the error measured end to end (the embedded pair's bf16 golden model against its fp32 one: up to 1.3 % of the top
# logit, 1.7 ulps); for quantized inputs one ulp of the format (e4m3: 3 mantissa bits; e2m1: 1), whose rounding
# errors average out over each GEMM's sum.
RESOLUTION = {"float32": 2.0**-21, "float16": 2.0**-8, "bfloat16": 2.0**-5, FP8: 2.0**-3, NVFP4: 2.0**-1}
# NVFP4 packs two values per byte plus one FP8 scale per block of 16.
BYTES_PER_WEIGHT = {NONE: 2.0, FP8: 1.0, NVFP4: 0.5 + 1 / NVFP4_BLOCK_SIZE}

LM_HEAD_MODULE = names.LM_HEAD.removesuffix("." + names.WEIGHT)
DRAFT_FC_MODULE = names.DRAFT_FC.removesuffix("." + names.WEIGHT)
# Explicit exclusions replace TensorRT-LLM 1.2.x's default list (quantize.py `quantize_layers`), which is where
# '*router' came from: without this entry FP8 would swap each MoE router for an FP8RowLinear the checkpoint cannot fill.
MOE_ROUTER_MODULES = f"{names.TARGET_PREFIX}.layers.*.{names.MOE_ROUTER}"
# DFlash2's convolution and selector projections and a reduced draft vocabulary's head stay in the checkpoint dtype
# (docs/quantization.md §4); named so the engine's module swap leaves them unquantized too.
DRAFT_EXTRA_MODULES = (
    f"{names.DRAFT_PREFIX}.layers.*.*_conv.{names.CONV_KERNEL_PROJECTION}",
    names.SELECTOR_HIDDEN_PROJECTION.removesuffix("." + names.WEIGHT),
    names.DRAFT_LM_HEAD.removesuffix("." + names.WEIGHT),
)
EXCLUDE_MODULES = (LM_HEAD_MODULE, DRAFT_FC_MODULE, MOE_ROUTER_MODULES, *DRAFT_EXTRA_MODULES)

_LAYER_PREFIXES = (names.TARGET_PREFIX + ".layers.", names.DRAFT_PREFIX + ".layers.")


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """`DTYPES` as torch dtypes, keyed by name."""
    import torch

    return {name: getattr(torch, name) for name in DTYPES}


def _check_choice(value: str, choices: Sequence[str], flag: str) -> None:
    if value not in choices:
        raise DFlashTrtError(f"{flag} must be one of {', '.join(choices)}, got {value!r}.")


def quant_algo(qformat: str) -> str | None:
    _check_choice(qformat, QFORMATS, "--qformat")
    return _QUANT_ALGO[qformat]


def quantization_config(
    qformat: str, kv_cache_dtype: str = NONE, exclude_modules: Iterable[str] = EXCLUDE_MODULES
) -> dict:
    """The `quantization` dict of a converted checkpoint's config.json."""
    _check_choice(kv_cache_dtype, KV_CACHE_DTYPES, "--kv_cache_dtype")
    algo = quant_algo(qformat)
    return {
        "quant_algo": algo,
        "kv_cache_quant_algo": _QUANT_ALGO[kv_cache_dtype],
        "group_size": NVFP4_BLOCK_SIZE,
        "exclude_modules": list(exclude_modules) if algo else [],
    }


# Weight formats with which TensorRT-LLM 1.2.x's builder runs context attention in FP8 once the KV cache is FP8: it
# turns use_fp8_context_fmha on for them whenever paged context FMHA is on, which EAGLE engines force [read:
# tensorrt_llm/builder.py `build`, "Logics to control paged_context_fmha and fp8_context_fmha"; W4A8_AWQ too, never
# written here].
FP8_CONTEXT_FMHA_WEIGHTS = (FP8, NVFP4)


def fp8_context_fmha(weights: str, kv_cache: str) -> bool:
    """Whether the engine's context attention runs in FP8 (on every GPU we target, SM >= 89)."""
    return weights in FP8_CONTEXT_FMHA_WEIGHTS and kv_cache == FP8


def checkpoint_fp8_context_fmha(config: dict) -> bool:
    """`fp8_context_fmha` of a converted checkpoint's config.json (its top-level `quantization`)."""
    quantization = config.get("quantization") or {}
    by_algo = {algo: qformat for qformat, algo in _QUANT_ALGO.items()}
    weights = by_algo.get(quantization.get("quant_algo"), str(quantization.get("quant_algo")))
    return fp8_context_fmha(weights, by_algo.get(quantization.get("kv_cache_quant_algo"), NONE))


def is_excluded(module: str, exclude_modules: Iterable[str] = EXCLUDE_MODULES) -> bool:
    return any(fnmatch.fnmatchcase(module, pattern) for pattern in exclude_modules)


def _linear_module(tensor_name: str) -> str | None:
    """Module path of any linear weight of the checkpoint (quantized or not)."""
    suffix = "." + names.WEIGHT
    if not tensor_name.endswith(suffix):
        return None
    module = tensor_name[: -len(suffix)]
    if module in (LM_HEAD_MODULE, DRAFT_FC_MODULE):
        return module
    for prefix in _LAYER_PREFIXES:
        if module.startswith(prefix):
            index, _, rest = module[len(prefix) :].partition(".")
            if index.isdigit() and rest in names.LINEAR_MODULES:
                return module
    return None


def quantized_linear(tensor_name: str, exclude_modules: Iterable[str] = EXCLUDE_MODULES) -> str | None:
    """The module of a linear weight that quantization replaces, or None (not a linear, or excluded)."""
    module = _linear_module(tensor_name)
    if module is None or is_excluded(module, exclude_modules):
        return None
    return module


def fused_partners(module: str) -> tuple[str, ...]:
    """The modules sharing one GEMM (and so one per-tensor scale) with `module`, itself included, in order."""
    for member in (names.MLP_FC, names.MLP_GATE):
        if module.endswith("." + member):
            stem = module[: -len(member)]
            return (stem + names.MLP_FC, stem + names.MLP_GATE)
    return (module,)


def resolution(config: dict) -> float:
    """The coarsest relative resolution a converted checkpoint's engine computes with: its dtype, either network's
    quantized GEMM inputs, and the KV cache."""
    dtype = str(config.get("dtype"))
    formats = [dtype if dtype in RESOLUTION else "float32"]
    by_algo = {algo: qformat for qformat, algo in _QUANT_ALGO.items() if algo}
    for quantization in (
        config.get("quantization") or {},
        (config.get("dflash_config") or {}).get("quantization") or {},
    ):
        for key in ("quant_algo", "kv_cache_quant_algo"):
            if quantization.get(key) in by_algo:
                formats.append(by_algo[quantization[key]])
    return max(RESOLUTION[f] for f in formats)
