"""The writer's casts equal torch's casts bit for bit, on every 16-bit pattern (numpy widens, torch narrows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_trt.conversion.rank_writer import cast_bits

_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32}


@pytest.mark.parametrize(("name", "dtype"), [("BF16", torch.bfloat16), ("F16", torch.float16)])
@pytest.mark.parametrize(("stored_name", "stored"), [("F32", torch.float32), ("BF16", torch.bfloat16)])
def test_cast_of_every_16_bit_pattern_is_torchs(name: str, dtype: torch.dtype, stored_name: str, stored) -> None:
    patterns = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    got = torch.from_numpy(np.ascontiguousarray(cast_bits(patterns, name, stored_name)).reshape(-1).view(np.uint8))
    values = torch.from_numpy(patterns.copy()).view(dtype).reshape(-1)
    finite = torch.isfinite(values)  # NaN never reaches a cast: the sources are scanned first
    bits = _SAME_WIDTH_INT[stored.itemsize]
    assert torch.equal(got.view(stored)[finite].view(bits), values.to(stored)[finite].view(bits))
