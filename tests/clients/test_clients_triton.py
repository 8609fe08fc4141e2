"""Triton backend against a loopback gRPC server speaking Triton's real streaming protocol.

The server is tritonclient's generated `GRPCInferenceService` on 127.0.0.1, answering `ModelStreamInfer` the way
the `tensorrtllm` backend does in decoupled streaming mode: one response per iteration with that iteration's
`output_ids`, `triton_final_response` on the last one, an error message for a bad request. What it proves: the
backend's requests are what the `tensorrt_llm` model reads, and its stream handling; not the server's timing.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from dflash_trt.bench.driver import run_load
from dflash_trt.cli import main as cli_main
from dflash_trt.clients.triton import TritonExecutor
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import Request
from dflash_trt.sampling_rules import Sampling
from dflash_trt.triton import processing as P

pytestmark = pytest.mark.timeout(60)


def _inputs(request) -> dict[str, np.ndarray]:
    dtypes = {"INT32": np.int32, "BOOL": np.bool_, "FP32": np.float32, "UINT64": np.uint64}
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
        first = int(inputs[P.LLM_INPUT_IDS].reshape(-1)[0])
        if first in MISBEHAVIOURS:
            yield service_pb2.ModelStreamInferResponse(infer_response=MISBEHAVIOURS[first](request, total))
            return
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


def _response(request, datatype: str, shape: list[int], raw: bytes, final: bool = True):
    response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
    out = response.outputs.add()
    out.name, out.datatype = P.LLM_OUTPUT_IDS, datatype
    out.shape.extend(shape)
    response.raw_output_contents.append(raw)
    response.parameters["triton_final_response"].bool_param = final
    return response


# A first prompt token -> a broken answer, as servers other than the tensorrtllm backend have sent.
MISBEHAVIOURS = {
    21: lambda req, n: _response(req, "INT32", [1, 1, 10 * n], np.arange(10 * n, dtype=np.int32).tobytes()),
    22: lambda req, n: _response(req, "INT32", [1, 1, 2], np.array([5, -3], np.int32).tobytes()),
    23: lambda req, n: _response(req, "FP32", [1, 1, 2], np.array([5.0, 6.5], np.float32).tobytes()),
    24: lambda req, n: _response(req, "INT32", [1, 1, 5], b"\x01\x02\x03"),
    25: lambda req, n: _response(req, "INT32", [1, 1, 1], np.array([999], np.int32).tobytes()),
}


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
    requests = [Request(input_ids=[7] * (2 + i), max_new_tokens=6) for i in range(5)]
    trace = asyncio.run(run_load(TritonExecutor(url, end_id=2), requests, concurrency=3))
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
    requests = [
        Request(input_ids=[5, 5], max_new_tokens=4),
        Request(input_ids=[13], max_new_tokens=4),
        Request(input_ids=[5], max_new_tokens=4),
    ]
    trace = asyncio.run(run_load(TritonExecutor(url), requests, concurrency=3))
    errors = {r.prompt_index: r.error for r in trace.records}
    assert errors[0] is None and errors[2] is None and "token 13" in errors[1]


def test_unreachable_server_and_missing_model_are_one_clear_error(server):
    url, _ = server
    with pytest.raises(DFlashTrtError, match="cannot reach a Triton server at 127.0.0.1:1"):
        asyncio.run(
            run_load(
                TritonExecutor("127.0.0.1:1", connect_timeout_s=5),
                [Request(input_ids=[1], max_new_tokens=1)],
                concurrency=1,
            )
        )
    with pytest.raises(DFlashTrtError, match="no ready model 'llm_v2'"):
        asyncio.run(
            run_load(TritonExecutor(url, model="llm_v2"), [Request(input_ids=[1], max_new_tokens=1)], concurrency=1)
        )
    with pytest.raises(DFlashTrtError, match="--triton_model ensemble takes text: give --tokenizer_dir"):
        TritonExecutor(url, model="ensemble")


def test_requests_send_greedy_temperature_and_their_seed(server):
    url, servicer = server
    requests = [
        Request(input_ids=[5, 5], max_new_tokens=2),
        Request(input_ids=[5], max_new_tokens=2, sampling=Sampling(temperature=0.7, seed=11)),
    ]
    asyncio.run(run_load(TritonExecutor(url), requests, concurrency=1))
    greedy, sampled = sorted(servicer.seen, key=lambda inputs: inputs[P.LLM_INPUT_IDS].size, reverse=True)
    assert greedy[P.LLM_TEMPERATURE].reshape(-1).tolist() == [0.0] and P.LLM_RANDOM_SEED not in greedy
    assert np.allclose(sampled[P.LLM_TEMPERATURE].reshape(-1), [0.7])
    assert sampled[P.LLM_RANDOM_SEED].reshape(-1).tolist() == [11]


def test_malformed_responses_fail_their_request_at_once(server):
    url, _ = server
    requests = [Request(input_ids=[first, 5], max_new_tokens=4) for i, first in enumerate(MISBEHAVIOURS)] + [
        Request(input_ids=[5], max_new_tokens=4)
    ]
    start = time.perf_counter()
    trace = asyncio.run(run_load(TritonExecutor(url, vocab_size=500), requests, concurrency=6, timeout_s=30))
    assert time.perf_counter() - start < 10  # failed at once, not after the timeout
    errors = {r.prompt_index: r.error for r in trace.records}
    assert errors[len(MISBEHAVIOURS)] is None
    assert "40 tokens, 4 were asked for" in errors[0]
    assert "outside the vocabulary (0..499): -3..5" in errors[1]
    assert "must be integers" in errors[2] and "float32" in errors[2]
    assert "malformed response" in errors[3]
    assert "outside the vocabulary (0..499): 999..999" in errors[4]
    assert all("\n" not in e for e in errors.values() if e)


def _bench(url: str, tmp_path, prompts: list[list[int]]) -> list[str]:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "out"
    argv = ["bench", "--triton_url", url, "--input_file", str(path), "--max_new_tokens", "3"]
    return [*argv, "--concurrency", "1", "--warmup", "0", "--output_dir", str(out), "--overwrite"]


def test_bench_reports_failed_requests_and_fails_when_all_did(server, tmp_path, capsys):
    url, _ = server
    assert cli_main(_bench(url, tmp_path, [[5, 5], [13, 5]])) == 0
    assert "dflash c=1: 1 requests failed; first: input token 13 is not allowed" in capsys.readouterr().err
    assert cli_main(_bench(url, tmp_path, [[13], [13, 5]])) == 2
    err = capsys.readouterr().err
    assert "every request of dflash c=1 failed: input token 13 is not allowed" in err


class ReplicatedTensorrtLlm(FakeTensorrtLlm):
    """The same model, described as `dflash-trt triton --replicas` writes it: `gpu_device_ids` naming one group of
    GPUs per replica."""

    def __init__(self, device_ids: str):
        super().__init__()
        self.device_ids = device_ids

    def ModelConfig(self, request, context):
        config = model_config_pb2.ModelConfig(name=request.name)
        config.parameters["gpu_device_ids"].string_value = self.device_ids
        return service_pb2.ModelConfigResponse(config=config)


@pytest.mark.parametrize(("device_ids", "gpus"), [("0;1;2;3;4;5;6;7", 8), ("0,1;2,3;4,5;6,7", 8), ("0,1;2,3", 4)])
def test_a_replicated_deployment_is_reported_per_node_and_per_gpu(tmp_path, capsys, device_ids, gpus):
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(ReplicatedTensorrtLlm(device_ids), srv)
    url = f"127.0.0.1:{srv.add_insecure_port('127.0.0.1:0')}"
    srv.start()
    try:
        argv = _bench(url, tmp_path, [[5, 5], [6]])
        assert cli_main(argv) == 0
        [point] = json.loads((tmp_path / "out" / "results.json").read_text())["points"]
        assert point["gpus"] == gpus and point["output_tokens"] == 6
        assert point["throughput_tok_s_per_gpu"] == pytest.approx(point["throughput_tok_s"] / gpus)
        assert cli_main([*argv, "--gpus", str(gpus)]) == 0  # stating the same count is fine
        assert cli_main([*argv, "--gpus", "1"]) == 2
        assert f"--gpus 1 disagrees with the server at {url}" in capsys.readouterr().err
    finally:
        srv.stop(grace=None)


def test_one_replica_is_reported_per_gpu_as_told(server, tmp_path):
    """A server whose tensorrt_llm names no gpu_device_ids (one replica; this double answers no ModelConfig):
    --gpus divides, 1 by default."""
    url, _ = server
    for argv, gpus in ((_bench(url, tmp_path, [[5]]), 1), ([*_bench(url, tmp_path, [[5]]), "--gpus", "2"], 2)):
        assert cli_main(argv) == 0
        [point] = json.loads((tmp_path / "out" / "results.json").read_text())["points"]
        assert point["gpus"] == gpus


def test_http_protocol_takes_a_text_model_and_its_tokenizer(server, tmp_path, capsys):
    url, _ = server
    argv = [*_bench(url, tmp_path, [[5]]), "--triton_protocol", "http"]
    assert cli_main(argv) == 2
    assert "--triton_protocol http takes the text models (ensemble, tensorrt_llm_bls)" in capsys.readouterr().err
    assert cli_main([*argv, "--triton_model", "ensemble"]) == 2
    assert "--triton_model ensemble takes text: give --tokenizer_dir" in capsys.readouterr().err


def test_requests_the_model_cannot_take_are_refused_before_they_leave(server):
    """Ids beyond INT32 (the model's input_ids) or the vocabulary, and budgets beyond INT32, fail their request
    with a final error and are never sent; the requests beside them are served."""
    url, servicer = server
    requests = [
        Request(input_ids=[5, 2**31], max_new_tokens=4),
        Request(input_ids=[-1, 5], max_new_tokens=4),
        Request(input_ids=[5, 5], max_new_tokens=2**31),
        Request(input_ids=[5, 999], max_new_tokens=4),
        Request(input_ids=[5, 5], max_new_tokens=4),
    ]
    trace = asyncio.run(run_load(TritonExecutor(url, vocab_size=999), requests, concurrency=5))
    errors = {r.prompt_index: r.error for r in trace.records}
    assert "prompt token ids must lie in 0..998, got 5..2147483648" in errors[0]
    assert "got -1..5" in errors[1] and "max_new_tokens must lie in 1..2147483647" in errors[2]
    assert "got 5..999" in errors[3] and errors[4] is None
    assert [s[P.LLM_INPUT_IDS].reshape(-1).tolist() for s in servicer.seen] == [[5, 5]]


def test_a_stream_that_fails_unforeseen_still_answers_its_request():
    """Whatever escapes a stream task becomes its request's final error: no request waits for ever."""
    from dflash_trt.clients.streams import StreamPerRequest

    class Broken(StreamPerRequest):
        async def _stream(self, request_id, request):
            raise OverflowError("Python int too large to convert to C long")

        async def start(self, deliver):
            self.deliver = deliver

        async def stop(self):
            await self._cancel_all()

    trace = asyncio.run(run_load(Broken(), [Request(input_ids=[5], max_new_tokens=4)], concurrency=1))
    assert "OverflowError: Python int too large" in trace.records[0].error


def test_bench_stops_at_the_tokenizers_eos_when_no_end_id_is_given_and_says_which(server, tmp_path, capsys):
    """A deployment does not say its end id: `bench` takes --end_id, else the EOS of --tokenizer_dir's tokenizer
    (the tiny pair's: id 0, hand-checked in its vocabulary), else none, and names its choice on stderr and in
    results.json."""
    from dflash_trt.tiny.heldout import target_dir

    url, servicer = server
    tokenizer = ["--tokenizer_dir", str(target_dir())]
    for extra, sent, said in (
        (tokenizer, [0], "end id 0: the EOS '<|endoftext|>' of the tokenizer in"),
        ([*tokenizer, "--end_id", "5"], [5], "end id 5: --end_id"),
        ([], None, "end id none: every request runs to --max_new_tokens"),
    ):
        servicer.seen.clear()
        assert cli_main([*_bench(url, tmp_path, [[5, 5]]), *extra]) == 0
        assert said in capsys.readouterr().err
        ends = [
            inputs[P.LLM_END_ID].reshape(-1).tolist() if P.LLM_END_ID in inputs else None for inputs in servicer.seen
        ]
        assert ends == [sent]
        workload = json.loads((tmp_path / "out" / "results.json").read_text())["workload"]
        assert workload["end_id"] == (sent[0] if sent else None) and said.split(": ", 1)[1] in workload["end_id_from"]
