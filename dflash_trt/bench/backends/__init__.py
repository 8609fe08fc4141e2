"""Executor backends of the load generator: TensorRT-LLM (GPU), Triton (gRPC) and the golden model (CPU)."""
