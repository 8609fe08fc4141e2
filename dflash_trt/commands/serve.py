"""`dflash-trt serve`: an OpenAI-compatible endpoint (/v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics, and vLLM's /tokenize and /detokenize) over a DFlash engine (TensorRT-LLM executor), a Triton deployment,
or a converted checkpoint (CPU).

Temperature and seed are honoured; parameters the engine cannot honour (n > 1, top_p < 1, top_k, penalties,
logprobs, logit_bias, tools, response_format, ...) are refused with HTTP 400 naming them. Every wait a client can
impose is bounded (header, body and send timeouts, a connection cap). SIGTERM finishes the requests in flight
(at most --drain_timeout_s), then exits.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from dflash_trt.errors import DFlashTrtError
from dflash_trt.inputs import DRAFT_TREE, MAX_REQUESTS, MAX_TIMEOUT_S, PORT, POSITIVE_INT, TIMEOUT_S, URL, IntRange
from dflash_trt.server.limits import (
    BODY_BYTES_PER_S,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_SEND_TIMEOUT_S,
    ConnectionBounds,
    connection_cap,
)
from dflash_trt.tokenizer import load_tokenizer, read_chat_template
from dflash_trt.trtllm.build_limits import MAX_EAGLE_BATCH_SIZE

API_KEY_ENV = "DFLASH_TRT_API_KEY"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOGGER = logging.getLogger("dflash_trt.server")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP endpoint over an engine, Triton or a checkpoint", description=__doc__
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--engine_dir", help="DFlash engine (dflash-trt build): TensorRT-LLM 1.2.x executor, GPU")
    target.add_argument("--triton_url", type=URL, help="Triton gRPC endpoint HOST:PORT of a deployed repository")
    target.add_argument("--checkpoint_dir", help="converted checkpoint: the emulated engine on the CPU")
    parser.add_argument("--tokenizer_dir", help="tokenizer (default: the checkpoint's; required otherwise)")
    parser.add_argument(
        "--chat_template", help="Jinja chat template file for /v1/chat/completions (default: the tokenizer's own)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=PORT, default=8000, help="0 picks a free port")
    parser.add_argument("--served_model_name", help="model name clients send (default: the folder's name)")
    parser.add_argument(
        "--max_batch_size",
        type=IntRange(1, MAX_EAGLE_BATCH_SIZE),
        help="requests in the engine at once (default: the engine's)",
    )
    parser.add_argument(
        "--max_queue_size",
        type=IntRange(0, MAX_REQUESTS),
        default=DEFAULT_MAX_QUEUE,
        help="requests waiting beyond that; then 503",
    )
    parser.add_argument(
        "--max_seq_len", type=POSITIVE_INT, help="prompt + output tokens per request (default: the engine's)"
    )
    parser.add_argument(
        "--draft_tree",
        type=DRAFT_TREE,
        help="with --checkpoint_dir: verify draft trees of N nodes per step (as `build --draft_tree N`; default the "
        "chain); a built engine or a Triton deployment serves the tree it was built with",
    )
    parser.add_argument("--plugin_library", help="libdflash_trt_plugins.so (default: the one dflash_trt.json names)")
    parser.add_argument("--triton_model", default="tensorrt_llm", help="model that takes token ids")
    parser.add_argument("--ignore_eos", action="store_true", help="never stop at EOS (benchmarks)")
    parser.add_argument(
        "--max_request_bytes",
        type=IntRange(1024, 2**31 - 1),
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body",
    )
    parser.add_argument("--api_key", help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV})")
    parser.add_argument(
        "--allowed_hosts",
        nargs="+",
        default=[],
        metavar="NAME",
        help="Host names a keyless server on loopback answers besides localhost, 127.0.0.1 and [::1]",
    )
    add_bound_arguments(parser)
    parser.add_argument("--log_level", choices=LOG_LEVELS, default="info", help="the server's log on stderr")
    parser.add_argument(
        "--access_log", action="store_true", help="log one line per HTTP request (status, time, id; no prompts)"
    )
    parser.set_defaults(func=run)


def add_bound_arguments(parser: argparse.ArgumentParser) -> None:
    """The connection bounds: how many connections, and how long a client may take to send or to read."""
    bounds = parser.add_argument_group("connection bounds")
    bounds.add_argument(
        "--max_connections",
        type=IntRange(1, MAX_REQUESTS),
        help="connections held at once; beyond that a new one gets 503 (default: 4096 within ulimit -n)",
    )
    bounds.add_argument(
        "--header_timeout_s",
        type=TIMEOUT_S,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="a request's head must arrive within this (default %(default)s)",
    )
    bounds.add_argument(
        "--body_timeout_s",
        type=TIMEOUT_S,
        default=DEFAULT_BODY_TIMEOUT_S,
        help=f"a request's body must arrive within this, plus 1 s per {BODY_BYTES_PER_S // 1024} KiB received "
        "(default %(default)s)",
    )
    bounds.add_argument(
        "--send_timeout_s",
        type=TIMEOUT_S,
        default=DEFAULT_SEND_TIMEOUT_S,
        help="a response the client leaves unread this long ends its request (default %(default)s)",
    )
    bounds.add_argument(
        "--drain_timeout_s",
        type=IntRange(1, int(MAX_TIMEOUT_S)),
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM, wait at most this long for requests in flight (default %(default)s)",
    )


def check_arguments(args: argparse.Namespace) -> None:
    if not (args.tokenizer_dir or args.checkpoint_dir):
        raise DFlashTrtError("--engine_dir and --triton_url need --tokenizer_dir")
    if args.draft_tree is not None and not args.checkpoint_dir:
        raise DFlashTrtError(
            "--draft_tree applies to --checkpoint_dir: a built engine verifies the tree it was built with"
        )


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api_key, else the environment; an empty or unusable one is an error, never "no key"."""
    from dflash_trt.server.guards import check_api_key

    source, key = (
        ("--api_key", args.api_key) if args.api_key is not None else (API_KEY_ENV, os.environ.get(API_KEY_ENV))
    )
    if key is None:
        return None
    check_api_key(key, source)
    return key


