"""Input checks shared by the weight quantizers, so every format refuses the same bad weights the same way."""

from __future__ import annotations

import torch

from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import torch_dtypes

FLOAT_DTYPES = tuple(torch_dtypes().values())


def check_weight(weight: torch.Tensor) -> None:
    """A linear weight must be a non-empty 2-D (out, in) floating tensor."""
    if weight.dtype not in FLOAT_DTYPES:
        raise DFlashTrtError(f"cannot quantize a {weight.dtype} tensor; expected float32, float16 or bfloat16.")
    if weight.dim() != 2:
        raise DFlashTrtError(f"cannot quantize a tensor of shape {tuple(weight.shape)}; expected (out, in).")
    if weight.numel() == 0:
        raise DFlashTrtError("cannot quantize an empty weight.")


def check_finite_amax(amax: torch.Tensor) -> None:
    """max/min propagate NaN and inf, so a finite amax proves the whole weight finite without another pass."""
    if not bool(torch.isfinite(amax).all()):
        raise DFlashTrtError("cannot quantize a weight holding inf or NaN values.")
