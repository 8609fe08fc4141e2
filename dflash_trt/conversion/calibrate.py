"""Activation and KV-cache calibration of a converted checkpoint, inside the real speculative decoding loop.

The golden model runs `speculative_generate` over calibration prompts. modelopt's `TensorQuantizer`, in
calibration mode (its max calibrator), observes every linear's input and every attention layer's stored K and V,
on valid tokens only. The drafter's qkv is observed on both of its inputs, the block tokens and the injected
context features (the engine applies the same quantized qkv to both), and its K/V on block and injected tokens.
Scales follow from the amaxes with the formulas of `fp8.py` / `nvfp4.py`, which are tested equal to modelopt's
exporter.

Public:
- `observe_amax(model)`: context manager yielding a `CalibrationAmax` filled while the golden model runs (through
  its `Linear.observer` / `LayerWeights.kv_observer` hooks, on valid tokens only).
- `calibrate(model, prompts, max_new_tokens)`: one decoding pass under `observe_amax`.
- `quantized_model(model, qformat, dflash_qformat, kv_cache_dtype, amax)`: context manager in which the golden
  model runs as its quantized engine would (weights as the converter stores them, inputs and K/V rounded with
  the scales); `dflash_qformat` None leaves the drafter unquantized.
- `calibrate_pair(model, prompts, max_new_tokens, qformat, kv_cache_dtype)`: target amaxes from a first pass,
  drafter amaxes from a second pass with the target quantized.
- `calibration_tensors(amax, qformat, kv_cache_dtype, dflash_qformat)`: `activation_scaling_factor` of every
  quantized linear and `kv_cache_scaling_factor` of every attention layer, under the checkpoint's names.
- `calibrate_checkpoint(checkpoint_dir, quant, calib_dataset, calib_size, calib_max_seq_len)`: the converter's
  entry point: those tensors for an unquantized converted checkpoint and a prompt file.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_trt import tensor_names as names
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import FP8, NONE, NVFP4, fp8_context_fmha, fused_partners, quantized_linear
from dflash_trt.quant.fp8 import dequantize_fp8, dequantize_fp8_experts, fp8_activation_scale, kv_cache_scale
from dflash_trt.quant.linears import quantize_tensors
from dflash_trt.quant.nvfp4 import dequantize_nvfp4, nvfp4_activation_scale
from dflash_trt.reference.decode import speculative_generate

# Prompts decoded together, and tokens generated past each prompt, per calibration pass.
CALIBRATION_BATCH = 16
CALIBRATION_NEW_TOKENS = 32


def _observer():
    with warnings.catch_warnings():
        # modelopt warns that transformers 5.x is untested with it; only its tensor quantizer is used here.
        warnings.filterwarnings("ignore", message="transformers .* is not tested", category=UserWarning)
        from modelopt.torch.quantization.config import QuantizerAttributeConfig
        from modelopt.torch.quantization.nn import TensorQuantizer

    quantizer = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=None))
    quantizer.disable_quant()
    quantizer.enable_calib()
    return quantizer


class CalibrationAmax:
    """Observed absolute maxima by checkpoint name: linear inputs by module, K and V together by
    `kv_cache_scaling_factor` name (TensorRT-LLM keeps one scale for both)."""

    def __init__(self) -> None:
        self._quantizers: dict = {}
        self._amax: dict[str, torch.Tensor] = {}

    def see(self, name: str, x: torch.Tensor) -> None:
        if x.numel():
            if name not in self._quantizers:
                self._quantizers[name] = _observer()
            self._quantizers[name](x.detach().float())
            self._amax.pop(name, None)

    def amax(self, name: str) -> torch.Tensor:
        if name not in self._quantizers:
            raise DFlashTrtError(f"calibration never reached {name}; use more or longer calibration prompts.")
        if name not in self._amax:
            quantizer = self._quantizers[name]
            quantizer.load_calib_amax()
            self._amax[name] = quantizer.amax.clone()
        return self._amax[name]

    def input_amax(self, module: str) -> torch.Tensor:
        return self.amax(module)

    def kv_amax(self, layer_prefix: str) -> torch.Tensor:
        return self.amax(names.kv_cache_scale(layer_prefix))

    def names(self) -> list[str]:
        return sorted(self._quantizers)

    def merged(self, other: CalibrationAmax, prefix: str) -> CalibrationAmax:
        """This calibration, with `other`'s observations for every name under `prefix` instead of its own."""
        out = CalibrationAmax()
        out._quantizers = {n: q for n, q in self._quantizers.items() if not n.startswith(prefix)}
        out._quantizers.update({n: q for n, q in other._quantizers.items() if n.startswith(prefix)})
        return out


