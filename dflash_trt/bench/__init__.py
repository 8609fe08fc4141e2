"""`dflash-trt bench`: one load generator over one executor interface (TensorRT-LLM, Triton, CPU golden model)."""
