"""The FastAPI app: routes, body parsing and limits, the API key, and turning error values into HTTP answers.
Every request gets an id and, when asked, an access log line (`observability.RequestIds`).

Bodies are read and validated here (not by FastAPI's dependency injection) so that every malformed body, unknown
field and oversized upload gets one OpenAI-style 400/413 naming what is wrong. A non-streamed request whose client
disconnects is cancelled; a streamed one is cancelled by Starlette closing its stream on disconnect.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from dflash_trt.server.errors import METHOD_NOT_ALLOWED, NOT_FOUND, SERVER_ERROR, TOO_LARGE, UNAVAILABLE, error
from dflash_trt.server.generation import Served
from dflash_trt.server.guards import HostCheck, check_api_key, content_type_refusal, key_refusal
from dflash_trt.server.limits import DEFAULT_MAX_BODY_BYTES
from dflash_trt.server.metrics import CONTENT_TYPE
from dflash_trt.server.observability import LOGGER, RequestIds
from dflash_trt.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from dflash_trt.server.serving_chat import create_chat_completion
from dflash_trt.server.serving_common import unknown_model
from dflash_trt.server.serving_completion import create_completion
from dflash_trt.server.serving_tokens import detokenize, tokenize, tokenizer_info
from dflash_trt.server.sse import EventStream

Body = TypeVar("Body", bound=BaseModel)
Result = TypeVar("Result")
CLIENT_CLOSED = 499  # what nginx logs for a client that left before the answer; the client never sees it


def answer(result: BaseModel | ErrorResponse | EventStream) -> Response:
    """The HTTP answer of a result. A refusal (4xx) is logged at INFO with its reason, so a client that records only
    "400 Bad Request" leaves the cause in the server's log."""
    if isinstance(result, ErrorResponse):
        body = result.error
        if body.code is None or body.code < SERVER_ERROR:
            why = (body.request_id, result.status, body.param, body.message)
            LOGGER.info("request %s refused (%d, param %s): %s", *why)
        return JSONResponse(result.model_dump(), status_code=result.status)
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json")
    return StreamingResponse(
        result.events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
        background=BackgroundTask(result.close),
    )


def validation_error(exc: ValidationError) -> ErrorResponse:
    first = exc.errors(include_url=False)[0]
    where = [str(part) for part in first["loc"] if not isinstance(part, int)]
    kind = first["type"]
    if kind == "json_invalid":
        return error(f"the body is not valid JSON: {first['msg']}")
    if kind == "extra_forbidden":
        name = ".".join(where)
        return error(f"unknown parameter {name!r}: this server does not know it, so it cannot honour it", name)
    if not where:
        return error(f"the body must be a JSON object: {first['msg']}")
    name = where[0] if kind == "missing" else ".".join(where)
    return error(f"{name}: {first['msg']}", where[0])


async def read_body(request: Request, limit: int) -> bytes | ErrorResponse | None:
    """The body, 413 once it is known to exceed `limit` (declared, or counted as it streams in, chunked too), or
    None when the client went away (or its connection ran out of time) before sending all of it."""
    too_large = error(f"the body exceeds {limit} bytes", status=TOO_LARGE)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return too_large
            chunks.append(chunk)
    except ClientDisconnect:
        return None
    return b"".join(chunks)


async def until_disconnected(request: Request, work: Awaitable[Result]) -> Result | None:
    """`work`'s result, or None with `work` cancelled when the client goes away first (its request leaves the
    engine). Only for work that starts after the body has been read: the watcher consumes what the client sends."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


def executor_lifespan(served: Served) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the executor starts before the first request and stops after the last."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await served.client.start()
        LOGGER.info("serving %r: the executor is ready", served.model_name)
        try:
            yield
        finally:
            await served.client.stop()
            served.prompts.close()
            LOGGER.info("the executor stopped")

    return lifespan


def build_app(
    served: Served,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    allowed_hosts: frozenset[str] | None = frozenset(),
    access_log: bool = False,
) -> FastAPI:
    """`allowed_hosts`: names a keyless server answers besides loopback's (guards.HostCheck); None: any Host, for
    a server listening beyond loopback. A server with a key takes any Host."""
    lifespan = executor_lifespan(served)
    app = FastAPI(title="dflash-trt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    expected = None if api_key is None else check_api_key(api_key, "the API key")
    if expected is None and allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=allowed_hosts)
    app.add_middleware(RequestIds, access_log=access_log)  # outermost: every answer, a guard's too, has an id

    def unauthorized(request: Request) -> ErrorResponse | None:
        return key_refusal(expected, request.headers.get("authorization"))

    async def generate(
        request: Request,
        endpoint: str,
        schema: type[Body],
        serve: Callable[[Served, Body], Awaitable[BaseModel | ErrorResponse | EventStream]],
    ) -> Response:
        refused = unauthorized(request) or content_type_refusal(request.headers.get("content-type"))
        body = await read_body(request, max_body_bytes) if refused is None else refused
        if body is None:
            response = Response(status_code=CLIENT_CLOSED)
        elif isinstance(body, ErrorResponse):
            response = answer(body)
        else:
            try:
                parsed = schema.model_validate_json(body)
            except ValidationError as exc:
                response = answer(validation_error(exc))
            else:
                result = await until_disconnected(request, serve(served, parsed))
                response = Response(status_code=CLIENT_CLOSED) if result is None else answer(result)
        served.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completions", CompletionRequest, create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat", ChatCompletionRequest, create_chat_completion)

    @app.post("/tokenize")
    async def tokenize_prompt(request: Request) -> Response:
        return await generate(request, "tokenize", TokenizeRequest, tokenize)

    @app.post("/detokenize")
    async def detokenize_tokens(request: Request) -> Response:
        return await generate(request, "detokenize", DetokenizeRequest, detokenize)

    add_lookup_routes(app, served, unauthorized)
    add_error_handlers(app)
    return app


def add_lookup_routes(app: FastAPI, served: Served, unauthorized: Callable[[Request], ErrorResponse | None]) -> None:
    """The routes that read the server's state: the model, the tokenizer, health and metrics."""

    @app.get("/tokenizer_info")
    async def tokenizer(request: Request) -> Response:
        return answer(unauthorized(request) or tokenizer_info(served))

    card = ModelCard(id=served.model_name, created=served.created, max_model_len=served.limits.max_seq_len)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return answer(unauthorized(request) or ModelList(data=[card]))

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        return answer(unauthorized(request) or unknown_model(served, model_id) or card)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        broken = served.client.executor.health()
        if broken is None:
            return Response(status_code=200)
        return answer(error(f"the engine is broken: {broken}", status=UNAVAILABLE))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.exposition(), media_type=CONTENT_TYPE)


def add_error_handlers(app: FastAPI) -> None:
    """An unknown path is 404, a known path with the wrong method 405 with its `Allow` header, both OpenAI-style."""

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> Response:
        return answer(error(f"no route {request.method} {request.url.path}", status=NOT_FOUND))

    @app.exception_handler(405)
    async def wrong_method(request: Request, exc: Exception) -> Response:
        allowed = getattr(exc, "headers", None) or {}
        response = answer(error(f"{request.method} is not allowed on {request.url.path}", status=METHOD_NOT_ALLOWED))
        response.headers.update(allowed)
        return response
