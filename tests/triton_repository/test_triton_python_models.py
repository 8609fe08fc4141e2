"""The repository's Python models run their configs under a stand-in of Triton's pb_utils."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from _triton_repo import (
    BlsRequest,
    StandInPbUtils,
    load_python_model,
    make_preprocessor,
    model_configs,
    processing_request,
    repository_settings,
    write_tokenizer,
)

from dflash_trt.triton import processing as P
from dflash_trt.triton.repository import write_repository

mc = pytest.importorskip("tritonclient.grpc.model_config_pb2")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def pre(tokenizer_dir: Path) -> P.Preprocessor:
    return make_preprocessor(tokenizer_dir)


def test_python_models_run_their_configs(tmp_path: Path, tokenizer_dir: Path, monkeypatch):
    repo = write_repository(repository_settings(tokenizer_dir, max_input_len=6), tmp_path / "repo")
    pre = load_python_model(repo, "preprocessing", monkeypatch)
    ok, hot, long = (
        processing_request(["the fox"]),
        processing_request(["the fox"], **{P.TEMPERATURE: np.array([[1.0]], np.float32)}),
        processing_request(["the quick brown fox jumps over the lazy dog"]),
    )
    responses = pre.execute([ok, hot, long])
    declared = {t.name for t in model_configs(repo)["preprocessing"].output}
    assert responses[0].error is None and set(responses[0].outputs) == declared
    assert "temperature 1 refused" in responses[1].error.message
    assert "accepts at most 6" in responses[2].error.message
    post = load_python_model(repo, "postprocessing", monkeypatch)
    ids = responses[0].outputs[P.INPUT_ID]
    chunk = {P.TOKENS_BATCH: ids[:, None, :], P.SEQUENCE_LENGTH: np.array([[ids.shape[1]]])}
    [done] = post.execute([_IdentifiedRequest(chunk, "")])
    assert done.outputs[P.OUTPUT][0, 0] == b"the fox"


class _IdentifiedRequest(dict):
    """A request's tensors and the client's request id, which the ensemble copies onto each composing request."""

    def __init__(self, tensors: dict, request_id: str):
        super().__init__(tensors)
        self.id = request_id

    def request_id(self) -> str:
        return self.id


def _post_chunk(post, ids: list[int], request_id: str) -> str:
    chunk = {P.TOKENS_BATCH: np.array([[ids]], np.int32), P.SEQUENCE_LENGTH: np.array([[len(ids)]], np.int32)}
    [response] = post.execute([_IdentifiedRequest(chunk, request_id)])
    return response.outputs[P.OUTPUT][0, 0].decode("utf-8")


def test_postprocessing_holds_a_split_character_back_per_request_id(
    tmp_path: Path, tokenizer_dir: Path, pre: P.Preprocessor, monkeypatch
):
    repo = write_repository(repository_settings(tokenizer_dir), tmp_path / "repo")
    post = load_python_model(repo, "postprocessing", monkeypatch)
    texts = {"a": "drafts é 日本 block 🚀 done", "b": "naïve 数据 🙂 café"}
    ids = {rid: pre.tokenizer.encode(text, add_special_tokens=False) for rid, text in texts.items()}
    pieces: dict[str, list[str]] = {"a": [], "b": []}
    for step in range(max(len(v) for v in ids.values())):  # two requests' one-token chunks, interleaved
        for rid, row in ids.items():
            if step < len(row):
                pieces[rid].append(_post_chunk(post, row[step : step + 1], rid))
    for rid, text in texts.items():
        assert "".join(pieces[rid]) == text and not any("\ufffd" in p for p in pieces[rid])
        assert "" in pieces[rid]  # a lead byte was held back until its continuation arrived
    anonymous = [_post_chunk(post, ids["a"][i : i + 1], "") for i in range(len(ids["a"]))]
    assert any("\ufffd" in p for p in anonymous)  # without a request id each chunk is decoded on its own


def test_stream_detokenizer_never_splits_a_character(pre: P.Preprocessor):
    tok = pre.tokenizer
    text = "drafts é 日本 block 🚀 done"
    ids = tok.encode(text, add_special_tokens=False)
    detok = P.StreamDetokenizer(tok, skip_special_tokens=True)
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # byte-level tokens of multi-byte characters were held back
    naive = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in naive)  # what decoding each chunk alone would have printed


def _dtype_name(array: np.ndarray) -> str:
    return {
        np.dtype(np.int32): "TYPE_INT32",
        np.dtype(np.float32): "TYPE_FP32",
        np.dtype(bool): "TYPE_BOOL",
        np.dtype(object): "TYPE_STRING",
    }[array.dtype]


def test_bls_model_streams_whole_characters_to_the_engine_interface(tmp_path: Path, tokenizer_dir: Path, monkeypatch):
    repo = write_repository(repository_settings(tokenizer_dir), tmp_path / "repo")
    configs = model_configs(repo)
    bls = load_python_model(repo, "tensorrt_llm_bls", monkeypatch)
    tok = bls.preprocessor.tokenizer
    answer = "a block é 日本"
    ids = tok.encode(answer, add_special_tokens=False)
    chunks = [ids[i : i + 3] for i in range(0, len(ids), 3)]  # blocks of accepted tokens, split mid-character
    StandInPbUtils.engine_responses = [
        {"output_ids": np.array([[c]], np.int32), "sequence_length": np.array([[len(c)]], np.int32)} for c in chunks
    ] + [
        {
            "acceptance_rate": np.array([[0.5]], np.float32),
            "total_accepted_draft_tokens": np.array([[3]], np.int32),
            "total_draft_tokens": np.array([[6]], np.int32),
        }
    ]
    StandInPbUtils.llm_requests = []
    request = BlsRequest(
        {
            "text_input": np.array([[b"the fox"]], object),
            "max_tokens": np.array([[16]], np.int32),
            "stream": np.array([[True]]),
            "return_perf_metrics": np.array([[True]]),
        }
    )
    assert asyncio.run(bls.execute([request])) is None
    [llm] = StandInPbUtils.llm_requests
    trt = {t.name: t for t in configs["tensorrt_llm"].input}
    assert llm.model_name == "tensorrt_llm" and set(llm.inputs) <= set(trt)
    assert {n for n, t in trt.items() if not t.optional} <= set(llm.inputs)
    for name, array in llm.inputs.items():  # [batch, *dims] with the declared type
        assert _dtype_name(array) == mc.DataType.Name(trt[name].data_type), name
        assert array.ndim == 1 + len(trt[name].dims), name
    assert set(llm.requested) <= {o.name for o in configs["tensorrt_llm"].output}
    responses = [r for r, _ in request.sender.sent if r is not None]
    text = "".join(r.outputs["text_output"][0, 0].decode() for r in responses if "text_output" in r.outputs)
    assert text == answer and all(r.error is None for r in responses)
    assert responses[-2].outputs["total_draft_tokens"].tolist() == [[6]]
    last, flags = request.sender.sent[-1]  # the final flag closes the stream, on an empty response
    assert (last.outputs, flags) == ({}, 1) and all(f == 0 for _, f in request.sender.sent[:-1])

    hot = BlsRequest(
        {
            "text_input": np.array([[b"the fox"]], object),
            "max_tokens": np.array([[4]], np.int32),
            "temperature": np.array([[0.9]], np.float32),
        }
    )
    asyncio.run(bls.execute([hot]))
    [(error_response, flags)] = hot.sender.sent
    assert "temperature 0.9 refused" in error_response.error.message and flags == 1
