"""Per-GPU figures: the one GPU table (the roofline model, the capacity planner and the build profiles read it).

Peaks are dense (without 2:4 sparsity). Memory is the total the device reports in bytes (nvidia-smi's MiB), not
the marketing size in decimal GB: TensorRT-LLM sizes its KV pool from what the device reports. Each figure's
kind and source is kept next to it (`plan --provenance`); how much of each peak a real kernel reaches is a
separate, stated assumption in `dflash_trt.analysis.model.Calibration`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.errors import DFlashTrtError
from dflash_trt.gpu_targets import GPU_SMS


@dataclass(frozen=True)
class GpuSpec:
    """One GPU as its datasheet describes it; rates in bytes/s and FLOP/s."""

    name: str
    hbm_bytes: float
    hbm_bandwidth: float
    bf16_flops: float
    fp8_flops: float
    nvfp4_flops: float | None
    interconnect: str  # key of analysis.comm.INTERCONNECTS: the fabric its tensor-parallel collectives use
    source: str
    sm: int  # compute capability x 10: SM90 Hopper has FP8 tensor cores, SM100/SM103 Blackwell add NVFP4
    memory_source: str = ""  # where `hbm_bytes` comes from, when not from `source`
    memory_kind: str = "datasheet"
    kind: str = "datasheet"  # of the peaks in `source`: "assumed" when no vendor document backs them

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
_MIB = 2**20

GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        name="H100 SXM",
        hbm_bytes=81559 * _MIB,
        hbm_bandwidth=3.35 * _TB,
        bf16_flops=0.989 * _PF,
        fp8_flops=1.979 * _PF,
        nvfp4_flops=None,
        interconnect="nvlink4",
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM column; sparse figures halved)",
        sm=GPU_SMS["h100"],
        memory_source="device report: nvidia-smi total 81559 MiB for 'NVIDIA H100 80GB HBM3' (listings in "
        "modal-labs/modal-client PR #2797 and huggingface/text-embeddings-inference issue #350)",
        memory_kind="measured",
    ),
    "h200": GpuSpec(
        name="H200 SXM",
        hbm_bytes=143771 * _MIB,
        hbm_bandwidth=4.8 * _TB,
        bf16_flops=0.989 * _PF,
        fp8_flops=1.979 * _PF,
        nvfp4_flops=None,
        interconnect="nvlink4",
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM column; sparse figures halved)",
        sm=GPU_SMS["h200"],
        memory_source="assumed: 143771 MiB (150.8 GB), the total H200 SXM devices are reported to show; no device "
        "listing is recorded here (the datasheet's 141 GB is the marketing capacity)",
        memory_kind="assumed",
    ),
    "b200": GpuSpec(
        name="B200 (HGX)",
        hbm_bytes=183359 * _MIB,
        hbm_bandwidth=7.7 * _TB,
        bf16_flops=2.25 * _PF,
        fp8_flops=4.5 * _PF,
        nvfp4_flops=9.0 * _PF,
        interconnect="nvlink5",
        source="NVIDIA HGX B200 datasheet, per GPU (sparse halved); bandwidth 7.7 TB/s per "
        "GPU as HGX B200 lists it, not the DGX total / 8 (8.0), and 7.68 TB/s from the driver's 7680-bit bus x "
        "3996 MHz x 2 (pytorch/ao PR #4002)",
        sm=GPU_SMS["b200"],
        memory_source="device report: nvidia-smi total 183359 MiB for 'NVIDIA B200' (NVIDIA/TensorRT-LLM issue #10278)",
        memory_kind="measured",
    ),
    "b300": GpuSpec(
        name="B300 (HGX, Blackwell Ultra)",
        hbm_bytes=288 * _GB,
        hbm_bandwidth=8.0 * _TB,
        bf16_flops=2.25 * _PF,
        fp8_flops=4.5 * _PF,
        nvfp4_flops=13.0 * _PF,
        interconnect="nvlink5",
        source="assumed: no NVIDIA document is recorded here; third-party tabulations of the HGX B300 "
        "(glennklockwood.com/garden/processors/B300: dense FP4 ~13 PF vs 9 PF on B200, 8 TB/s; acecloud.ai's HGX "
        "B300 table: 288 GB HBM3e and up to 8 TB/s per GPU)",
        sm=GPU_SMS["b300"],
        memory_source="assumed: 288 decimal GB from the same third-party tables; no device report is recorded here",
        memory_kind="assumed",
        kind="assumed",
    ),
}


def get_gpu(name: str) -> GpuSpec:
    key = name.strip().lower()
    if key not in GPUS:
        raise DFlashTrtError(f"unknown GPU {name!r} (known: {', '.join(GPUS)})")
    return GPUS[key]
