"""Executors that are clients of a server: a Triton deployment over gRPC streaming (`triton.py`) or HTTP
`generate_stream` (`triton_http.py`), and any OpenAI completions server (`openai_http.py`), each request streamed in
its own task (`streams.py`). They speak the executor contract (`dflash_trt.executors.contract`), so the load
generator and `serve` drive a server as they drive an in-process engine."""
