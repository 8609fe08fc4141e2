"""`dflash-trt <command> --help` wall time vs importing torch, each in a fresh interpreter, same run.

Protocol: perf/bench_all.py. Help is what a user runs first and most often; it should cost an interpreter start and
argparse, never the seconds torch takes to import. Each ratio divides one command's help time by the time of
`python -c "import torch"`, so a command whose help imports torch again shows a ratio near (or above) 1.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPEATS = 3


def _median_seconds(argv: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from dflash_trt.cli import COMMANDS

    torch_s = _median_seconds(["-c", "import torch"])
    help_s = {"top_level": _median_seconds(["-m", "dflash_trt.cli", "--help"])}
    help_s.update({name: _median_seconds(["-m", "dflash_trt.cli", name, "--help"]) for name in COMMANDS})
    print(
        json.dumps(
            {
                "name": "help",
                "ratios": {f"{name}_help_s_vs_import_torch_s": round(s / torch_s, 3) for name, s in help_s.items()},
                "details": {
                    "import_torch_s": round(torch_s, 3),
                    **{f"{n}_help_s": round(s, 3) for n, s in help_s.items()},
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
