"""`make bench`: run every CPU benchmark under perf/ and print one table of ratios.

Protocol for a benchmark script `perf/bench_<name>.py`:

- It runs from the repository root as `python perf/bench_<name>.py` with no arguments, on the CPU, in at most
  a few minutes, and exits 0 on success.
- Its LAST line on stdout is one JSON object: `{"name": "<name>", "ratios": {"<metric>": <number>, ...}}`,
  optionally with a `"details"` object. Each ratio compares our component with a baseline measured in the
  same run on the same machine (so machine speed cancels out), and the metric name says what is divided by
  what, e.g. `"convert_s_vs_safetensors_copy_s": 1.4`. Anything printed before that line is shown only when
  the benchmark fails.

A benchmark that exits non-zero, times out, or whose last line is not such an object is reported as failed,
and `make bench` then exits 1 after printing the rest of the table.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

PERF_DIR = Path(__file__).resolve().parent
KNOWN = ("bench_convert.py", "bench_quant.py", "bench_decode.py")


def find_benchmarks(perf_dir: Path = PERF_DIR) -> list[Path]:
    """The known benchmarks first (in their order), then any other bench_*.py; never this driver."""
    found = {p.name: p for p in perf_dir.glob("bench_*.py") if p.name != Path(__file__).name}
    ordered = [found.pop(name) for name in KNOWN if name in found]
    return ordered + [found[name] for name in sorted(found)]


def parse_result(stdout: str) -> dict:
    """The protocol's last-line JSON object, validated; ValueError says what is wrong."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError("printed nothing")
    try:
        result = json.loads(lines[-1])
    except json.JSONDecodeError:
        raise ValueError(f"last line is not JSON: {lines[-1][:120]!r}") from None
    if not isinstance(result, dict) or not isinstance(result.get("name"), str):
        raise ValueError("last line must be an object with a string 'name'")
    ratios = result.get("ratios")
    if not isinstance(ratios, dict) or not ratios:
        raise ValueError("'ratios' must be a non-empty object")
    for metric, value in ratios.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"ratio {metric!r} is not a finite number: {value!r}")
    return result


def run_benchmark(script: Path, timeout_s: float, cwd: Path) -> dict:
    """Run one script; returns {"script", "ok", "name", "ratios"} or {"script", "ok": False, "error", "output"}."""
    base = {"script": script.name}
    try:
        proc = subprocess.run(
            [sys.executable, str(script)], cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return base | {"ok": False, "error": f"timed out after {timeout_s:.0f} s", "output": ""}
    output = (proc.stdout + proc.stderr)[-2000:]
    if proc.returncode != 0:
        return base | {"ok": False, "error": f"exit status {proc.returncode}", "output": output}
    try:
        result = parse_result(proc.stdout)
    except ValueError as exc:
        return base | {"ok": False, "error": str(exc), "output": output}
    return base | {"ok": True, "name": result["name"], "ratios": result["ratios"]}


def format_table(results: list[dict]) -> str:
    rows = [("benchmark", "metric", "ratio")]
    for r in results:
        if r["ok"]:
            rows += [(r["name"], metric, f"{value:.3f}") for metric, value in r["ratios"].items()]
        else:
            rows.append((r["script"], "FAILED", r["error"]))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per benchmark")
    parser.add_argument("--json", action="store_true", help="print all results as one JSON list")
    args = parser.parse_args(argv)
    scripts = find_benchmarks()
    if not scripts:
        print("no benchmarks found under perf/ (perf/bench_*.py)")
        return 0
    results = []
    for script in scripts:
        print(f"running {script.name} ...", file=sys.stderr, flush=True)
        results.append(run_benchmark(script, args.timeout, PERF_DIR.parent))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(format_table(results))
        for r in results:
            if not r["ok"] and r["output"]:
                print(f"\n--- {r['script']} output (tail) ---\n{r['output']}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
