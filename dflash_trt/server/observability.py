"""What the server tells its operator: a logger, one id per HTTP request, an opt-in access log.

Every request gets an id: the client's `X-Request-Id` when it sends a usable one (as proxies and vLLM's clients do),
else a fresh one. The response carries it back in `X-Request-Id`, every error body names it (`error.request_id`),
and so does every log line about the request. The access log (`serve --access_log`) writes one line per request:
client, method, path, status, milliseconds and id, never a prompt or a completion. A 5xx answer is logged with its
cause where it is made (`errors.error`); an exception no route handled is logged with its traceback and answered
with an OpenAI-style 500 naming the request.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

LOGGER = logging.getLogger("dflash_trt.server")
ACCESS_LOGGER = logging.getLogger("dflash_trt.server.access")
REQUEST_ID_HEADER = "x-request-id"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# A client's id is kept when it is short and plain; anything else (a log-injection attempt, a huge value) is replaced.
USABLE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("current_request_id", default=None)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def configure_logging(level: str) -> None:
    """The server's log lines go to stderr at `level` and above, apart from other libraries' loggers."""
    logger = logging.getLogger("dflash_trt")
    if not any(getattr(h, "dflash_trt", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler.dflash_trt = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-Id when usable, else a fresh id."""
    for name, value in headers:
        if name.lower() == REQUEST_ID_HEADER.encode():
            given = value.decode("latin-1")
            return given if USABLE_ID.fullmatch(given) else uuid.uuid4().hex
    return uuid.uuid4().hex


class RequestIds:
    """ASGI middleware: the request's id in `current_request_id` while it is served and in the response's header;
    the access log line when asked for; a 500 for an exception nothing else handled."""

    def __init__(self, app: ASGIApp, access_log: bool = False):
        self.app = app
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope.get("headers", []))
        token = current_request_id.set(request_id)
        started, status = time.perf_counter(), 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER.encode(), request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            LOGGER.exception("request %s failed with an unhandled exception", request_id)
            if status == 0:
                status = 500
                await _internal_error(send_with_id, request_id)
        finally:
            current_request_id.reset(token)
            if self.access_log:
                client = scope.get("client") or ("-", 0)
                ACCESS_LOGGER.info(
                    '%s "%s %s" %d %.1f ms id=%s',
                    client[0],
                    scope["method"],
                    scope["path"],
                    status,
                    1000 * (time.perf_counter() - started),
                    request_id,
                )


async def _internal_error(send: Send, request_id: str) -> None:
    body = {
        "error": {
            "message": f"internal server error (request {request_id}); the server's log has the cause",
            "type": "internal_server_error",
            "param": None,
            "code": 500,
            "request_id": request_id,
        }
    }
    await send({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})
