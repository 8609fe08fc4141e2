"""dflash-trt: DFlash block-diffusion speculative decoding for the TensorRT-LLM 1.2.x engine path."""

__version__ = "0.1.0"
