"""The Triton client speaks the real gRPC protocol to a loopback server."""

from __future__ import annotations

import importlib.util
import json
import sys
from concurrent import futures
from pathlib import Path

import numpy as np
import pytest
from _triton_repo import model_configs, repository_settings, write_tokenizer

from dflash_trt.triton import client as triton_client
from dflash_trt.triton.repository import (
    CLIENT_FILE,
    write_repository,
)

mc = pytest.importorskip("tritonclient.grpc.model_config_pb2")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


TYPE_TO_WIRE = {
    "TYPE_STRING": "BYTES",
    "TYPE_INT32": "INT32",
    "TYPE_BOOL": "BOOL",
    "TYPE_FP32": "FP32",
    "TYPE_UINT64": "UINT64",
}


def _bytes_tensor(values: list[bytes]) -> bytes:
    return b"".join(len(v).to_bytes(4, "little") + v for v in values)


def _loopback_server(ensemble, pieces: list[str]):
    grpc = pytest.importorskip("grpc")
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    seen: list = []
    declared = {t.name: (mc.DataType.Name(t.data_type), list(t.dims), t.optional) for t in ensemble.input}

    def response(request, outputs, final=False):
        resp = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        for name, wire, shape, raw in outputs:
            resp.outputs.add(name=name, datatype=wire, shape=shape)
            resp.raw_output_contents.append(raw)
        if final:
            resp.parameters["triton_final_response"].bool_param = True
        return service_pb2.ModelStreamInferResponse(infer_response=resp)

    class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        def ServerLive(self, request, context):
            return service_pb2.ServerLiveResponse(live=True)

        def ModelStreamInfer(self, request_iterator, context):
            for request in request_iterator:
                seen.append(request)
                names = [t.name for t in request.inputs]
                for t in request.inputs:  # every input is declared by the ensemble, with its type and [1, dims]
                    dtype, dims, _ = declared[t.name]
                    assert t.datatype == TYPE_TO_WIRE[dtype] and len(t.shape) == 1 + len(dims)
                    assert all(d in (-1, n) for d, n in zip(dims, t.shape[1:], strict=True))
                assert {n for n, (_, _, opt) in declared.items() if not opt} <= set(names)
                for piece in pieces:
                    yield response(request, [("text_output", "BYTES", [1, 1], _bytes_tensor([piece.encode()]))])
                yield response(
                    request,
                    [
                        ("acceptance_rate", "FP32", [1, 1], np.array([0.6], np.float32).tobytes()),
                        ("total_accepted_draft_tokens", "INT32", [1, 1], np.array([27], np.int32).tobytes()),
                        ("total_draft_tokens", "INT32", [1, 1], np.array([45], np.int32).tobytes()),
                    ],
                )
                yield response(request, [], final=True)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, seen


def test_client_streams_text_and_acceptance(tmp_path: Path, tokenizer_dir: Path):
    repo = write_repository(repository_settings(tokenizer_dir), tmp_path / "repo")
    ensemble = model_configs(repo)["ensemble"]
    server, port, seen = _loopback_server(ensemble, ["Draft", "ing é", "!"])
    try:
        chunks: list[str] = []
        gen = triton_client.stream_generate(
            f"127.0.0.1:{port}",
            "the fox",
            16,
            temperature=0.7,
            stop_words=["dog"],
            on_text=chunks.append,
            timeout_s=30,
            seed=42,
        )
    finally:
        server.stop(0)
    assert gen.errors == [] and gen.text == "Drafting é!" and chunks == ["Draft", "ing é", "!"]
    assert (gen.acceptance_rate, gen.accepted_draft_tokens, gen.draft_tokens) == (pytest.approx(0.6), 27, 45)
    request = seen[0]
    assert request.model_name == "ensemble"
    sent = {t.name: raw for t, raw in zip(request.inputs, request.raw_input_contents, strict=True)}
    assert sent["text_input"] == _bytes_tensor([b"the fox"]) and sent["stop_words"] == _bytes_tensor([b"dog"])
    assert np.frombuffer(sent["max_tokens"], np.int32).tolist() == [16]
    assert np.frombuffer(sent["random_seed"], np.uint64).tolist() == [42]
    assert np.frombuffer(sent["temperature"], np.float32).tolist() == [pytest.approx(0.7)]
    assert sent["stream"] == b"\x01" and sent["return_perf_metrics"] == b"\x01"
    # 45 drafted tokens over steps of 15 drafts = 3 steps; (27 accepted + 3 bonus) / 3 = 10 tokens per step.
    assert "mean acceptance length 10.00" in triton_client.summary(gen, 15)
    assert triton_client.acceptance_length_from_counts(27, 45, 15) == pytest.approx(10.0)


def test_client_main_reads_draft_len_from_the_repository(tmp_path: Path, tokenizer_dir: Path, capsys, monkeypatch):
    repo = write_repository(repository_settings(tokenizer_dir, max_draft_len=9), tmp_path / "repo")
    server, port, _ = _loopback_server(model_configs(repo)["ensemble"], ["ok"])
    spec = importlib.util.spec_from_file_location("repo_client", repo / CLIENT_FILE)
    copied = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "repo_client", copied)
    try:
        spec.loader.exec_module(copied)
        rc = copied.main(["--url", f"127.0.0.1:{port}", "--prompt", "hi"])
    finally:
        server.stop(0)
    captured = capsys.readouterr()
    assert rc == 0 and captured.out == "ok\n"
    # 45 drafted / 9 per step = 5 steps: (27 + 5) / 5 = 6.4
    assert "mean acceptance length 6.40" in captured.err


def test_client_derives_no_acceptance_length_when_the_engine_drafts_by_load(
    tmp_path: Path, tokenizer_dir: Path, capsys, monkeypatch
):
    """Under a draft-length schedule the steps draft different amounts, so the backend's totals (45 drafted, 27
    accepted) say nothing about the steps: the copied client reports the totals and no mean length."""
    settings = repository_settings(tokenizer_dir, max_draft_len=9, draft_len_schedule="4:3")
    repo = write_repository(settings, tmp_path / "repo")
    assert json.loads((repo / "dflash_triton.json").read_text())["draft_len_schedule"] == "4:3"
    server, port, _ = _loopback_server(model_configs(repo)["ensemble"], ["ok"])
    spec = importlib.util.spec_from_file_location("repo_client_by_load", repo / CLIENT_FILE)
    copied = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "repo_client_by_load", copied)
    try:
        spec.loader.exec_module(copied)
        rc = copied.main(["--url", f"127.0.0.1:{port}", "--prompt", "hi"])
    finally:
        server.stop(0)
    captured = capsys.readouterr()
    assert rc == 0 and "accepted 27/45 draft tokens" in captured.err and "mean acceptance length" not in captured.err
