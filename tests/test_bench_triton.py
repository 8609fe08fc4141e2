"""Triton backend against a loopback gRPC server speaking Triton's real streaming protocol.

The server is tritonclient's generated `GRPCInferenceService` on 127.0.0.1, answering `ModelStreamInfer` the way
the `tensorrtllm` backend does in decoupled streaming mode: one response per iteration with that iteration's
`output_ids`, `triton_final_response` on the last one, an error message for a bad request. What it proves: the
backend's requests are what the `tensorrt_llm` model reads, and its stream handling; not the server's timing.
"""

from __future__ import annotations

import asyncio
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from dflash_trt.bench.backends.triton import TritonBackend
from dflash_trt.bench.driver import BenchRequest, run_load
from dflash_trt.errors import DFlashTrtError
from dflash_trt.triton import processing as P

pytestmark = pytest.mark.timeout(60)


def _inputs(request) -> dict[str, np.ndarray]:
    dtypes = {"INT32": np.int32, "BOOL": np.bool_}
    return {
        t.name: np.frombuffer(raw, dtype=dtypes[t.datatype]).reshape(t.shape)
        for t, raw in zip(request.inputs, request.raw_input_contents, strict=True)
    }


class FakeTensorrtLlm(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Echoes `request_output_len` tokens (prompt length + i) in chunks of 1, 3, 2, 3, ...; token 13 is an error."""

    def __init__(self):
        self.seen: list[dict[str, np.ndarray]] = []

    def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=request.name == "tensorrt_llm")

    def ModelStreamInfer(self, request_iterator, context):
        request = next(request_iterator)
        inputs = _inputs(request)
        self.seen.append(inputs)
        if 13 in inputs[P.LLM_INPUT_IDS]:
            yield service_pb2.ModelStreamInferResponse(error_message="input token 13 is not allowed")
            return
        total = int(inputs[P.LLM_REQUEST_OUTPUT_LEN].reshape(-1)[0])
        start = int(inputs[P.LLM_INPUT_LENGTHS].reshape(-1)[0])
        tokens = list(range(start, start + total))
        sizes = [1] + [3, 2] * total
        while tokens:
            chunk, tokens = tokens[: sizes[0]], tokens[sizes[0] :]
            sizes.pop(0)
            time.sleep(0.002)
            response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
            out = response.outputs.add()
            out.name, out.datatype = P.LLM_OUTPUT_IDS, "INT32"
            out.shape.extend([1, 1, len(chunk)])
            response.raw_output_contents.append(np.array(chunk, dtype=np.int32).tobytes())
            response.parameters["triton_final_response"].bool_param = not tokens
            yield service_pb2.ModelStreamInferResponse(infer_response=response)


@pytest.fixture()
def server():
    servicer = FakeTensorrtLlm()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}", servicer
    srv.stop(grace=None)


def test_streams_token_ids_and_records_each_response(server):
    url, servicer = server
    requests = [BenchRequest(i, [7] * (2 + i), 6) for i in range(5)]
    trace = asyncio.run(run_load(TritonBackend(url, end_id=2), requests, concurrency=3))
    for record in trace.records:
        n = record.input_len
        assert record.error is None and record.output_ids == list(range(n, n + 6))
        assert record.chunks == [1, 3, 2]
    assert max(c for _, c in trace.in_flight) == 3
    sent = servicer.seen[0]
    assert sent[P.LLM_STREAMING].reshape(-1).tolist() == [True]
    assert sent[P.LLM_END_ID].reshape(-1).tolist() == [2] and sent[P.LLM_PAD_ID].reshape(-1).tolist() == [2]
    assert sorted(s[P.LLM_INPUT_IDS].shape[1] for s in servicer.seen) == [2, 3, 4, 5, 6]


def test_an_error_fails_only_its_own_request(server):
    url, _ = server
    requests = [BenchRequest(0, [5, 5], 4), BenchRequest(1, [13], 4), BenchRequest(2, [5], 4)]
    trace = asyncio.run(run_load(TritonBackend(url), requests, concurrency=3))
    errors = {r.prompt_index: r.error for r in trace.records}
    assert errors[0] is None and errors[2] is None and "token 13" in errors[1]


def test_unreachable_server_and_missing_model_are_one_clear_error(server):
    url, _ = server
    with pytest.raises(DFlashTrtError, match="cannot reach a Triton server at 127.0.0.1:1"):
        asyncio.run(
            run_load(TritonBackend("127.0.0.1:1", connect_timeout_s=5), [BenchRequest(0, [1], 1)], concurrency=1)
        )
    with pytest.raises(DFlashTrtError, match="no ready model 'ensemble'"):
        asyncio.run(run_load(TritonBackend(url, model="ensemble"), [BenchRequest(0, [1], 1)], concurrency=1))
