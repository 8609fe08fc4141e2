"""The TensorRT-LLM 1.2.x engine path: build plan (pure Python: `build_plan` and the modules it composes), network
(`model`), in-graph verification (`verify`), plugin wrapper (`plugin`), build driver (`build`, `rank_build`).

`model` and `verify` import `tensorrt_llm` at import time and run on GPU hosts (or under `dflash_trt.emulation`);
the build plan's modules, `plugin`, `build` and `rank_build` import everywhere and reach TensorRT-LLM only when they
run it.
"""
