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


def _loopback_server(ensemble, pieces: list[str], accepted: int = 27, drafted: int = 45):
    """A gRPC server answering each request as the ensemble streams: one response per engine iteration (a text
    piece), the last with the backend's totals, then the empty final response the client asks for."""
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
                totals = [
                    ("acceptance_rate", "FP32", [1, 1], np.array([accepted / drafted], np.float32).tobytes()),
                    ("total_accepted_draft_tokens", "INT32", [1, 1], np.array([accepted], np.int32).tobytes()),
                    ("total_draft_tokens", "INT32", [1, 1], np.array([drafted], np.int32).tobytes()),
                ]
                for i, piece in enumerate(pieces):
                    text = ("text_output", "BYTES", [1, 1], _bytes_tensor([piece.encode()]))
                    yield response(request, [text, *(totals if i == len(pieces) - 1 else [])])
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
    # 3 responses: the context step's first token, then 2 verify steps; (27 accepted + 2 bonus) / 2 = 14.5.
    assert gen.chunks == 3
    assert "mean acceptance length 14.50 over 2 verify steps" in triton_client.summary(gen)
    assert triton_client.acceptance_length(27, 3) == pytest.approx(14.5)


def _copied_client_stderr(repo: Path, port: int, capsys, monkeypatch, name: str) -> str:
    """Run the client copied into `repo` against the loopback server; what it printed on stderr."""
    spec = importlib.util.spec_from_file_location(name, repo / CLIENT_FILE)
    copied = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, copied)
    spec.loader.exec_module(copied)
    assert copied.main(["--url", f"127.0.0.1:{port}", "--prompt", "hi"]) == 0
    return capsys.readouterr().err


def test_the_copied_client_counts_the_verify_steps_of_a_tree_engine(
    tmp_path: Path, tokenizer_dir: Path, capsys, monkeypatch
):
    """A 24-node tree engine: 3 verify steps verified 24 + 24 + 22 nodes (a tree can come out smaller) = 70, of which
    12 were accepted: (12 + 3) / 3 = 5.00 tokens per step. Dividing the drafted total by the 24 nodes would make
    70 / 24 = 2.92 steps and 5.11 tokens per step."""
    settings = repository_settings(tokenizer_dir, max_draft_len=24, eagle_depth=7)
    repo = write_repository(settings, tmp_path / "repo")
    server, port, _ = _loopback_server(model_configs(repo)["ensemble"], ["o", "k", "a", "y"], accepted=12, drafted=70)
    try:
        err = _copied_client_stderr(repo, port, capsys, monkeypatch, "repo_client_tree")
    finally:
        server.stop(0)
    assert "accepted 12/70 draft tokens" in err and "mean acceptance length 5.00 over 3 verify steps" in err
    assert "acceptance rate 0.171 per draft verified" in err


def test_the_copied_client_counts_the_verify_steps_of_an_engine_drafting_by_load(
    tmp_path: Path, tokenizer_dir: Path, capsys, monkeypatch
):
    """Under a draft-length schedule the steps draft different amounts (here 9 then 3: 12 drafted, 7 accepted):
    counted steps still give (7 + 2) / 2 = 4.50 tokens per step."""
    settings = repository_settings(tokenizer_dir, max_draft_len=9, draft_len_schedule="4:3")
    repo = write_repository(settings, tmp_path / "repo")
    assert json.loads((repo / "dflash_triton.json").read_text())["draft_len_schedule"] == "4:3"
    server, port, _ = _loopback_server(model_configs(repo)["ensemble"], ["o", "k", "!"], accepted=7, drafted=12)
    try:
        err = _copied_client_stderr(repo, port, capsys, monkeypatch, "repo_client_by_load")
    finally:
        server.stop(0)
    assert "accepted 7/12 draft tokens" in err and "mean acceptance length 4.50 over 2 verify steps" in err
