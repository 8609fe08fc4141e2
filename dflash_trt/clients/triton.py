"""Triton executor: a deployed model repository over gRPC decoupled streaming (`tritonclient.grpc.aio`).

Requests go to the repository's `tensorrt_llm` model with token ids (`input_ids`, `request_output_len`,
`streaming`), so users measure the server they run without tokenizer work in the loop; in streaming mode the
`tensorrtllm` backend answers once per decoding iteration with that iteration's new `output_ids`. Every request
sends its `temperature` (the backend samples at 1.0 when none is sent, so greedy must be asked for) and its
`random_seed` when it has one, and every response is checked (integer ids within the vocabulary, no more tokens
than asked) before it is recorded: a server answering something else fails the request with one line.

`--triton_model ensemble` or `tensorrt_llm_bls` measure the text path instead (tokenizer work included): the
prompt goes as `text_input` (the prompt ids decoded), and each response's `text_output` is counted in tokens by
re-tokenizing the text received so far, as external load generators do; those counts are exact only where the
tokenizer's encoding of the text round-trips. Each request
has its own bidirectional stream, held open until its final response (Triton marks it with the
`triton_final_response` parameter), so an error names the request it belongs to. Tensor names are the
repository's own (`dflash_trt.triton.processing`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from dflash_trt.clients.streams import StreamPerRequest
from dflash_trt.decoding_modes import DFLASH, DecodingMode
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import Deliver, Request, Response, failed
from dflash_trt.triton import processing as P
from dflash_trt.triton.repository import GPU_DEVICE_IDS, TENSORRT_LLM, replica_gpus

DEFAULT_MODEL = "tensorrt_llm"
TEXT_MODELS = ("ensemble", "tensorrt_llm_bls")  # the repository's text-in, text-out models
FINAL = "triton_final_response"


INT32_MAX = 2**31 - 1  # the tensorrt_llm model's input_ids and request_output_len are INT32


class BadResponse(Exception):
    """A response that is not what the tensorrtllm backend sends for the request."""


class BadRequest(Exception):
    """A request the model's inputs cannot carry; refused before it leaves."""


def check_request(request: Request, vocab_size: int | None) -> None:
    """Token ids within the vocabulary (INT32 when it is not known) and a budget within INT32: what would otherwise
    fail converting to the model's tensors, or come back as the model's own error."""
    ids, bound = request.input_ids, INT32_MAX + 1 if vocab_size is None else vocab_size
    if not ids:
        raise BadRequest("the prompt is empty")
    if min(ids) < 0 or max(ids) >= bound:
        raise BadRequest(f"prompt token ids must lie in 0..{bound - 1}, got {min(ids)}..{max(ids)}")
    if not 1 <= request.max_new_tokens <= INT32_MAX:
        raise BadRequest(f"max_new_tokens must lie in 1..{INT32_MAX}, got {request.max_new_tokens}")


def response_tokens(output: np.ndarray | None, vocab_size: int | None) -> list[int]:
    """The token ids of one response's `output_ids`, refusing float or out-of-range ids."""
    if output is None:
        return []
    if not np.issubdtype(output.dtype, np.integer):
        raise BadResponse(f"output_ids must be integers, the server sent {output.dtype}")
    tokens = output.reshape(-1).tolist()
    if tokens and (min(tokens) < 0 or (vocab_size is not None and max(tokens) >= vocab_size)):
        bound = f"0..{vocab_size - 1}" if vocab_size is not None else "non-negative"
        raise BadResponse(f"output_ids outside the vocabulary ({bound}): {min(tokens)}..{max(tokens)}")
    return tokens


