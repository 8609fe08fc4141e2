"""Executors: what takes generation requests and answers each decoding iteration with its tokens.

`contract` is the interface and its one request and one response record; `worker` the thread that steps a CPU
stepper; `golden`, `emulated` and `trtllm` the in-process executors (the golden model, the emulated engine, and
TensorRT-LLM 1.2.x's C++ executor). The load generator (`bench/`), the OpenAI server (`server/`) and the CPU-served
Triton model (`triton/emulated_llm.py`) all sit on this package.
"""
