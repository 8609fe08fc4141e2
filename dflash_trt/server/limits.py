"""The server's default bounds, stated once for the app, the connection protocol and the `serve` flags (a module of
its own, so the command line can name them without importing the server).

Every wait a client can impose is bounded: a connection with no request under way closes after the keep-alive
time, a request's head must arrive within the header timeout, its body within the body timeout plus one second per
`BODY_BYTES_PER_S` received (a client sending at least that fast is never cut off; one trickling a byte at a time
is), a response the client leaves unread for the send timeout ends its connection, and SIGTERM waits at most the
drain timeout for the requests in flight. Connections are capped below the process's descriptor limit, keeping
`RESERVED_DESCRIPTORS` for the server's own files and sockets and room for the connections accepted but not yet
counted: asyncio accepts up to `ACCEPT_BURST` connections each time the listening socket is ready, and a surplus
one is closed, its descriptor freed, about `ACCEPT_TURNS` turns of the event loop later.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from dflash_trt.errors import DFlashTrtError

DEFAULT_MAX_QUEUE = 1024  # requests that may wait beyond the executor's batch before a request gets 503
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # the largest request body read
KEEP_ALIVE_S = 5  # uvicorn's default: a connection with no request under way, fresh or kept alive
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
BODY_BYTES_PER_S = 64 * 1024  # each such amount received extends the body timeout by one second
DEFAULT_SEND_TIMEOUT_S = 60.0
# Within Kubernetes' default 30 s grace period before SIGKILL, with room for the executor to stop.
DEFAULT_DRAIN_TIMEOUT_S = 20
DEFAULT_MAX_CONNECTIONS = 4096
RESERVED_DESCRIPTORS = 64  # model files, tokenizer, log, executor and Triton client sockets (an idle serve holds 8)
LISTEN_BACKLOG = 2048  # connections the kernel queues for the server, from before it starts serving
ACCEPT_BURST = 16  # connections accepted per turn of the event loop (uvicorn's backlog, as asyncio reads it)
ACCEPT_TURNS = 4  # accepted, its transport made, connection_made, closed, freed: the turns a surplus one lives


@dataclass(frozen=True)
class ConnectionBounds:
    """What one `serve` process allows its clients; `max_connections` None: as many as the descriptors allow, up
    to DEFAULT_MAX_CONNECTIONS."""

    max_connections: int | None = None
    keep_alive_s: int = KEEP_ALIVE_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S
    drain_timeout_s: int = DEFAULT_DRAIN_TIMEOUT_S


def descriptor_room() -> int:
    """Connections the process's open-file limit leaves room for after the server's own descriptors and one burst
    of accepted connections."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (2**31 if soft == resource.RLIM_INFINITY else soft) - RESERVED_DESCRIPTORS - ACCEPT_TURNS * ACCEPT_BURST


def connection_cap(requested: int | None) -> int:
    """The connection cap: `requested`, or the default within the descriptor limit; one clear error when the limit
    (`ulimit -n`) leaves no room for it."""
    room = descriptor_room()
    if requested is None:
        requested = min(DEFAULT_MAX_CONNECTIONS, room)
    if requested < 1 or requested > room:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        raise DFlashTrtError(
            f"--max_connections {requested} does not fit the open-file limit {soft} (ulimit -n) less the "
            f"{RESERVED_DESCRIPTORS + ACCEPT_TURNS * ACCEPT_BURST} descriptors the server keeps for itself and for "
            "accepting: give "
            f"at most {max(room, 0)}, or raise the limit"
        )
    return requested
