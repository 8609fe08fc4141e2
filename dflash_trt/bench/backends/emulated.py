"""CPU backend: the engine network itself under the emulation (`dflash_trt.emulation`), request by request.

Where the golden backend reproduces the engine's semantics, this one runs the network `trtllm-build` would compile,
with the runtime's in-flight batching, per-request temperatures and seeds: what a CPU-served Triton repository and
`dflash-trt serve --checkpoint_dir` answer with. Every step answers each request that produced tokens with them.
"""

from __future__ import annotations

from dflash_trt.bench.backends.stepping import SteppingBackend
from dflash_trt.bench.driver import BenchRequest, Response
from dflash_trt.decoding_modes import DFLASH
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.executor import EmulatedExecutor, Request

DEFAULT_SEED = 0  # what the emulated runtime seeds a request with when the request names no seed


class EmulatedStepper:
    """The emulated executor behind bench's request and response types."""

    def __init__(self, engine: EmulatedEngine, max_seq_len: int, stop_token_ids: list[int] | None = None):
        self.executor = EmulatedExecutor(engine, max_seq_len, stop_token_ids)

    def add(self, request_id: int, request: BenchRequest) -> None:
        seed = DEFAULT_SEED if request.seed is None else request.seed
        self.executor.add(
            Request(request_id, list(request.input_ids), request.max_new_tokens, request.temperature, seed)
        )

    def cancel(self, request_id: int) -> None:
        self.executor.cancel(request_id)

    def step(self) -> list[Response]:
        return [Response(out.index, out.tokens, out.finished, out.error) for out in self.executor.step()]

    def has_work(self) -> bool:
        return self.executor.has_work()

    def close(self) -> None:
        self.executor.close()


class EmulatedBackend(SteppingBackend):
    """The emulated engine served from a worker thread; `max_batch_size` is the engine's (fixed when it loaded)."""

    def __init__(self, engine: EmulatedEngine, max_seq_len: int, stop_token_ids: list[int] | None = None):
        super().__init__(lambda: EmulatedStepper(engine, max_seq_len, stop_token_ids), DFLASH)
        self.engine = engine
