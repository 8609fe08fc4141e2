"""Conversion orchestration: HF folders in, a verified TensorRT-LLM checkpoint out (convert, calibrate, verify,
pre-quantized input, the quantization acceptance study); sits above checkpoint, quant and reference."""
