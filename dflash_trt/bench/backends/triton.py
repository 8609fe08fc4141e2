"""Triton backend: a deployed model repository over gRPC decoupled streaming (`tritonclient.grpc.aio`).

Requests go to the repository's `tensorrt_llm` model with token ids (`input_ids`, `request_output_len`,
`streaming`), so users measure the server they run without tokenizer work in the loop; in streaming mode the
`tensorrtllm` backend answers once per decoding iteration with that iteration's new `output_ids`. Each request
has its own bidirectional stream, held open until its final response (Triton marks it with the
`triton_final_response` parameter), so an error names the request it belongs to. Tensor names are the
repository's own (`dflash_trt.triton.processing`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from dflash_trt.bench.driver import Backend, BenchRequest, Deliver, Response
from dflash_trt.errors import DFlashTrtError
from dflash_trt.triton import processing as P

DEFAULT_MODEL = "tensorrt_llm"
FINAL = "triton_final_response"


def request_inputs(request: BenchRequest, end_id: int | None) -> list:
    import tritonclient.grpc.aio as grpcclient

    def tensor(name: str, array: np.ndarray, dtype: str):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    ids = np.array([request.input_ids], dtype=np.int32)
    inputs = [
        tensor(P.LLM_INPUT_IDS, ids, "INT32"),
        tensor(P.LLM_INPUT_LENGTHS, np.array([[ids.shape[1]]], dtype=np.int32), "INT32"),
        tensor(P.LLM_REQUEST_OUTPUT_LEN, np.array([[request.max_new_tokens]], dtype=np.int32), "INT32"),
        tensor(P.LLM_STREAMING, np.array([[True]], dtype=bool), "BOOL"),
    ]
    if end_id is not None:
        inputs.append(tensor(P.LLM_END_ID, np.array([[end_id]], dtype=np.int32), "INT32"))
        inputs.append(tensor(P.LLM_PAD_ID, np.array([[max(end_id, 0)]], dtype=np.int32), "INT32"))
    return inputs


class TritonBackend(Backend):
    def __init__(
        self,
        url: str,
        *,
        model: str = DEFAULT_MODEL,
        mode: str = "dflash",
        gpus: int = 1,
        end_id: int | None = None,
        connect_timeout_s: float = 10.0,
    ):
        self.url = url
        self.model = model
        self.mode = mode
        self.gpus = gpus
        self.end_id = end_id
        self.connect_timeout_s = connect_timeout_s
        self.client: Any = None
        self.deliver: Deliver = lambda batch: None
        self.tasks: set[asyncio.Task] = set()

    async def start(self, deliver: Deliver) -> None:
        import tritonclient.grpc.aio as grpcclient
        from tritonclient.utils import InferenceServerException

        self.deliver = deliver
        self.client = grpcclient.InferenceServerClient(self.url)
        try:
            ready = await asyncio.wait_for(self.client.is_model_ready(self.model), self.connect_timeout_s)
        except (asyncio.TimeoutError, InferenceServerException) as exc:
            await self.client.close()
            reason = str(exc) or f"no answer within {self.connect_timeout_s:g} s"  # a timeout has no text of its own
            raise DFlashTrtError(f"cannot reach a Triton server at {self.url}: {reason}") from None
        if not ready:
            await self.client.close()
            raise DFlashTrtError(f"Triton at {self.url} has no ready model {self.model!r}")

    def submit(self, request_id: int, request: BenchRequest) -> None:
        task = asyncio.get_running_loop().create_task(self._stream(request_id, request))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _stream(self, request_id: int, request: BenchRequest) -> None:
        import grpc
        from tritonclient.utils import InferenceServerException

        done = asyncio.Event()

        async def one_request():
            yield {
                "model_name": self.model,
                "inputs": request_inputs(request, self.end_id),
                "request_id": str(request_id),
            }
            await done.wait()  # keep our side of the stream open until the final response

        try:
            async for result, error in self.client.stream_infer(one_request()):
                if error is not None:
                    self.deliver([Response(request_id, [], True, str(error))])
                    return
                output = result.as_numpy(P.LLM_OUTPUT_IDS)
                tokens = [] if output is None else output.reshape(-1).tolist()
                flag = result.get_response().parameters.get(FINAL)
                final = bool(flag is not None and flag.bool_param)
                self.deliver([Response(request_id, tokens, final)])
                if final:
                    return
            self.deliver([Response(request_id, [], True, "the stream ended before a final response")])
        except (InferenceServerException, grpc.RpcError) as exc:
            self.deliver([Response(request_id, [], True, str(exc))])
        finally:
            done.set()

    async def stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.close()
            self.client = None
