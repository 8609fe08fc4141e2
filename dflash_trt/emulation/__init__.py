"""The engine network on a CPU: a torch execution of the TensorRT-LLM 1.2.x API subset `trtllm/model.py` uses
(`dflash-trt emulate`, docs/engine.md §12); the runtime's EAGLE step loop around it is the emulated executor,
`dflash_trt/executors/emulated.py`.

`stand_ins` holds the registry of emulated symbols and loads the unmodified `model.py` (and the `verify.py` and
`plugin.py` it imports) against them; `functional`, `module`, `layers`, `quantization`, `rope`, `models` and
`plugins` are the stand-ins; `engine` the loaded network and one step of it, `kv_pool` the paged KV cache.
Each behaviour follows the 1.2-era TensorRT-LLM source file its docstring names; those copies carry commit ids but
no release tags (as noted in tests/data/trtllm_api.json), and kernel behaviour (XQA's packed mask, the CumsumLastDim
scan) was read, never run.
"""