@contextlib.contextmanager
def _patched(obj, attribute: str, value) -> Iterator[None]:
    """Set `obj.attribute` for the duration, then restore it."""
    old = getattr(obj, attribute)
    setattr(obj, attribute, value)
    try:
        yield
    finally:
        setattr(obj, attribute, old)


@contextlib.contextmanager
def observe_amax(model) -> Iterator[CalibrationAmax]:
    """Every linear input and every K/V the golden model stores, observed while the block runs.

    Padding rows are dropped: the engine never computes them. A linear's rows are those its model (target or
    drafter, by name) marks valid for the running call."""
    amax = CalibrationAmax()
    target, draft = model.target, model.draft

    def linear_observer(name: str, x: torch.Tensor) -> None:
        valid = (draft if name.startswith(names.DRAFT_PREFIX + ".") else target).current_valid
        if valid is not None and x.shape[:2] == valid.shape:
            x = x[valid]
        amax.see(name, x)

    def kv_observer(layer_prefix: str, x: torch.Tensor) -> None:
        amax.see(names.kv_cache_scale(layer_prefix), x)

    with contextlib.ExitStack() as stack:
        for linear in [*model.linears(), *model.sparse_mlps()]:
            stack.enter_context(_patched(linear, "observer", linear_observer))
        for layer in (*target.layers, *draft.layers):
            stack.enter_context(_patched(layer, "kv_observer", kv_observer))
        yield amax


def calibrate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int = 32,
    batch_size: int = CALIBRATION_BATCH,
    progress: Callable[[int], object] | None = None,
) -> CalibrationAmax:
    """Amaxes observed while speculatively generating (greedy) from every prompt, `batch_size` at a time;
    `progress` hears how many prompts each batch finished."""
    with torch.no_grad(), observe_amax(model) as amax:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            speculative_generate(model, batch, max_new_tokens)
            if progress is not None:
                progress(len(batch))
    return amax


def _dequantized(quantized: dict[str, torch.Tensor], module: str, qformat: str) -> torch.Tensor:
    weight = quantized[f"{module}.{names.WEIGHT}"]
    scale = quantized[f"{module}.{names.WEIGHTS_SCALING_FACTOR}"]
    if weight.dim() == 3:
        return dequantize_fp8_experts(weight, scale)
    if qformat == FP8:
        return dequantize_fp8(weight, scale)
    return dequantize_nvfp4(weight, scale, quantized[f"{module}.{names.WEIGHTS_SCALING_FACTOR_2}"])


def _quantize_part(stack: contextlib.ExitStack, layers, linears, qformat: str, kv_cache_dtype: str, scales) -> None:
    """Swap one model's linears (and KV scales) for what its quantized checkpoint would load."""
    linears = [lin for lin in linears if qformat != NONE and quantized_linear(f"{lin.name}.{names.WEIGHT}")]
    quantized = quantize_tensors({f"{lin.name}.{names.WEIGHT}": lin.weight for lin in linears}, qformat)
    for lin in linears:
        stack.enter_context(_patched(lin, "weight", _dequantized(quantized, lin.name, qformat).to(lin.weight.dtype)))
        stack.enter_context(_patched(lin, "input_format", qformat))
        stack.enter_context(_patched(lin, "input_scale", scales[f"{lin.name}.{names.ACTIVATION_SCALING_FACTOR}"]))
    for sparse in [layer.sparse for layer in layers if layer.sparse is not None and qformat != NONE]:
        stacks = {f"{sparse.fc_name}.{names.WEIGHT}": sparse.fc, f"{sparse.proj_name}.{names.WEIGHT}": sparse.proj}
        quantized = quantize_tensors(stacks, qformat)
        for attribute, module in (("fc", sparse.fc_name), ("proj", sparse.proj_name)):
            weight = getattr(sparse, attribute)
            stack.enter_context(_patched(sparse, attribute, _dequantized(quantized, module, qformat).to(weight.dtype)))
            scale = scales[f"{module}.{names.ACTIVATION_SCALING_FACTOR}"]
            stack.enter_context(_patched(sparse, f"{attribute}_input_scale", scale))
        stack.enter_context(_patched(sparse, "input_format", qformat))
    if kv_cache_dtype == FP8:
        for layer in layers:
            stack.enter_context(_patched(layer, "kv_scale", scales[names.kv_cache_scale(layer.prefix)]))