class TextCounter:
    """Token ids of a streamed text: the text received so far, re-tokenized, less the ids already counted."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self.counted = 0

    def push(self, output: np.ndarray | None) -> list[int]:
        if output is None:
            return []
        if output.dtype != object:
            raise BadResponse(f"text_output must be a BYTES tensor, the server sent {output.dtype}")
        self.text += "".join(p.decode("utf-8") if isinstance(p, bytes) else str(p) for p in output.reshape(-1))
        ids = self.tokenizer.encode(self.text, add_special_tokens=False)
        new, self.counted = ids[self.counted :], max(self.counted, len(ids))
        return new


def _tensor(name: str, array: np.ndarray, dtype: str):
    import tritonclient.grpc.aio as grpcclient

    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def text_request_inputs(request: Request, prompt: str, end_id: int | None) -> list:
    """The ensemble's and BLS's request interface: text in, streamed, sampling stated explicitly."""
    inputs = [
        _tensor(P.TEXT_INPUT, np.array([[prompt.encode("utf-8")]], dtype=object), "BYTES"),
        _tensor(P.MAX_TOKENS, np.array([[request.max_new_tokens]], dtype=np.int32), "INT32"),
        _tensor(P.STREAM, np.array([[True]], dtype=bool), "BOOL"),
        _tensor(P.REQUEST_TEMPERATURE, np.array([[request.sampling.temperature]], dtype=np.float32), "FP32"),
    ]
    if request.sampling.seed is not None:
        inputs.append(_tensor(P.REQUEST_RANDOM_SEED, np.array([[request.sampling.seed]], dtype=np.uint64), "UINT64"))
    if end_id is not None:
        inputs.append(_tensor(P.REQUEST_END_ID, np.array([[end_id]], dtype=np.int32), "INT32"))
    return inputs


def request_inputs(request: Request, end_id: int | None) -> list:
    ids = np.array([request.input_ids], dtype=np.int32)
    inputs = [
        _tensor(P.LLM_INPUT_IDS, ids, "INT32"),
        _tensor(P.LLM_INPUT_LENGTHS, np.array([[ids.shape[1]]], dtype=np.int32), "INT32"),
        _tensor(P.LLM_REQUEST_OUTPUT_LEN, np.array([[request.max_new_tokens]], dtype=np.int32), "INT32"),
        _tensor(P.LLM_STREAMING, np.array([[True]], dtype=bool), "BOOL"),
        _tensor(P.LLM_TEMPERATURE, np.array([[request.sampling.temperature]], dtype=np.float32), "FP32"),
    ]
    if request.sampling.seed is not None:
        inputs.append(_tensor(P.LLM_RANDOM_SEED, np.array([[request.sampling.seed]], dtype=np.uint64), "UINT64"))
    if end_id is not None:
        inputs.append(_tensor(P.LLM_END_ID, np.array([[end_id]], dtype=np.int32), "INT32"))
        inputs.append(_tensor(P.LLM_PAD_ID, np.array([[max(end_id, 0)]], dtype=np.int32), "INT32"))
    return inputs


class TritonExecutor(StreamPerRequest):
    def __init__(
        self,
        url: str,
        *,
        model: str = DEFAULT_MODEL,
        mode: DecodingMode = DFLASH,
        gpus: int | None = None,
        end_id: int | None = None,
        vocab_size: int | None = None,
        tokenizer=None,
        connect_timeout_s: float = 10.0,
    ):
        if model in TEXT_MODELS and tokenizer is None:
            raise DFlashTrtError(f"--triton_model {model} takes text: give --tokenizer_dir (the served model's)")
        self.url = url
        self.model = model
        self.mode = mode
        self.gpus_given = gpus  # None: the server's gpu_device_ids say, else 1
        self.gpus = gpus or 1
        self.end_id = end_id
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer if model in TEXT_MODELS else None
        self.connect_timeout_s = connect_timeout_s
        self.client: Any = None
        super().__init__()
        # Triton request ids unique across bench runs: the ensemble keys split characters by them.
        self.id_prefix = uuid.uuid4().hex

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
        served = await self._served_gpus()
        if served is not None:
            if self.gpus_given is not None and self.gpus_given != served:
                await self.client.close()
                raise DFlashTrtError(
                    f"--gpus {self.gpus_given} disagrees with the server at {self.url}, whose {TENSORRT_LLM} "
                    f"{GPU_DEVICE_IDS} place its replicas on {served} GPUs; drop --gpus or give {served}"
                )
            self.gpus = served

    async def _served_gpus(self) -> int | None:
        """The GPUs a replicated deployment's `tensorrt_llm` spreads its replicas over (`--replicas`), so tok/s is
        reported per node and per GPU; None where the server names none (one replica, or not our repository)."""
        from tritonclient.utils import InferenceServerException

        try:
            config = await self.client.get_model_config(TENSORRT_LLM, as_json=True)
        except InferenceServerException:
            return None
        device_ids = config.get("config", {}).get("parameters", {}).get(GPU_DEVICE_IDS, {}).get("string_value")
        return replica_gpus(device_ids)[1] if device_ids else None

    def _inputs(self, request: Request) -> tuple[list, TextCounter | None]:
        if self.tokenizer is None:
            return request_inputs(request, self.end_id), None
        prompt = self.tokenizer.decode(request.input_ids, skip_special_tokens=True)
        return text_request_inputs(request, prompt, self.end_id), TextCounter(self.tokenizer)

    async def _one_request(self, request_id: int, inputs: list, done: asyncio.Event) -> AsyncIterator[dict]:
        yield {"model_name": self.model, "inputs": inputs, "request_id": f"{self.id_prefix}-{request_id}"}
        await done.wait()  # keep our side of the stream open until the final response

    async def _stream(self, request_id: int, request: Request) -> None:
        import grpc
        from tritonclient.utils import InferenceServerException

        done = asyncio.Event()
        received = 0
        try:
            check_request(request, self.vocab_size)
            inputs, counter = self._inputs(request)
            async for result, error in self.client.stream_infer(self._one_request(request_id, inputs, done)):
                if error is not None:
                    self.deliver([failed(request_id, str(error))])
                    return
                if counter is not None:
                    tokens = counter.push(result.as_numpy(P.TEXT_OUTPUT))
                else:
                    tokens = response_tokens(result.as_numpy(P.LLM_OUTPUT_IDS), self.vocab_size)
                received += len(tokens)
                if counter is None and received > request.max_new_tokens:  # re-tokenized text may count more
                    raise BadResponse(f"the server sent {received} tokens, {request.max_new_tokens} were asked for")
                flag = result.get_response().parameters.get(FINAL)
                final = bool(flag is not None and flag.bool_param)
                self.deliver([Response(request_id=request_id, tokens=tokens, final=final)])
                if final:
                    return
            self.deliver([failed(request_id, "the stream ended before a final response")])
        except (InferenceServerException, grpc.RpcError, BadResponse, BadRequest) as exc:
            self.deliver([failed(request_id, str(exc))])
        except Exception as exc:  # a malformed response must fail its request, never the task silently
            self.deliver([failed(request_id, f"malformed response: {exc}")])
        finally:
            done.set()

    async def stop(self) -> None:
        await self._cancel_all()
        if self.client is not None:
            await self.client.close()
            self.client = None
