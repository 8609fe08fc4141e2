"""uvicorn's h11 protocol with the bounds it leaves open (`limits.ConnectionBounds`), in this one place.

uvicorn (0.54, h11) times out a kept-alive connection after a response, but nothing else: a fresh connection that
sends nothing, a request head or body trickled a byte at a time, or a response the client never reads holds its
descriptor (and a streamed request its batch slot) for ever, and connections are accepted until the process runs
out of descriptors. Here each connection is in one phase at a time, with one deadline:

- head: no byte for the keep-alive time, or a head unfinished `header_timeout_s` after the connection was made
  (or its last answer sent);
- body: unfinished `body_timeout_s` after the head, plus one second per `BODY_BYTES_PER_S` received;
- answered before its body was read (a 413, a refused key): the client may finish sending it (the connection is
  then reused), but a silence of `LINGER_S` or the body timeout closes it;
- otherwise the app owns the time; a response left unread for `send_timeout_s` ends the connection, which cancels
  its request.

A request that runs out of time is answered 408 when nothing was answered yet, then closed. At `max_connections`,
a new connection closes the connection idle longest (no request under way, not a byte of one sent) to make room;
when none is idle, the new one is answered 503 and closed at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from dflash_trt.server.limits import BODY_BYTES_PER_S, LISTEN_BACKLOG, ConnectionBounds

LOGGER = logging.getLogger("dflash_trt.server")
LINGER_S = 1.0  # silence that ends an answered request's unread body
HEAD, BODY, LINGER = "head", "body", "linger"
CAP_WARNING_EVERY_S = 60.0


def raw_answer(status: int, reason: str, kind: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer with an OpenAI error body, written straight to the socket before it closes."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class BoundedH11Protocol(H11Protocol):
    """One connection; `bounds` and `max_connections` are set on the subclass `bounded_protocol` makes."""

    bounds: ClassVar[ConnectionBounds]
    max_connections: ClassVar[int]
    last_cap_warning: ClassVar[float] = -CAP_WARNING_EVERY_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refused = False
        self.phase: str | None = None
        self.phase_start = 0.0
        self.phase_bytes = 0
        self.received = 0
        self.last_data = 0.0
        self.deadline_timer: asyncio.TimerHandle | None = None
        self.send_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections and not self._evict_idle():
            self.refused = True
            self._warn_at_capacity()
            message = f"the server holds its maximum of {self.max_connections} connections; retry later"
            transport.write(raw_answer(503, "Service Unavailable", "service_unavailable", message))
            transport.close()
            return
        super().connection_made(transport)
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.refused:
            return
        for timer in (self.deadline_timer, self.send_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        self.last_data = self.loop.time()
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.send_timer is None:
            self.send_timer = self.loop.call_later(self.bounds.send_timeout_s, self._unread)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.send_timer is not None:
            self.send_timer.cancel()
            self.send_timer = None

    def _unread(self) -> None:
        LOGGER.info("closing a connection from %s: its response went unread", self.client)
        self.transport.abort()

    def _evict_idle(self) -> bool:
        """Close the connection idle longest; False when every connection has a request under way."""
        idle = [c for c in self.connections if isinstance(c, BoundedH11Protocol) and c.idle()]
        if not idle:
            return False
        min(idle, key=lambda c: c.phase_start).transport.close()
        return True

    def idle(self) -> bool:
        """No request under way and not a byte of the next one received."""
        return self.phase == HEAD and self.received == self.phase_bytes and not self.transport.is_closing()

    def _current_phase(self) -> str | None:
        their = self.conn.their_state
        if their is h11.IDLE:
            return HEAD
        if their is h11.SEND_BODY:
            return LINGER if self.conn.our_state in (h11.DONE, h11.MUST_CLOSE) else BODY
        return None

    def _track(self) -> None:
        """Start the new phase's clock when the phase changed."""
        if self.transport is None or self.transport.is_closing():
            return
        phase = self._current_phase()
        if phase == self.phase:
            return
        self.phase, self.phase_start, self.phase_bytes = phase, self.loop.time(), self.received
        if self.deadline_timer is not None:
            self.deadline_timer.cancel()
            self.deadline_timer = None
        if phase is not None:
            self.deadline_timer = self.loop.call_at(self._deadline(), self._check_deadline)

    def _deadline(self) -> float:
        """The phase's deadline as things stand; bytes received since may have moved it later."""
        bounds, sent = self.bounds, self.received - self.phase_bytes
        if self.phase == HEAD:
            return self.phase_start + (bounds.header_timeout_s if sent else self.timeout_keep_alive)
        if self.phase == BODY:
            return self.phase_start + bounds.body_timeout_s + sent / BODY_BYTES_PER_S
        return min(max(self.phase_start, self.last_data) + LINGER_S, self.phase_start + bounds.body_timeout_s)

    def _check_deadline(self) -> None:
        self.deadline_timer = None
        if self.transport.is_closing() or self.phase != self._current_phase():
            return
        deadline = self._deadline()
        if self.loop.time() < deadline:
            self.deadline_timer = self.loop.call_at(deadline, self._check_deadline)
            return
        started = self.received > self.phase_bytes
        if self.phase == BODY or (self.phase == HEAD and started):
            what = "request head" if self.phase == HEAD else "request body"
            message = f"the {what} did not arrive in time; the connection is closed"
            if self.cycle is None or not self.cycle.response_started or self.phase == HEAD:
                self.transport.write(raw_answer(408, "Request Timeout", "invalid_request_error", message))
            LOGGER.info("closing a connection from %s: its %s did not arrive in time", self.client, what)
        self.transport.close()

    def _warn_at_capacity(self) -> None:
        now = time.monotonic()
        if now - BoundedH11Protocol.last_cap_warning >= CAP_WARNING_EVERY_S:
            BoundedH11Protocol.last_cap_warning = now
            LOGGER.warning(
                "refusing connections: %d are open, the most this server holds (--max_connections)",
                self.max_connections,
            )


def bounded_protocol(bounds: ConnectionBounds, max_connections: int) -> type[BoundedH11Protocol]:
    """The protocol class uvicorn instantiates per connection, carrying this server's bounds."""
    return type("ServeH11Protocol", (BoundedH11Protocol,), {"bounds": bounds, "max_connections": max_connections})


class BoundedServer(uvicorn.Server):
    """uvicorn's server, its listening sockets' kernel queue set back to LISTEN_BACKLOG once it serves: uvicorn's
    backlog, which asyncio also takes as the connections to accept per turn, is the small ACCEPT_BURST."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        for sock in sockets or []:
            sock.listen(LISTEN_BACKLOG)
