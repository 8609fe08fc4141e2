"""The GPUs DFlash engines are built for, by the names users type (`build --gpu`, `emulate --gpu`, profiles'
`gpu:`), with their compute capability: what decides the attention kernels of an engine (trtllm/attention_route.py).
The GPUs' other figures are `analysis/gpus.py`, which takes each one's SM from here.
"""

from __future__ import annotations

from dflash_trt.errors import DFlashTrtError

# Compute capability x 10 (TensorRT-LLM's getSMVersion()).
GPU_SMS = {"h100": 90, "h200": 90, "b200": 100, "b300": 103}
# NVFP4 GEMMs (TensorRT-LLM's FP4 kernels and the e2m1 tensor-core instructions) exist from Blackwell on.
NVFP4_MIN_SM = 100
# The GPU planned for when none is named and none is visible (a dry run on a machine without one).
ASSUMED_GPU = "h200"
# Hopper devices report about 80 GB (H100) or about 141 GB (H200); the boundary between them, in bytes.
H200_MIN_MEMORY = 100 * 2**30


def gpu_sm(name: str) -> int:
    if name not in GPU_SMS:
        raise DFlashTrtError(f"unknown GPU {name!r}: DFlash engines are built for {', '.join(GPU_SMS)}")
    return GPU_SMS[name]


def check_nvfp4_gpu(name: str, what: str) -> None:
    """NVFP4 weights run on Blackwell only: a Hopper engine of them would fail at its first GEMM, not at the build."""
    if gpu_sm(name) < NVFP4_MIN_SM:
        raise DFlashTrtError(
            f"{what} is nvfp4, which needs Blackwell (SM{NVFP4_MIN_SM} or newer); {name} is SM{gpu_sm(name)}"
        )


def gpu_of_device(sm: int, memory_bytes: int) -> str | None:
    """The name of a device from its SM and memory, or None for a GPU DFlash engines are not built for."""
    if sm == 90:
        return "h200" if memory_bytes >= H200_MIN_MEMORY else "h100"
    return {100: "b200", 103: "b300"}.get(sm)


def visible_gpu() -> tuple[str | None, int] | None:
    """(name or None, SM) of GPU 0 of this host, or None without a visible GPU (torch imported only here)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    sm = 10 * major + minor
    return gpu_of_device(sm, torch.cuda.get_device_properties(0).total_memory), sm


def resolve_gpu(requested: str | None) -> tuple[str, str]:
    """(GPU name, how it was chosen): the one named, else the visible one, else ASSUMED_GPU (said so)."""
    if requested is not None:
        gpu_sm(requested)
        return requested, "as given"
    visible = visible_gpu()
    if visible is None:
        return ASSUMED_GPU, f"assumed: no GPU is visible here; pass --gpu {'|'.join(GPU_SMS)} to choose"
    name, sm = visible
    if name is None:
        raise DFlashTrtError(
            f"this host's GPU is SM{sm}; DFlash engines are built for {', '.join(GPU_SMS)} (pass --gpu for a dry run)"
        )
    return name, "the GPU of this host"
