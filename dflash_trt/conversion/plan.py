"""What a conversion writes: the plan every rank file follows, and the tensors a rank stores for one layout tensor.

The plan is torch-free, so a conversion that only moves bytes (no quantization, no cast) never imports torch; the
tensors a rank stores are recomputed with torch only where the bytes change (quantized or carried weights, and
`verify`, which recomputes every tensor to compare it with the file).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_trt.checkpoint.hf_reader import HFCheckpointReader
from dflash_trt.checkpoint.layout import TARGET, OutputTensor, checkpoint_layout
from dflash_trt.checkpoint.safetensors_io import DTYPE_SIZES, dtype_name, stored_dtype_name, tensor_has_nonfinite
from dflash_trt.checkpoint.sharding import sharded_shape
from dflash_trt.checkpoint.stored import QuantSettings, kv_scale_name
from dflash_trt.conversion.prequantized import PrequantizedFormat
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import FP8, NONE, quantized_linear, torch_dtypes
from dflash_trt.spec import DraftSpec, TargetSpec

if TYPE_CHECKING:
    import torch


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


@dataclass(frozen=True)
class ConversionPlan:
    """Everything that decides the bytes of every rank file (picklable, so worker processes can take it)."""

    model_dir: Path
    dflash_model_dir: Path
    target: TargetSpec
    draft: DraftSpec
    dtype: str  # a --dtype name
    tp_size: int
    quant: QuantSettings = QuantSettings()
    scales: dict = field(default_factory=dict)  # calibrated activation / KV-cache scales by checkpoint name
    prequantized: PrequantizedFormat | None = None  # the target's own quantization, carried over
    moe_ep_size: int = 1  # expert-parallel groups of a mixture-of-experts target (moe_tp_size = tp / this)

    @cached_property
    def layout(self) -> list[OutputTensor]:
        return checkpoint_layout(self.target, self.draft, self.moe_ep_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtypes()[self.dtype]

    def check_formats(self) -> None:
        """Refuse, before anything is read, weights the chosen formats cannot hold (NVFP4 blocks per rank)."""
        if not self.quant.enabled:
            return
        from dflash_trt.quant.linears import check_quantizable

        for out in self.layout:
            check_quantizable(out.name, out.shape, self.quant.format_of(out.name), self.tp_size)

    def stored_dtype(self, out: OutputTensor) -> str:
        """The safetensors dtype `out` is stored in when its bytes are only moved or cast."""
        return stored_dtype_name(out.dtype or self.dtype)

    def moves_bytes(self, out: OutputTensor) -> bool:
        """Stored as (a cast of) a piece of its sources and nothing else: neither quantized here nor carried from a
        quantized target, and with no KV-cache scale riding on it."""
        if quantized_linear(out.name) is not None and (self.quant.format_of(out.name) != NONE or self.prequantized):
            return False
        return kv_scale_name(out) is None or self.quant.kv_cache_dtype != FP8

    def entries_of(self, out: OutputTensor) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Safetensors dtype and per-rank shape of every tensor stored for `out`."""
        if self.moves_bytes(out):
            shape = sharded_shape(out.shape, out.split, self.tp_size, out.heads, out.experts)
            return {out.name: (self.stored_dtype(out), shape)}
        from dflash_trt.checkpoint.stored import stored_entries

        entries = stored_entries(out, self.torch_dtype, self.quant, self.scales, self.tp_size)
        return {name: (dtype_name(dtype), shape) for name, (dtype, shape) in entries.items()}

    def entries(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {name: entry for out in self.layout for name, entry in self.entries_of(out).items()}


def rank_file_bytes(entries: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """Tensor bytes of a rank file holding `entries` (the plan's)."""
    return sum(math.prod(shape) * DTYPE_SIZES[dtype] for dtype, shape in entries.values())


def source_label(out: OutputTensor) -> str:
    model, name = out.sources[0]
    return f"{'target' if model == TARGET else 'drafter'} tensor '{name}'"


def check_stored_finite(out: OutputTensor, name: str, stored: torch.Tensor) -> None:
    """Sources are checked finite, so a non-finite stored value means the cast (or quantization) overflowed: a
    float16 checkpoint of weights beyond 65504 would otherwise hold +-Inf and decode nothing but garbage."""
    if tensor_has_nonfinite(stored):
        raise DFlashTrtError(
            f"{source_label(out)} does not fit {str(stored.dtype).removeprefix('torch.')}: its stored form "
            f"'{name}' holds NaN or Inf (values beyond the type's range); convert with --dtype bfloat16 or float32"
        )


def _load_full(out: OutputTensor, readers: dict[str, HFCheckpointReader], check_finite: bool) -> torch.Tensor:
    loaded = []
    for model, name in out.sources:
        tensor = readers[model].get(name)
        if check_finite and tensor_has_nonfinite(tensor):
            what = "target" if model == TARGET else "drafter"
            raise DFlashTrtError(f"{what} tensor '{name}' contains NaN or Inf values")
        loaded.append(tensor)
    return out.assemble(loaded)


def rank_tensors(
    plan: ConversionPlan, out: OutputTensor, readers: dict[str, HFCheckpointReader], rank: int, check_finite: bool
) -> dict[str, torch.Tensor]:
    """Exactly what rank `rank` stores for `out`, computed with torch (what `verify` recomputes, and what the writer
    stores where the bytes change)."""
    from dflash_trt.checkpoint.stored import rank_pieces, rank_stored
    from dflash_trt.conversion import prequantized_input

    carried = prequantized_input.carried_tensors(plan.prequantized, out, readers[TARGET])
    if carried is not None:
        kv_name = kv_scale_name(out)
        if kv_name is not None and plan.quant.kv_cache_dtype != FP8:
            carried.pop(kv_name, None)  # the KV cache was asked to stay unquantized
        elif kv_name is not None and kv_name not in carried:
            carried[kv_name] = plan.scales[kv_name]  # the checkpoint has no KV scales: calibrated ones
        return rank_pieces(out, carried, plan.tp_size, rank)
    by_name = {o.name: o for o in plan.layout}

    def load_partner(name: str) -> torch.Tensor:
        return _load_full(by_name[name], readers, check_finite=False)

    full = _load_full(out, readers, check_finite)
    return rank_stored(out, full, plan.torch_dtype, plan.quant, plan.scales, plan.tp_size, rank, load_partner)