@contextlib.contextmanager
def quantized_model(
    model, qformat: str, dflash_qformat: str | None, kv_cache_dtype: str, amax: CalibrationAmax
) -> Iterator[None]:
    """The golden model runs as the quantized engine would: weights quantized as the converter stores them, inputs
    and (FP8) K/V rounded with the scales `amax` gives, prompts through FP8 context attention where the engine's
    builder turns it on. `dflash_qformat` None leaves the drafter untouched."""
    draft_format = NONE if dflash_qformat is None else dflash_qformat
    scales = calibration_tensors(amax, qformat, kv_cache_dtype, draft_format)
    target, draft = model.target, model.draft
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(target, "fp8_context", fp8_context_fmha(qformat, kv_cache_dtype)))
        _quantize_part(
            stack,
            target.layers,
            [lin for layer in target.layers for lin in layer.linears()],
            qformat,
            kv_cache_dtype,
            scales,
        )
        if dflash_qformat is not None:
            draft_linears = [lin for layer in draft.layers for lin in layer.linears()] + [draft.fc]
            _quantize_part(stack, draft.layers, draft_linears, draft_format, kv_cache_dtype, scales)
        yield


def calibration_passes(qformat: str, kv_cache_dtype: str) -> int:
    """How many times `calibrate_pair` decodes the prompts."""
    return 1 if qformat == NONE and kv_cache_dtype == NONE else 2


def calibrate_pair(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    qformat: str,
    kv_cache_dtype: str = NONE,
    progress: Callable[[int], object] | None = None,
) -> CalibrationAmax:
    """Target amaxes from the model as loaded; drafter amaxes with the target running quantized, so the drafter
    is calibrated on the context features the quantized target actually produces."""
    target_pass = calibrate(model, prompts, max_new_tokens, progress=progress)
    if calibration_passes(qformat, kv_cache_dtype) == 1:
        return target_pass
    with quantized_model(model, qformat, None, kv_cache_dtype, target_pass):
        draft_pass = calibrate(model, prompts, max_new_tokens, progress=progress)
    return target_pass.merged(draft_pass, names.DRAFT_PREFIX + ".")


def calibration_tensors(
    amax: CalibrationAmax, qformat: str, kv_cache_dtype: str = NONE, dflash_qformat: str | None = None
) -> dict[str, torch.Tensor]:
    """Scales the engine needs besides the weights', under the checkpoint's names; the drafter's linears use
    `dflash_qformat` (default: the target's `qformat`)."""
    out: dict[str, torch.Tensor] = {}
    draft_format = qformat if dflash_qformat is None else dflash_qformat
    observed = set(amax.names())
    for module in amax.names():
        fmt = draft_format if module.startswith(names.DRAFT_PREFIX + ".") else qformat
        if fmt not in (FP8, NVFP4) or quantized_linear(f"{module}.{names.WEIGHT}") is None:
            continue
        scale = fp8_activation_scale if fmt == FP8 else nvfp4_activation_scale
        # A sparse layer's stacked fc has no mlp.gate partner: it shares nothing.
        partners = [m for m in fused_partners(module) if m in observed]
        shared = torch.stack([amax.input_amax(m) for m in partners]).max()
        out[f"{module}.{names.ACTIVATION_SCALING_FACTOR}"] = scale(shared)
    if kv_cache_dtype == FP8:
        for name in amax.names():
            if name.endswith("." + names.KV_CACHE_SCALING_FACTOR):
                out[name] = kv_cache_scale(amax.amax(name), amax.amax(name))
    return out


def calibrate_checkpoint(
    checkpoint_dir: str | Path,
    quant,
    calib_dataset: str | Path,
    calib_size: int = 64,
    calib_max_seq_len: int = 512,
    max_new_tokens: int = CALIBRATION_NEW_TOKENS,
    show_progress: bool = False,
) -> dict[str, torch.Tensor]:
    """Activation and KV-cache scales for quantizing an unquantized converted checkpoint as `quant` says
    (`qformat`, `dflash_qformat`, `kv_cache_dtype`), from the first `calib_size` prompts of `calib_dataset`,
    each cut to `calib_max_seq_len` tokens and decoded `max_new_tokens` further."""
    from dflash_trt.prompts import read_prompts
    from dflash_trt.reference.model import load_golden_model
    from dflash_trt.tokenizer import load_tokenizer

    if calib_size < 1 or calib_max_seq_len < 1:
        raise DFlashTrtError("--calib_size and --calib_max_seq_len must be >= 1.")
    checkpoint_dir = Path(checkpoint_dir)
    prompts = read_prompts(calib_dataset, load_tokenizer(checkpoint_dir), limit=calib_size)
    prompts = [p[:calib_max_seq_len] for p in prompts]
    model = load_golden_model(checkpoint_dir)
    total = len(prompts) * calibration_passes(quant.qformat, quant.kv_cache_dtype)
    with tqdm(total=total, desc="calibrate", unit="prompt", disable=None if show_progress else True) as bar:
        amax = calibrate_pair(model, prompts, max_new_tokens, quant.qformat, quant.kv_cache_dtype, bar.update)
    return calibration_tensors(amax, quant.qformat, quant.kv_cache_dtype, quant.dflash_qformat)
