"""Published per-GPU figures: the one GPU table (the roofline model and the build profiles read it).

Only vendor-published peak numbers live here (dense, i.e. without 2:4 sparsity); how much of each peak a real
kernel reaches is a separate, stated assumption in `dflash_trt.perf.model.Calibration`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.errors import DFlashTrtError


@dataclass(frozen=True)
class GpuSpec:
    """One GPU as its datasheet describes it; rates in bytes/s and FLOP/s."""

    name: str
    hbm_bytes: float
    hbm_bandwidth: float
    bf16_flops: float
    fp8_flops: float
    nvfp4_flops: float | None
    nvlink_bandwidth: float  # per direction, per GPU
    source: str
    sm: int  # compute capability x 10: SM90 Hopper has FP8 tensor cores, SM100/SM103 Blackwell add NVFP4

    def dense_flops(self, precision: str) -> float:
        """Peak dense tensor-core rate for the GEMM input precision (weights and activations)."""
        # MXFP4 runs on Blackwell's FP4 tensor cores; Hopper dequantizes it and multiplies in bf16.
        mxfp4 = self.nvfp4_flops if self.nvfp4_flops is not None else self.bf16_flops
        rates = {"bf16": self.bf16_flops, "fp8": self.fp8_flops, "nvfp4": self.nvfp4_flops, "mxfp4": mxfp4}
        if precision not in rates:
            raise DFlashTrtError(f"unknown precision {precision!r} (known: {', '.join(rates)})")
        rate = rates[precision]
        if rate is None:
            raise DFlashTrtError(f"{self.name} has no {precision} tensor cores (NVFP4 needs Blackwell)")
        return rate


_TB = 1e12
_PF = 1e15
_GB = 1e9

GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        name="H100 SXM",
        hbm_bytes=80 * _GB,
        hbm_bandwidth=3.35 * _TB,
        bf16_flops=0.989 * _PF,
        fp8_flops=1.979 * _PF,
        nvfp4_flops=None,
        nvlink_bandwidth=450 * _GB,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM column; sparse figures halved; NVLink 900 GB/s total)",
        sm=90,
    ),
    "h200": GpuSpec(
        name="H200 SXM",
        hbm_bytes=141 * _GB,
        hbm_bandwidth=4.8 * _TB,
        bf16_flops=0.989 * _PF,
        fp8_flops=1.979 * _PF,
        nvfp4_flops=None,
        nvlink_bandwidth=450 * _GB,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM column; sparse figures halved; NVLink 900 GB/s total)",
        sm=90,
    ),
    "b200": GpuSpec(
        name="B200 (HGX)",
        hbm_bytes=180 * _GB,
        hbm_bandwidth=8.0 * _TB,
        bf16_flops=2.25 * _PF,
        fp8_flops=4.5 * _PF,
        nvfp4_flops=9.0 * _PF,
        nvlink_bandwidth=900 * _GB,
        source="NVIDIA HGX B200 / DGX B200 datasheets, per GPU (8-GPU totals / 8; sparse halved; NVLink 5 1.8 TB/s)",
        sm=100,
    ),
    "b300": GpuSpec(
        name="B300 (HGX, Blackwell Ultra)",
        hbm_bytes=288 * _GB,
        hbm_bandwidth=8.0 * _TB,
        bf16_flops=2.25 * _PF,
        fp8_flops=4.5 * _PF,
        nvfp4_flops=13.0 * _PF,
        nvlink_bandwidth=900 * _GB,
        source="NVIDIA HGX B300 platform figures as tabulated at glennklockwood.com/garden/processors/B300 "
        "(dense FP4 ~13 PF vs 9 PF on B200; 288 GB HBM3e at 8 TB/s; NVLink 5 1.8 TB/s)",
        sm=103,
    ),
}


def get_gpu(name: str) -> GpuSpec:
    key = name.strip().lower()
    if key not in GPUS:
        raise DFlashTrtError(f"unknown GPU {name!r} (known: {', '.join(GPUS)})")
    return GPUS[key]
