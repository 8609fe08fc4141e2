"""OpenAI executor: any server speaking the OpenAI completions API over HTTP (`dflash-trt serve`, vLLM, ...).

Requests go to `/v1/completions` as token-id prompts with `stream: true`, so the measured path is the server's
whole front (HTTP, JSON, detokenization) but not a client tokenizer. Each streamed chunk must carry the tokens of
one engine iteration in `token_ids` (the `return_token_ids` extension `serve` and vLLM honour): that is the
acceptance source, as the executor's per-iteration responses are for the other executors. A server that sends text
without token ids is refused rather than measured by re-tokenizing, which would blur iterations together.

Why a small HTTP/1.1 client of its own (keep-alive connections, chunked or sized bodies, server-sent events) and not
a general one: the load generator must cost far less per streamed chunk than the server it measures. With httpx,
64 users streaming one 4-token chunk every 13 ms measured 15-20 % more time per output token than the server
delivered on two shared cores (perf/bench_serve.py); this client measures within 1 %.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any
from urllib.parse import urlsplit

from dflash_trt.clients.streams import StreamPerRequest
from dflash_trt.decoding_modes import DFLASH, DecodingMode
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import Deliver, Request, Response, failed

DATA = b"data: "
DONE = b"[DONE]"
Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class HttpError(Exception):
    """The server answered with a status other than 200, or broke the protocol."""


def request_body(model: str, request: Request, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": request.input_ids,
        "max_tokens": request.max_new_tokens,
        "temperature": request.sampling.temperature,
        "stream": True,
        "return_token_ids": True,
    }
    if request.sampling.seed is not None:
        body["seed"] = request.sampling.seed
    if ignore_eos:
        body["ignore_eos"] = True
    return body


class HttpClient:
    """HTTP/1.1 to one server: requests on pooled keep-alive connections, response bodies as they arrive."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise DFlashTrtError(f"--openai_url must look like http://HOST:PORT/v1, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.idle: list[Connection] = []

    async def _connection(self) -> Connection:
        while self.idle:
            reader, writer = self.idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return await asyncio.open_connection(self.host, self.port, ssl=self.tls)

    async def request(self, method: str, path: str, body: bytes = b"") -> AsyncGenerator[bytes, None]:
        """Yields the response body in pieces; raises HttpError for a status other than 200 (with its body)."""
        reader, writer = await self._connection()
        reusable = False
        try:
            head = (
                f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            writer.write(head.encode() + body)
            status_line = await reader.readline()
            status = status_line.split(b" ", 2)
            if len(status) < 2 or not status[0].startswith(b"HTTP/1."):
                raise HttpError(f"not an HTTP response: {status_line[:80]!r}")
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip().lower()
            pieces = self._body(reader, headers)
            if status[1] != b"200":
                detail = b"".join([piece async for piece in pieces]).decode(errors="replace")[:300]
                raise HttpError(f"HTTP {status[1].decode()}: {detail}")
            async for piece in pieces:
                yield piece
            reusable = headers.get("connection") != "close"
        finally:
            if reusable:
                self.idle.append((reader, writer))
            else:
                writer.close()

    @staticmethod
    async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncGenerator[bytes, None]:
        if headers.get("transfer-encoding") == "chunked":
            while size := int((await reader.readline()).split(b";")[0], 16):
                yield await reader.readexactly(size)
                await reader.readexactly(2)
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
        elif "content-length" in headers:
            yield await reader.readexactly(int(headers["content-length"]))
        else:
            while piece := await reader.read(65536):
                yield piece

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


class OpenAIExecutor(StreamPerRequest):
    def __init__(
        self,
        url: str,
        *,
        mode: DecodingMode = DFLASH,
        gpus: int = 1,
        ignore_eos: bool = False,
        connect_timeout_s: float = 10.0,
    ):
        self.url = url.rstrip("/")
        self.mode = mode
        self.gpus = gpus
        self.ignore_eos = ignore_eos
        self.connect_timeout_s = connect_timeout_s
        self.model = ""
        self.client = HttpClient(self.url)
        super().__init__()

    async def start(self, deliver: Deliver) -> None:
        self.deliver = deliver

        async def models() -> list:
            async with aclosing(self.client.request("GET", "/models")) as pieces:
                answer = b"".join([piece async for piece in pieces])
            return json.loads(answer)["data"]

        try:
            listed = await asyncio.wait_for(models(), self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise DFlashTrtError(f"cannot reach an OpenAI server at {self.url}: {exc or type(exc).__name__}") from None
        except (HttpError, ValueError, KeyError, TypeError) as exc:
            raise DFlashTrtError(
                f"{self.url} answered, but GET {self.url}/models gave no OpenAI model list "
                f"({exc or type(exc).__name__}); the URL names the API root, e.g. http://HOST:PORT/v1"
            ) from None
        if not listed:
            raise DFlashTrtError(f"{self.url}/models lists no model")
        self.model = str(listed[0]["id"])

    async def _stream(self, request_id: int, request: Request) -> None:
        body = json.dumps(request_body(self.model, request, self.ignore_eos)).encode()
        pending, ended = b"", False
        try:
            # Read to the end of the body even after the final chunk, so the connection can carry the next request.
            async with aclosing(self.client.request("POST", "/completions", body)) as pieces:
                async for piece in pieces:
                    *events, pending = (pending + piece).replace(b"\r\n", b"\n").split(b"\n\n")
                    for event in events:
                        if not ended and event.startswith(DATA) and event[len(DATA) :] != DONE:
                            ended = self._chunk(request_id, json.loads(event[len(DATA) :]))
        except (OSError, asyncio.IncompleteReadError, HttpError, ValueError) as exc:
            if not ended:
                self._fail(request_id, f"{type(exc).__name__}: {exc}")
            return
        if not ended:
            self._fail(request_id, "the stream ended before a chunk with a finish_reason")

    def _chunk(self, request_id: int, chunk: dict[str, Any]) -> bool:
        """Deliver one chunk; True when it ended the request."""
        if "error" in chunk:
            self._fail(request_id, str(chunk["error"].get("message", chunk["error"])))
            return True
        if not chunk.get("choices"):
            return False  # the usage chunk
        choice = chunk["choices"][0]
        tokens = choice.get("token_ids") or []
        if choice.get("text") and not tokens:
            self._fail(request_id, "the server streams text without token_ids (it ignores return_token_ids)")
            return True
        final = choice.get("finish_reason") is not None
        if tokens or final:
            self.deliver([Response(request_id=request_id, tokens=tokens, final=final)])
        return final

    def _fail(self, request_id: int, message: str) -> None:
        self.deliver([failed(request_id, message)])

    async def stop(self) -> None:
        await self._cancel_all()
        self.client.close()
