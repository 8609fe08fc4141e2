"""The Triton backend's `cancel`: the request's gRPC stream is cancelled, which a loopback server speaking Triton's
real streaming protocol sees as the end of the RPC (what tells the `tensorrtllm` backend to stop the request)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from dflash_trt.clients.triton import TritonExecutor
from dflash_trt.executors.contract import Request, Response
from dflash_trt.triton import processing as P

pytestmark = pytest.mark.timeout(60)


class EndlessModel(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Streams one token every 5 ms until its client goes away; records the ids of the requests that ended."""

    def __init__(self):
        self.ended: list[str] = []
        self.lock = threading.Lock()

    def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=True)

    def ModelStreamInfer(self, request_iterator, context):
        request = next(request_iterator)
        # Recorded when the RPC terminates: the server may stop pulling this generator once a send fails, so code
        # after the loop is not sure to run.
        context.add_callback(lambda: self._record_end(request.id))
        while context.is_active():
            response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
            out = response.outputs.add()
            out.name, out.datatype = P.LLM_OUTPUT_IDS, "INT32"
            out.shape.extend([1, 1, 1])
            response.raw_output_contents.append(np.array([5], dtype=np.int32).tobytes())
            yield service_pb2.ModelStreamInferResponse(infer_response=response)
            time.sleep(0.005)

    def _record_end(self, request_id: str) -> None:
        with self.lock:
            self.ended.append(request_id)


def test_cancel_ends_only_that_requests_stream():
    servicer = EndlessModel()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    seen: dict[int, int] = {}

    def deliver(batch: list[Response]) -> None:
        for response in batch:
            seen[response.request_id] = seen.get(response.request_id, 0) + len(response.tokens)

    async def run() -> None:
        backend = TritonExecutor(f"127.0.0.1:{port}")
        await backend.start(deliver)
        backend.submit(1, Request(input_ids=[1, 2], max_new_tokens=1000))
        backend.submit(2, Request(input_ids=[3], max_new_tokens=1000))
        while seen.get(1, 0) < 3 or seen.get(2, 0) < 3:
            await asyncio.sleep(0.01)
        backend.cancel(1)
        deadline = time.monotonic() + 20
        while servicer.ended != [f"{backend.id_prefix}-1"]:
            assert time.monotonic() < deadline, servicer.ended
            await asyncio.sleep(0.01)
        still = seen[2]
        deadline = time.monotonic() + 20
        while seen[2] <= still:  # the other request streams on
            assert time.monotonic() < deadline, f"request 2 stopped at {still} tokens"
            await asyncio.sleep(0.01)
        await backend.stop()

    try:
        asyncio.run(run())
    finally:
        server.stop(grace=None)
