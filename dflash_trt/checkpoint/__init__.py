"""Reading HF checkpoints and writing TensorRT-LLM checkpoints, streamed tensor by tensor."""
