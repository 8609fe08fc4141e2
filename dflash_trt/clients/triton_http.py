"""Triton HTTP executor: a text model of the repository (`ensemble`, `tensorrt_llm_bls`) over HTTP `generate_stream`.

The protocol external load generators (aiperf's template endpoint, curl) use against Triton: one POST per request
to `/v2/models/<model>/generate_stream` with a JSON body of the model's inputs, answered with server-sent events,
one `data: {...}` per response, and the end of the body after the last one (the HTTP front has no final flag).
Text is counted in tokens by re-tokenizing the text received so far, as with the gRPC text path
(`triton.py`). Each request carries a unique `id`, which the ensemble needs to keep a character whole.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from contextlib import aclosing
from typing import Any

import numpy as np

from dflash_trt.clients.openai_http import DATA, HttpClient, HttpError
from dflash_trt.clients.streams import StreamPerRequest
from dflash_trt.clients.triton import TEXT_MODELS, BadResponse, TextCounter
from dflash_trt.decoding_modes import DFLASH, DecodingMode
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import Deliver, Request, Response, failed
from dflash_trt.triton import processing as P


def generate_body(request: Request, prompt: str, request_id: str, end_id: int | None) -> dict[str, Any]:
    """The text models' request interface as a generate_stream body; sampling stated explicitly."""
    body: dict[str, Any] = {
        "id": request_id,
        P.TEXT_INPUT: prompt,
        P.MAX_TOKENS: request.max_new_tokens,
        P.STREAM: True,
        P.REQUEST_TEMPERATURE: request.sampling.temperature,
    }
    if request.sampling.seed is not None:
        body[P.REQUEST_RANDOM_SEED] = request.sampling.seed
    if end_id is not None:
        body[P.REQUEST_END_ID] = end_id
    return body


class TritonHttpExecutor(StreamPerRequest):
    def __init__(
        self,
        url: str,
        *,
        model: str,
        tokenizer,
        mode: DecodingMode = DFLASH,
        gpus: int = 1,
        end_id: int | None = None,
        connect_timeout_s: float = 10.0,
    ):
        if model not in TEXT_MODELS:
            raise DFlashTrtError(
                f"--triton_protocol http takes the text models ({', '.join(TEXT_MODELS)}); --triton_model {model} "
                "takes token ids over grpc"
            )
        if tokenizer is None:
            raise DFlashTrtError(f"--triton_model {model} takes text: give --tokenizer_dir (the served model's)")
        self.url = url.rstrip("/")
        self.model = model
        self.tokenizer = tokenizer
        self.mode = mode
        self.gpus = gpus
        self.end_id = end_id
        self.connect_timeout_s = connect_timeout_s
        self.client = HttpClient(self.url)
        super().__init__()
        self.id_prefix = uuid.uuid4().hex

    async def start(self, deliver: Deliver) -> None:
        self.deliver = deliver

        async def ready() -> None:
            async with aclosing(self.client.request("GET", f"/v2/models/{self.model}/ready")) as pieces:
                async for _ in pieces:
                    pass

        try:
            await asyncio.wait_for(ready(), self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError, HttpError) as exc:
            reason = str(exc) or type(exc).__name__
            raise DFlashTrtError(
                f"no ready model {self.model!r} at the Triton HTTP server {self.url}: {reason}"
            ) from None

    async def _stream(self, request_id: int, request: Request) -> None:
        prompt = self.tokenizer.decode(request.input_ids, skip_special_tokens=True)
        body = generate_body(request, prompt, f"{self.id_prefix}-{request_id}", self.end_id)
        counter, pending = TextCounter(self.tokenizer), b""
        path = f"/v2/models/{self.model}/generate_stream"
        try:
            async with aclosing(self.client.request("POST", path, json.dumps(body).encode())) as pieces:
                async for piece in pieces:
                    *events, pending = (pending + piece).replace(b"\r\n", b"\n").split(b"\n\n")
                    for event in events:
                        if not event.startswith(DATA):
                            continue
                        answer = json.loads(event[len(DATA) :])
                        if "error" in answer:
                            raise BadResponse(str(answer["error"]))
                        text = answer.get(P.TEXT_OUTPUT)
                        if text:
                            tokens = counter.push(np.array([str(text).encode("utf-8")], dtype=object))
                            self.deliver([Response(request_id=request_id, tokens=tokens)])
        except (OSError, asyncio.IncompleteReadError, HttpError, ValueError, BadResponse) as exc:
            self.deliver([failed(request_id, f"{type(exc).__name__}: {exc}")])
            return
        self.deliver([Response(request_id=request_id, tokens=[], final=True)])

    async def stop(self) -> None:
        await self._cancel_all()
        self.client.close()
