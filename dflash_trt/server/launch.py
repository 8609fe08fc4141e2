"""Putting a served engine on the network: the app over a target, run by uvicorn until SIGTERM or Ctrl-C.

On SIGTERM uvicorn stops accepting connections, lets every in-flight request finish (up to `drain_timeout_s`),
then the app's shutdown stops the executor; the signal is then re-raised, so the process exits as terminated.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from fastapi import FastAPI

from dflash_trt.server.app import build_app
from dflash_trt.server.engine_client import EngineClient
from dflash_trt.server.generation import Served
from dflash_trt.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE
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
    return build_app(served, api_key=api_key, max_body_bytes=max_body_bytes, access_log=access_log)


def uvicorn_server(app: FastAPI, drain_timeout_s: int | None = None):
    import uvicorn

    config = uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=drain_timeout_s, lifespan="on", access_log=False
    )
    return uvicorn.Server(config)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one), so the caller knows the port before the server starts and
    clients that connect early wait in its backlog instead of being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock
