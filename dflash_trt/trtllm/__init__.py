"""The TensorRT-LLM 1.2.x engine path: build plan (pure Python), network (`model`), build driver (`build`).

Only `build_plan` is importable everywhere; `model` and `build` import `tensorrt_llm` and run on GPU hosts.
"""