def allowed_hosts(args: argparse.Namespace, key: str | None) -> frozenset[str] | None:
    """Host names a keyless loopback server answers (guards.HostCheck); None where any Host is taken."""
    from dflash_trt.server.guards import is_loopback

    if key is None and is_loopback(args.host):
        return frozenset(args.allowed_hosts)
    if args.allowed_hosts:
        raise DFlashTrtError(
            "--allowed_hosts applies to a server on loopback without --api_key; this one takes any Host header"
        )
    return None


def warn_if_open(host: str, port: int, key: str | None) -> None:
    """A keyless server beyond loopback is allowed, with a warning: containers must listen beyond loopback to be
    reached at all, and a gateway in front often holds the keys."""
    from dflash_trt.server.guards import is_loopback

    if key is None and not is_loopback(host):
        LOGGER.warning(
            "serving on %s without an API key: anyone who can reach port %d can use the engine; give --api_key (or "
            "%s) unless a gateway in front checks keys",
            host,
            port,
            API_KEY_ENV,
        )


def run(args: argparse.Namespace) -> int:
    from dflash_trt.server.launch import listen, make_app, uvicorn_server
    from dflash_trt.server.observability import configure_logging
    from dflash_trt.server.targets import checkpoint_target, engine_target, triton_target

    check_arguments(args)
    configure_logging(args.log_level)
    chat_template = read_chat_template(args.chat_template) if args.chat_template else None
    key = api_key(args)
    hosts = allowed_hosts(args, key)
    bounds = ConnectionBounds(
        max_connections=connection_cap(args.max_connections),
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        send_timeout_s=args.send_timeout_s,
        drain_timeout_s=args.drain_timeout_s,
    )
    tokenizer_dir = args.tokenizer_dir or args.checkpoint_dir
    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer is None:
        raise DFlashTrtError(f"{tokenizer_dir} holds no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if args.checkpoint_dir:
        target = checkpoint_target(
            args.checkpoint_dir, args.max_batch_size, args.max_seq_len, args.ignore_eos, args.draft_tree
        )
    elif args.engine_dir:
        target = engine_target(
            args.engine_dir, args.plugin_library, args.max_batch_size, args.max_seq_len, args.ignore_eos
        )
    else:
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_ids = [] if eos is None else [eos]
        target = triton_target(
            args.triton_url,
            args.triton_model,
            args.max_batch_size,
            args.max_seq_len,
            eos_ids,
            args.ignore_eos,
            len(tokenizer),
        )
    name = args.served_model_name or Path(args.checkpoint_dir or args.engine_dir or args.triton_model).name
    app = make_app(
        target,
        tokenizer,
        name,
        max_queue=args.max_queue_size,
        api_key=key,
        max_body_bytes=args.max_request_bytes,
        allowed_hosts=hosts,
        access_log=args.access_log,
    )
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    warn_if_open(args.host, port, key)
    print(f"serving {name!r} on http://{host}:{port}/v1 (Ctrl-C or SIGTERM to stop)", flush=True)
    uvicorn_server(app, bounds).run(sockets=[sock])
    return 0
