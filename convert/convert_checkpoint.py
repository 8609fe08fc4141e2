"""TensorRT-LLM-style entry point: `python convert/convert_checkpoint.py --model_dir T --dflash_model_dir D ...`.

The same flags as `dflash-trt convert`, for users whose scripts call `convert_checkpoint.py` per model family.
"""

from __future__ import annotations

import sys

from dflash_trt.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
