"""What a tensor-parallel collective costs on each interconnect, priced from published kernel measurements.

An all-reduce's time depends on the message size: small messages pay a fixed latency (barrier, launch, one
NVSwitch hop), large ones the link bandwidth. TensorRT-LLM 1.2.x's engine picks the algorithm by size
(`AllreducePlugin::selectImplementation`, read at NVIDIA/TensorRT-LLM 005b299b, not run): with NVLink and peer
access, its ONESHOT kernel up to 1 MB at TP <= 4 (always at TP 2) and up to 500 KB above TP 4, NCCL beyond.
The one-shot curve is a published latency table of that kernel (as ported to SGLang), measured on H100; NCCL's
is an affine fit (latency + bytes over an effective bus bandwidth) of published NCCL all-reduce times. Another
GPU generation with a faster link keeps the latency and moves bytes faster: its message sizes are scaled by the
link-bandwidth ratio before the curve is read. How much of these isolated-kernel times a serving runtime keeps
inside a decoding step is a per-harness fit (`Calibration.allreduce_efficiency`), not a property of the link.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cache

_US = 1e-6
_MB = 1e6
_GB = 1e9

# SGLang PR #2904 (2025-01), H100 SXM, `tests/test_trt_reduce.py` perf loop: the TensorRT-LLM-derived custom
# all-reduce ("custom allreduce" column), average of 50 calls without CUDA graphs, float32 tensors of 512 ... 1M
# elements (2 KB ... 4 MB). Latency in microseconds per TP width.
ONESHOT_SIZES_BYTES = (2048, 16384, 131072, 1048576, 2097152, 4194304)
ONESHOT_US = {
    2: (3.7, 3.9, 4.5, 7.9, 12.5, 19.9),
    4: (4.8, 3.7, 4.8, 13.9, 20.2, 31.1),
    8: (5.9, 5.7, 7.8, 16.7, 22.1, 33.8),
}
ONESHOT_SOURCE = (
    "SGLang PR #2904 (2025-01-15), H100 SXM: latency of the TensorRT-LLM-derived custom all-reduce at 2 KB ... 4 MB "
    "(float32 tensors of 512 ... 1M elements, tests/test_trt_reduce.py), TP 2 / 4 / 8"
)
# vLLM PR #24111 (2025-09), H100 SXM, TP 6: pynccl all-reduce of bf16 (n, 8192) tensors, milliseconds.
NCCL_POINTS_MB_MS = ((0.5, 0.023), (1.0, 0.025), (1.5, 0.032), (2.0, 0.043), (3.0, 0.047), (4.0, 0.053))
NCCL_POINTS_TP = 6
NCCL_SOURCE = (
    "vLLM PR #24111 (2025-09-02), H100 SXM, TP 6: pynccl all-reduce at 0.5 ... 4 MB (benchmark_device_communicators);"
    " latency and bus efficiency are the least-squares line through those six points"
)
# Where a runtime leaves its custom kernel for NCCL, per measured TP width. TensorRT-LLM 1.2.x
# AllreducePlugin::selectImplementation (AUTO): ONESHOT below these sizes, NCCL above. SGLang and vLLM are priced
# on the custom curve up to 8 MB (the buffer SGLang's custom all-reduce tests allocate), which holds their decode
# steps' messages.
ALGORITHMS: dict[str, dict[int, float]] = {
    "trtllm-auto": {2: float("inf"), 4: 1_000_000, 8: 500_000},
    "custom": {2: 8 * 2**20, 4: 8 * 2**20, 8: 8 * 2**20},
}


@dataclass(frozen=True)
class Interconnect:
    """A GPU-to-GPU fabric: its per-GPU bandwidth per direction (datasheet) and where that figure comes from."""

    name: str
    link_bandwidth: float  # bytes/s, per GPU, per direction
    source: str
    kind: str = "datasheet"


REFERENCE_BANDWIDTH = 450 * _GB  # NVLink 4 on H100 SXM, where the one-shot and NCCL curves were measured

INTERCONNECTS = {
    "nvlink4": Interconnect(
        "NVLink 4 + NVSwitch (HGX Hopper)",
        REFERENCE_BANDWIDTH,
        "NVIDIA H100 / H200 SXM datasheets: NVLink 900 GB/s per GPU (both directions together)",
    ),
    "nvlink5": Interconnect(
        "NVLink 5 + NVSwitch (HGX Blackwell)",
        900 * _GB,
        "NVIDIA HGX B200 datasheet: NVLink 5, 1.8 TB/s per GPU (both directions together); B300 assumed the same",
    ),
}


def _table_tp(tp: int) -> int:
    """The measured TP width that stands for `tp`: the smallest one at least as wide (8 beyond 8)."""
    return next((t for t in sorted(ONESHOT_US) if t >= tp), max(ONESHOT_US))


def oneshot_seconds(tp: int, size_bytes: float) -> float:
    """The measured one-shot latency at this message size: linear between the table's sizes, flat below the
    smallest, the last segment's slope beyond the largest."""
    us, sizes = ONESHOT_US[_table_tp(tp)], ONESHOT_SIZES_BYTES
    if size_bytes <= sizes[0]:
        return us[0] * _US
    i = min(bisect.bisect_left(sizes, size_bytes), len(sizes) - 1)
    slope = (us[i] - us[i - 1]) / (sizes[i] - sizes[i - 1])
    return (us[i - 1] + slope * (size_bytes - sizes[i - 1])) * _US


@cache
def nccl_fit() -> tuple[float, float]:
    """(latency in seconds, bus efficiency) of the NCCL points: time = latency + 2 (tp-1)/tp x bytes over
    (efficiency x link bandwidth), least squares on the published points."""
    xs = [mb * _MB for mb, _ in NCCL_POINTS_MB_MS]
    ys = [ms * 1e-3 for _, ms in NCCL_POINTS_MB_MS]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    ring = 2 * (NCCL_POINTS_TP - 1) / NCCL_POINTS_TP
    return my - slope * mx, ring / (slope * REFERENCE_BANDWIDTH)


def _nccl_seconds(tp: int, size_bytes: float, link: Interconnect, steps: float) -> float:
    latency, efficiency = nccl_fit()
    return latency + steps * (tp - 1) / tp * size_bytes / (efficiency * link.link_bandwidth)


def allreduce_seconds(link: Interconnect, tp: int, size_bytes: float, algorithm: str = "trtllm-auto") -> float:
    """One all-reduce of `size_bytes` per rank across `tp` GPUs, as an isolated kernel (0 without TP), with the
    runtime's choice between its custom kernel and NCCL (`ALGORITHMS`)."""
    if tp <= 1:
        return 0.0
    if size_bytes < ALGORITHMS[algorithm][_table_tp(tp)]:
        return oneshot_seconds(tp, size_bytes * REFERENCE_BANDWIDTH / link.link_bandwidth)
    return _nccl_seconds(tp, size_bytes, link, steps=2.0)


def allgather_seconds(link: Interconnect, tp: int, size_bytes: float) -> float:
    """One NCCL all-gather whose gathered result is `size_bytes` (the vocabulary-split lm_head's logits): half an
    all-reduce's traffic, the same latency."""
    if tp <= 1:
        return 0.0
    return _nccl_seconds(tp, size_bytes, link, steps=1.0)
