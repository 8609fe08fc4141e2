"""Sampling parameters through Triton: temperature and seed reach the engine, unsupported ones are refused."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from _triton_repo import (
    BlsRequest,
    StandInPbUtils,
    load_python_model,
    processing_request,
    repository_settings,
    write_engine_dir,
    write_tokenizer,
)

from dflash_trt.cli import main as cli_main
from dflash_trt.triton import processing as P
from dflash_trt.triton.repository import settings_from_engine, write_repository


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def sampler(tokenizer_dir: Path) -> P.Preprocessor:
    return P.Preprocessor.from_dir(
        str(tokenizer_dir), add_special_tokens=False, max_input_len=32, max_seq_len=64, max_temperature=float("inf")
    )


def test_temperature_reaches_the_engine_and_defaults_to_greedy(sampler: P.Preprocessor):
    """Without a temperature the runtime would sample at its default of 1.0, so preprocessing always sends one."""
    out = sampler.preprocess(processing_request(["the dog", "the fox"]))
    assert out[P.OUT_TEMPERATURE].tolist() == [[0.0], [0.0]] and out[P.OUT_TEMPERATURE].dtype == np.float32
    hot = sampler.preprocess(
        processing_request(["the dog", "the fox"], **{P.TEMPERATURE: np.array([[0.7], [0.0]], np.float32)})
    )
    assert hot[P.OUT_TEMPERATURE].tolist() == [[pytest.approx(0.7)], [0.0]]


@pytest.mark.parametrize(
    "name, value, dtype",
    [
        ("top_k", 40, np.int32),
        ("top_p", 0.9, np.float32),
        ("repetition_penalty", 1.2, np.float32),
        ("presence_penalty", 0.5, np.float32),
        ("frequency_penalty", 0.5, np.float32),
        ("length_penalty", 2.0, np.float32),
        ("min_tokens", 5, np.int32),
        ("beam_width", 4, np.int32),
        ("num_return_sequences", 2, np.int32),
    ],
)
def test_unsupported_sampling_parameters_are_refused(sampler: P.Preprocessor, name: str, value, dtype):
    neutral = {
        "top_k": 0,
        "top_p": 1.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "length_penalty": 1.0,
        "min_tokens": 1,
        "beam_width": 1,
        "num_return_sequences": 1,
    }[name]
    sampler.preprocess(processing_request(["a", "b"], **{name: np.array([[neutral], [neutral]], dtype)}))
    with pytest.raises(ValueError, match=f"^{name} .* refused: a DFlash engine samples with temperature and seed"):
        sampler.preprocess(processing_request(["a", "b"], **{name: np.array([[neutral], [value]], dtype)}))


def test_every_sampling_input_has_a_rule():
    from dflash_trt.sampling_rules import NEUTRAL

    assert set(P.SAMPLING_INPUTS) <= set(NEUTRAL)


def test_top_k_one_is_greedy_only(sampler: P.Preprocessor):
    sampler.preprocess(processing_request(["a"], top_k=np.array([[1]], np.int32)))
    with pytest.raises(ValueError, match="top_k 1 refused"):
        sampler.preprocess(
            processing_request(["a"], top_k=np.array([[1]], np.int32), **{P.TEMPERATURE: np.array([[0.5]], np.float32)})
        )
    with pytest.raises(ValueError, match="temperature -1.0 refused: it must be a finite number >= 0"):
        sampler.preprocess(processing_request(["a"], **{P.TEMPERATURE: np.array([[-1.0]], np.float32)}))


def test_settings_from_an_exact_sampling_engine_take_any_temperature(tmp_path: Path, tokenizer_dir: Path):
    engine = write_engine_dir(tmp_path / "eng", sampling="exact_match")
    assert settings_from_engine(engine, tokenizer_dir).max_temperature == float("inf")


def test_bls_sends_temperature_and_seed_and_refuses_top_p(tmp_path: Path, tokenizer_dir: Path, monkeypatch):
    """Inside Triton dflash_trt may be absent: the models use the rules file copied next to them."""
    monkeypatch.setitem(sys.modules, "dflash_trt.sampling_rules", None)
    repo = write_repository(repository_settings(tokenizer_dir, max_temperature=float("inf")), tmp_path / "repo")
    bls = load_python_model(repo, "tensorrt_llm_bls", monkeypatch)
    assert sys.modules["dflash_processing"].sampling_refusal.__module__ == "dflash_sampling_rules"
    assert sys.modules["dflash_processing"].encode_chat.__module__ == "dflash_chat"  # chats work there too

    def refuse(name: str):
        raise ValueError(f"not strict JSON: {name}")

    # Strict JSON: "any temperature" is null, not Infinity.
    assert json.loads((repo / "dflash_triton.json").read_text(), parse_constant=refuse)["max_temperature"] is None
    StandInPbUtils.engine_responses, StandInPbUtils.llm_requests = [], []
    request = BlsRequest(
        {
            "text_input": np.array([[b"the fox"]], object),
            "max_tokens": np.array([[4]], np.int32),
            "temperature": np.array([[0.8]], np.float32),
            "random_seed": np.array([[1234]], np.uint64),
        }
    )
    asyncio.run(bls.execute([request]))
    [llm] = StandInPbUtils.llm_requests
    assert llm.inputs["temperature"].tolist() == [[pytest.approx(0.8)]]
    assert llm.inputs["random_seed"].tolist() == [[1234]]
    refused = BlsRequest(
        {
            "text_input": np.array([[b"the fox"]], object),
            "max_tokens": np.array([[4]], np.int32),
            "top_p": np.array([[0.5]], np.float32),
        }
    )
    asyncio.run(bls.execute([refused]))
    [(error, flags)] = refused.sender.sent
    assert error.error.message.startswith("top_p 0.5 refused") and flags == 1
    pre = load_python_model(repo, "preprocessing", monkeypatch)
    [response] = pre.execute([processing_request(["the fox"], top_k=np.array([[3]], np.int32))])
    assert response.error.message.startswith("top_k 3 refused")


def test_triton_json_output_is_strict_json(tmp_path: Path, tokenizer_dir: Path, capsys):
    """An exact-sampling engine takes any temperature: `--json` says so with null, never Infinity."""
    engine = write_engine_dir(tmp_path / "eng", sampling="exact_match")
    argv = ["triton", "--engine_dir", str(engine), "--tokenizer_dir", str(tokenizer_dir),
            "--output_dir", str(tmp_path / "repo"), "--json"]  # fmt: skip
    assert cli_main(argv) == 0

    def refuse(name: str):
        raise ValueError(f"not strict JSON: {name}")

    printed = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert printed["max_temperature"] is None and printed["chat_template_kwargs"] == "{}"
