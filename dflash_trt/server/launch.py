"""Putting a served engine on the network: the app over a target, run by uvicorn until SIGTERM or Ctrl-C.

On SIGTERM uvicorn stops accepting connections, lets every in-flight request finish (up to the drain timeout),
then the app's shutdown stops the executor; the signal is then re-raised, so the process exits as terminated. Each
connection runs under `connections.BoundedH11Protocol` (the timeouts and the connection cap of `limits.py`).
"""

from __future__ import annotations

import socket
import time
from typing import Any

from fastapi import FastAPI

from dflash_trt.server.app import build_app
from dflash_trt.server.engine_client import EngineClient
from dflash_trt.server.generation import Served
from dflash_trt.server.limits import (
    ACCEPT_BURST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    LISTEN_BACKLOG,
    ConnectionBounds,
    connection_cap,
)
from dflash_trt.server.metrics import Metrics
from dflash_trt.server.targets import ServeTarget


def make_app(
    target: ServeTarget,
    tokenizer: Any,
    model_name: str,
    *,
    max_queue: int = DEFAULT_MAX_QUEUE,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    allowed_hosts: frozenset[str] | None = frozenset(),
    access_log: bool = False,
) -> FastAPI:
    metrics = Metrics()
    client = EngineClient(target.executor, target.max_batch_size, max_queue, metrics)
    served = Served(
        client,
        tokenizer,
        target.limits,
        model_name,
        metrics,
        target.eos_token_ids,
        target.engine_stops_at_eos,
        int(time.time()),
    )
    return build_app(
        served, api_key=api_key, max_body_bytes=max_body_bytes, allowed_hosts=allowed_hosts, access_log=access_log
    )


def uvicorn_server(app: FastAPI, bounds: ConnectionBounds | None = None):
    import uvicorn

    from dflash_trt.server.connections import BoundedServer, bounded_protocol

    bounds = bounds or ConnectionBounds()
    config = uvicorn.Config(
        app,
        http=bounded_protocol(bounds, connection_cap(bounds.max_connections)),
        log_level="warning",
        timeout_keep_alive=bounds.keep_alive_s,
        backlog=ACCEPT_BURST,
        timeout_graceful_shutdown=bounds.drain_timeout_s,
        lifespan="on",
        access_log=False,
    )
    return BoundedServer(config)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one), so the caller knows the port before the server starts and
    clients that connect early wait in its backlog instead of being refused.

    Made with `IPPROTO_TCP` named: asyncio sets `TCP_NODELAY` only on accepted sockets whose protocol says TCP, and
    without it Nagle holds a stream's first chunk on a reused connection until the client's delayed ACK (~40 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    return sock
