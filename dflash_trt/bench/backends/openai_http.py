"""OpenAI backend: any server speaking the OpenAI completions API over HTTP (`dflash-trt serve`, vLLM, ...).

Requests go to `/v1/completions` as token-id prompts with `stream: true`, so the measured path is the server's
whole front (HTTP, JSON, detokenization) but not a client tokenizer. Each streamed chunk must carry the tokens of
one engine iteration in `token_ids` (the `return_token_ids` extension `serve` and vLLM honour): that is the
acceptance source, as the executor's per-iteration responses are for the other backends. A server that sends text
without token ids is refused rather than measured by re-tokenizing, which would blur iterations together.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from dflash_trt.bench.driver import Backend, BenchRequest, Deliver, Response
from dflash_trt.errors import DFlashTrtError

DATA = "data: "
DONE = "[DONE]"


def request_body(model: str, request: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": request.input_ids,
        "max_tokens": request.max_new_tokens,
        "temperature": request.temperature,
        "stream": True,
        "return_token_ids": True,
    }
    if request.seed is not None:
        body["seed"] = request.seed
    if ignore_eos:
        body["ignore_eos"] = True
    return body


class OpenAIBackend(Backend):
    def __init__(
        self,
        url: str,
        *,
        mode: str = "dflash",
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
        self.client: Any = None
        self.deliver: Deliver = lambda batch: None
        self.tasks: dict[int, asyncio.Task] = {}

    async def start(self, deliver: Deliver) -> None:
        import httpx

        self.deliver = deliver
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=None, limits=limits)
        try:
            answer = await self.client.get("/models", timeout=self.connect_timeout_s)
            models = answer.json()["data"] if answer.status_code == 200 else []
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            await self.client.aclose()
            raise DFlashTrtError(f"cannot reach an OpenAI server at {self.url}: {exc or type(exc).__name__}") from None
        if not models:
            await self.client.aclose()
            raise DFlashTrtError(f"{self.url}/models lists no model (HTTP {answer.status_code})")
        self.model = str(models[0]["id"])

    def submit(self, request_id: int, request: BenchRequest) -> None:
        task = asyncio.get_running_loop().create_task(self._stream(request_id, request))
        self.tasks[request_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(request_id, None))

    def cancel(self, request_id: int) -> None:
        """Close the request's connection: the server cancels a request whose client went away."""
        task = self.tasks.get(request_id)
        if task is not None:
            task.cancel()

    async def _stream(self, request_id: int, request: BenchRequest) -> None:
        import httpx

        body = request_body(self.model, request, self.ignore_eos)
        try:
            async with self.client.stream("POST", "/completions", json=body) as answer:
                if answer.status_code != 200:
                    detail = (await answer.aread()).decode(errors="replace")[:300]
                    self._fail(request_id, f"HTTP {answer.status_code}: {detail}")
                    return
                async for line in answer.aiter_lines():
                    if not line.startswith(DATA):
                        continue
                    data = line[len(DATA) :]
                    if data == DONE:
                        break
                    if self._chunk(request_id, json.loads(data)):
                        return
        except (httpx.HTTPError, ValueError) as exc:
            self._fail(request_id, f"{type(exc).__name__}: {exc}")
            return
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
            self.deliver([Response(request_id, tokens, final)])
        return final

    def _fail(self, request_id: int, message: str) -> None:
        self.deliver([Response(request_id, [], True, message)])

    async def stop(self) -> None:
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()
            self.client = None
