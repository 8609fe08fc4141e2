"""What the Triton repository tests share: a real tokenizer, repository settings, config parsing, processing
requests and a stand-in of Triton's Python-backend utilities."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dflash_trt.triton import processing as P
from dflash_trt.triton.repository import RepositorySettings

mc = pytest.importorskip("tritonclient.grpc.model_config_pb2")
EOS, PAD, IM_END = "<|end|>", "<|pad|>", "<|im_end|>"


def write_tokenizer(d: Path) -> Path:
    """A real byte-level BPE tokenizer, trained here in milliseconds, saved the way HF checkpoints ship one."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS, PAD, IM_END], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog", "speculative decoding drafts a block"] * 20, trainer
    )
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": PAD})
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return d


def make_preprocessor(tokenizer_dir: Path) -> P.Preprocessor:
    return P.Preprocessor.from_dir(
        str(tokenizer_dir), add_special_tokens=False, max_input_len=32, max_seq_len=64, max_temperature=0.0
    )


def repository_settings(tokenizer_dir: Path, **changes) -> RepositorySettings:
    base = dict(
        engine_dir="/engines/qwen3-8b",
        tokenizer_dir=str(tokenizer_dir),
        plugin_library="/opt/lib/x.so",
        max_batch_size=64,
        max_input_len=4096,
        max_draft_len=15,
        world_size=1,
        max_temperature=0.0,
        max_seq_len=8192 - 30,
    )
    return RepositorySettings(**{**base, **changes})


def parse_config(path: Path):
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def model_configs(repo: Path) -> dict:
    return {d.name: parse_config(d / "config.pbtxt") for d in sorted(repo.iterdir()) if (d / "config.pbtxt").is_file()}


def write_engine_dir(path: Path, **manifest) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(
        json.dumps({"build_config": {"max_batch_size": 128, "max_input_len": 2048, "max_seq_len": 4096 + 18}})
    )
    base = {
        "max_batch_size": 128,
        "max_draft_len": 9,
        "tp_size": 2,
        "plugin_library": "/p/lib.so",
        "max_temperature": 0.0,
    }
    (path / "dflash_trt.json").write_text(json.dumps({**base, **manifest}))
    return path


def processing_request(texts: list[str], **extra) -> dict:
    inputs = {
        P.QUERY: np.array([[t.encode()] for t in texts], dtype=object),
        P.REQUEST_OUTPUT_LEN: np.array([[8]] * len(texts), dtype=np.int32),
    }
    inputs.update(extra)
    return inputs


class StandInPbUtils:
    """The slice of Triton's `triton_python_backend_utils` API the two model.py files call, recording responses.
    Triton itself is not involved: this checks that model.py reads the parameters and tensors its config.pbtxt
    declares and routes errors into the response."""

    class Tensor:
        def __init__(self, name, array):
            self._name, self._array = name, array

        def name(self):
            return self._name

        def as_numpy(self):
            return self._array

    class TritonError:
        def __init__(self, message):
            self.message = message

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.outputs = {t.name(): t.as_numpy() for t in output_tensors}
            self.error = error

        def has_error(self):
            return self.error is not None

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    engine_responses: list[dict] = []  # what the stand-in tensorrt_llm streams back to a BLS request
    llm_requests: list = []

    class InferenceRequest:
        def __init__(self, model_name, inputs, requested_output_names):
            self.model_name, self.requested = model_name, requested_output_names
            self.inputs = {t.name(): t.as_numpy() for t in inputs}
            StandInPbUtils.llm_requests.append(self)

        async def async_exec(self, decoupled):
            assert decoupled  # the python backend answers with a blocking iterator over the responses
            return iter(
                StandInPbUtils.InferenceResponse([StandInPbUtils.Tensor(k, v) for k, v in outputs.items()])
                for outputs in StandInPbUtils.engine_responses
            )

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return StandInPbUtils.Tensor(name, request[name]) if name in request else None

    @staticmethod
    def get_output_tensor_by_name(response, name):
        return StandInPbUtils.Tensor(name, response.outputs[name]) if name in response.outputs else None


class ResponseSender:
    def __init__(self):
        self.sent: list = []

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))


class BlsRequest(dict):
    def __init__(self, tensors: dict):
        super().__init__(tensors)
        self.sender = ResponseSender()

    def get_response_sender(self):
        return self.sender


def load_python_model(repo: Path, name: str, monkeypatch):
    from google.protobuf import json_format

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", StandInPbUtils)
    monkeypatch.syspath_prepend(str(repo / name / "1"))
    monkeypatch.delitem(sys.modules, "dflash_processing", raising=False)
    spec = importlib.util.spec_from_file_location(f"{name}_model", repo / name / "1/model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = json_format.MessageToJson(parse_config(repo / name / "config.pbtxt"), preserving_proto_field_name=True)
    model = module.TritonPythonModel()
    model.initialize({"model_config": config})
    return model
