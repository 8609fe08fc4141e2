"""How quantizing the target, the drafter and the KV cache changes DFlash acceptance (table in docs/quantization.md).

    python perf/acceptance_quant.py [--model_dir T --dflash_model_dir D --calib_dataset FILE.jsonl] [--json]

The study itself lives in `dflash_trt.conversion.acceptance`; defaults are the embedded tiny pair.
"""

from __future__ import annotations

import sys

from dflash_trt.conversion.acceptance import main

if __name__ == "__main__":
    sys.exit(main())
