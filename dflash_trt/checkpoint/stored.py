"""What each layout tensor becomes on disk: itself in `--dtype`, or a quantized weight with its scales.

The writer, `verify` and the golden model's shard merge all go through these rules, so a quantized linear's
tensors (weight, `weights_scaling_factor[_2]`, `activation_scaling_factor`) and a layer's
`kv_cache_scaling_factor` are named, shaped and split over ranks the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_trt import tensor_names as names
from dflash_trt.checkpoint.layout import OutputTensor, stored_split
from dflash_trt.checkpoint.sharding import shard, sharded_shape
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import (
    FP8,
    KV_CACHE_DTYPES,
    NONE,
    NVFP4,
    QFORMATS,
    fused_partners,
    quantization_config,
    quantized_linear,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class QuantSettings:
    """Weight format of the target and of the drafter, and the KV-cache dtype of both."""

    qformat: str = NONE
    dflash_qformat: str = NONE
    kv_cache_dtype: str = NONE

    def __post_init__(self) -> None:
        for flag, value, choices in (
            ("--qformat", self.qformat, QFORMATS),
            ("--dflash_qformat", self.dflash_qformat, QFORMATS),
            ("--kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES),
        ):
            if value not in choices:
                raise DFlashTrtError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")

    @property
    def enabled(self) -> bool:
        return (self.qformat, self.dflash_qformat, self.kv_cache_dtype) != (NONE, NONE, NONE)

    def format_of(self, tensor_name: str) -> str:
        return self.dflash_qformat if tensor_name.startswith(names.DRAFT_PREFIX + ".") else self.qformat

    @classmethod
    def from_config(cls, config: dict) -> QuantSettings:
        """Read back what a converted checkpoint's config.json says."""
        formats = {None: NONE, "FP8": FP8, "NVFP4": NVFP4}
        try:
            target, draft = config["quantization"], config["dflash_config"]["quantization"]
            return cls(
                formats[target["quant_algo"]], formats[draft["quant_algo"]], formats[target["kv_cache_quant_algo"]]
            )
        except (KeyError, TypeError):
            raise DFlashTrtError("config.json has a malformed or unsupported 'quantization' section") from None

    def config(self, draft: bool) -> dict:
        """The `quantization` dict of config.json: top level for the target, `dflash_config` for the drafter."""
        return quantization_config(self.dflash_qformat if draft else self.qformat, self.kv_cache_dtype)


def kv_scale_name(out: OutputTensor) -> str | None:
    """A layer's KV-cache scale rides with its qkv weight."""
    suffix = f".{names.QKV}.{names.WEIGHT}"
    return names.kv_cache_scale(out.name[: -len(suffix)]) if out.name.endswith(suffix) else None


def partner_weights(out: OutputTensor) -> tuple[str, ...]:
    """Weights sharing one GEMM (and so one per-tensor scale) with `out`, itself included."""
    module = out.name.removesuffix("." + names.WEIGHT)
    return tuple(f"{m}.{names.WEIGHT}" for m in fused_partners(module))


def stored_full(
    out: OutputTensor,
    full: torch.Tensor,
    dtype: torch.dtype,
    quant: QuantSettings,
    scales: dict[str, torch.Tensor],
    load_partner: Callable[[str], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The full (unsharded) tensors stored for `out`: `scales` holds calibrated activation and KV scales."""
    import torch

    from dflash_trt.quant.linears import quantize_weight, weight_amax

    qformat = quant.format_of(out.name)
    module = quantized_linear(out.name) if qformat != NONE else None
    if module is None:
        stored = {out.name: full.to(out.stored_torch_dtype(dtype))}
    else:
        weight = full.to(dtype)
        partners = partner_weights(out)
        amax = None
        if len(partners) > 1 and load_partner is not None and weight.dim() == 2:
            amax = torch.stack(
                [weight_amax(weight if p == out.name else load_partner(p).to(dtype)) for p in partners]
            ).max()
        stored = quantize_weight(out.name, weight, qformat, amax)
        stored[f"{module}.{names.ACTIVATION_SCALING_FACTOR}"] = _scale(scales, module, names.ACTIVATION_SCALING_FACTOR)
    kv_name = kv_scale_name(out)
    if kv_name is not None and quant.kv_cache_dtype == FP8:
        stored[kv_name] = _scale(scales, kv_name.rsplit(".", 1)[0], names.KV_CACHE_SCALING_FACTOR)
    return stored


def _scale(scales: dict[str, torch.Tensor], module: str, leaf: str) -> torch.Tensor:
    name = f"{module}.{leaf}"
    if name not in scales:
        raise DFlashTrtError(f"calibration produced no {name}")
    return scales[name]


def stored_entries(
    out: OutputTensor, dtype: torch.dtype, quant: QuantSettings, scales: dict[str, torch.Tensor], tp_size: int
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """dtype and per-rank shape of every tensor stored for `out`, known before any data is read.

    Quantizing a two-row stand-in gives the dtypes and trailing dims; per-row tensors (weights, block scales)
    then take the real row count, per-tensor scales keep theirs.
    """
    import torch

    from dflash_trt.quant.linears import check_quantizable

    check_quantizable(out.name, out.shape, quant.format_of(out.name), tp_size)
    stand_in = torch.ones((2, *out.shape[1:]), dtype=dtype) if len(out.shape) >= 2 else torch.ones(out.shape)
    entries = {}
    for name, tensor in stored_full(out, stand_in, dtype, quant, scales).items():
        shape = (out.shape[0], *tensor.shape[1:]) if tensor.dim() >= 2 else tuple(tensor.shape)
        split, _ = stored_split({out.name: out}, name, tensor.dim())
        entries[name] = (tensor.dtype, sharded_shape(shape, split, tp_size, out.heads, out.experts))
    return entries


def rank_pieces(out: OutputTensor, stored: dict[str, torch.Tensor], tp_size: int, rank: int) -> dict[str, torch.Tensor]:
    """This rank's piece of each stored tensor, contiguous."""
    layout = {out.name: out}
    pieces = {}
    for name, tensor in stored.items():
        split, _ = stored_split(layout, name, tensor.dim())
        pieces[name] = shard(tensor, split, tp_size, rank, out.heads, out.experts).contiguous()
    return pieces


def rank_stored(
    out: OutputTensor,
    full: torch.Tensor,
    dtype: torch.dtype,
    quant: QuantSettings,
    scales: dict[str, torch.Tensor],
    tp_size: int,
    rank: int,
    load_partner: Callable[[str], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Everything rank `rank` stores for `out`. Unquantized tensors are split before the cast (only the piece is
    copied); a quantized weight is quantized whole, since its per-tensor scales cover every rank."""
    if quant.format_of(out.name) == NONE or quantized_linear(out.name) is None:
        piece = shard(full, out.split, tp_size, rank, out.heads, out.experts)
        pieces = {out.name: piece.to(out.stored_torch_dtype(dtype)).contiguous()}
        kv_name = kv_scale_name(out)
        if kv_name is not None and quant.kv_cache_dtype == FP8:
            pieces[kv_name] = _scale(scales, kv_name.rsplit(".", 1)[0], names.KV_CACHE_SCALING_FACTOR)
        return pieces
    return rank_pieces(out, stored_full(out, full, dtype, quant, scales, load_partner), tp_size, rank)
