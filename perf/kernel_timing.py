"""The two timers the kernel benchmarks share (`bench_kv_injection_gpu.py`, `bench_dflash_attention_gpu.py`): CUDA
events around many launches on a GPU, the best of a few wall-clock runs for the CPU fallback."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def cuda_seconds(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Mean seconds per call of `fn` on the current stream, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1e3 / iters


def best_cpu_seconds(fn: Callable[[], object], reps: int = 5) -> float:
    """The fastest of `reps` wall-clock runs: the least disturbed by whatever else the machine runs."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
