"""The decoding modes every layer speaks of (a benchmark target, an engine, a result point, a planned method).

Spelled once, so a bench point, a sweep record and the performance model cannot disagree on the vocabulary:
`dflash` (block-diffusion drafting), `ar` (the target alone, autoregressive) and `eagle3` (an EAGLE-3 engine).
"""

from __future__ import annotations

from typing import Final, Literal, get_args

DecodingMode = Literal["dflash", "ar", "eagle3"]
DECODING_MODES: Final[tuple[DecodingMode, ...]] = get_args(DecodingMode)
DFLASH: Final = "dflash"
AR: Final = "ar"
EAGLE3: Final = "eagle3"
