"""Weight quantization throughput: dflash_trt.quant vs modelopt 0.47, same bf16 weight, same run, same bytes.

The modelopt side runs the calls its TensorRT-LLM exporter makes for one calibrated linear weight: the max
calibrator's `reduce_amax`, then FP8: `amax / 448` and `to_quantized_weight`; NVFP4:
`NVFP4QTensor.get_weights_scaling_factor_2` / `get_weights_scaling_factor` and `to_quantized_weight`.
Both sides are timed alternately (best of `--repeats`), outputs are compared byte for byte, and throughput is
reported as GB/s of bf16 input weight.

    python perf/bench_quant.py [--rows 4096] [--cols 4096] [--repeats 3] [--threads 1 2] [--json]

The last line printed is the `perf/bench_all.py` protocol's JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch

from dflash_trt.quant.fp8 import quantize_fp8
from dflash_trt.quant.nvfp4 import quantize_nvfp4

QuantizeFn = Callable[[torch.Tensor], dict[str, torch.Tensor]]


def _modelopt_fp8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    from modelopt.torch.export.quant_utils import to_quantized_weight
    from modelopt.torch.quantization.utils import reduce_amax

    scale = (reduce_amax(weight).float() / 448.0).reshape(1)
    return {"weight": to_quantized_weight(weight, scale, "fp8"), "weights_scaling_factor": scale}


def _modelopt_nvfp4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    from modelopt.torch.export.quant_utils import to_quantized_weight
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    scale_2 = NVFP4QTensor.get_weights_scaling_factor_2(weight)
    scale = NVFP4QTensor.get_weights_scaling_factor(weight, 16, scale_2)[0]
    return {
        "weight": to_quantized_weight(weight, scale, "nvfp4", scale_2, 16),
        "weights_scaling_factor": scale,
        "weights_scaling_factor_2": scale_2,
    }


FORMATS: dict[str, tuple[QuantizeFn, QuantizeFn]] = {
    "fp8": (lambda w: vars(quantize_fp8(w)), _modelopt_fp8),
    "nvfp4": (lambda w: vars(quantize_nvfp4(w)), _modelopt_nvfp4),
}


def _identical(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> bool:
    if ours.keys() != theirs.keys():
        return False
    for key, mine in ours.items():
        ref = theirs[key]
        if mine.dtype != ref.dtype or mine.shape != ref.shape:
            return False
        if not torch.equal(mine.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)):
            return False
    return True


def _best_seconds(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def run(rows: int, cols: int, repeats: int) -> list[dict[str, object]]:
    weight = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    gigabytes = weight.numel() * weight.element_size() / 1e9
    results = []
    for qformat, (ours, theirs) in FORMATS.items():
        identical = _identical(ours(weight), theirs(weight))
        best = _best_seconds({"ours": lambda f=ours: f(weight), "modelopt": lambda f=theirs: f(weight)}, repeats)
        results.append(
            {
                "format": qformat,
                "shape": [rows, cols],
                "threads": torch.get_num_threads(),
                "ours_gb_per_s": round(gigabytes / best["ours"], 3),
                "modelopt_gb_per_s": round(gigabytes / best["modelopt"], 3),
                "speedup": round(best["modelopt"] / best["ours"], 2),
                "identical": identical,
            }
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="torch intra-op thread counts to measure (default: 1 and torch's default)",
    )
    parser.add_argument("--json", action="store_true", help="print only the final JSON line")
    args = parser.parse_args(argv)
    thread_counts = args.threads or sorted({1, torch.get_num_threads()})
    results = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        results += run(args.rows, args.cols, args.repeats)
    if not args.json:
        print(f"load average (1 min): {os.getloadavg()[0]:.1f}")
        for r in results:
            print(
                f"{r['format']:6s} {r['shape'][0]}x{r['shape'][1]} bf16, {r['threads']} thread(s): "
                f"ours {r['ours_gb_per_s']:.3f} GB/s, modelopt {r['modelopt_gb_per_s']:.3f} GB/s, "
                f"{r['speedup']:.2f}x, identical={r['identical']}"
            )
    # Last line: the perf/bench_all.py protocol (ratios of ours over modelopt, same run, same machine).
    ratios = {f"{r['format']}_gb_s_vs_modelopt_gb_s_{r['threads']}thread": r["speedup"] for r in results}
    print(
        json.dumps(
            {
                "name": "quant",
                "ratios": ratios,
                "details": {"load_average_1min": os.getloadavg()[0], "results": results},
            }
        )
    )
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
