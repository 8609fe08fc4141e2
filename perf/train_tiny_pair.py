"""Train the embedded tiny target + DFlash drafter pair on the CPU (25-40 minutes, one core).

nice -n 10 python perf/train_tiny_pair.py --output_dir dflash_trt/assets/tiny_pair
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from dflash_trt.tiny.build import Recipe, build_pair


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", type=Path, default=Path("dflash_trt/assets/tiny_pair"))
    for field in dataclasses.fields(Recipe):
        parser.add_argument(f"--{field.name}", type=type(field.default), default=field.default)
    args = parser.parse_args()
    recipe = Recipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe)})
    command = shlex.join(["python", "perf/train_tiny_pair.py", *sys.argv[1:]])
    manifest = build_pair(args.output_dir, recipe, command, log=lambda line: print(line, flush=True))
    print(manifest["metrics"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
