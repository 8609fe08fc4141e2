"""Every wait a client can impose on `dflash-trt serve` is bounded, over a real uvicorn server and raw sockets:
idle, header and body timeouts (a client sending at a reasonable pace is never cut off), the connection cap (the
longest-idle connection makes room; 503 when every one is busy), body limits while the body streams in (chunked
too), a response the client leaves unread, and SIGTERM with a client stalled mid-upload.

A ticking executor streams one token per tick until its request is cancelled, so the tests decide what is in flight;
the assertions are on what the sockets see and what the executor was asked to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from _server import RunningServer

from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import Executor, Response
from dflash_trt.server.launch import make_app
from dflash_trt.server.limits import ConnectionBounds, connection_cap
from dflash_trt.server.params import Limits
from dflash_trt.server.targets import ServeTarget
from dflash_trt.tiny.heldout import target_dir
from dflash_trt.tokenizer import load_tokenizer

JSON = "Content-Type: application/json\r\n"


class TickingExecutor(Executor):
    """Each request gets `per_tick` tokens every `tick_s` until it is cancelled (it never ends by itself)."""

    def __init__(self, per_tick: int = 1, tick_s: float = 0.01):
        self.per_tick, self.tick_s = per_tick, tick_s
        self.submitted: list[int] = []
        self.cancelled: list[int] = []

    async def start(self, deliver):
        self.deliver = deliver
        self.loop = asyncio.get_running_loop()

    def submit(self, request_id, request):
        self.submitted.append(request_id)
        self.loop.call_soon(self._tick, request_id)

    def _tick(self, request_id):
        if request_id not in self.cancelled:
            self.deliver([Response(request_id=request_id, tokens=[7] * self.per_tick)])
            self.loop.call_later(self.tick_s, self._tick, request_id)

    def cancel(self, request_id):
        self.cancelled.append(request_id)

    async def stop(self):
        pass


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(target_dir())


def ticking_target(executor: Executor, limits: Limits) -> ServeTarget:
    return ServeTarget(
        executor=executor, max_batch_size=8, limits=limits, eos_token_ids=frozenset(), engine_stops_at_eos=True
    )


def ticking_server(tokenizer, bounds: ConnectionBounds, max_body_bytes: int = 64 * 1024, **kwargs):
    executor = TickingExecutor(**kwargs)
    target = ticking_target(executor, Limits(max_seq_len=10**6, vocab_size=128))
    return executor, RunningServer(make_app(target, tokenizer, "ticking", max_body_bytes=max_body_bytes), bounds)


def connect(running) -> socket.socket:
    return socket.create_connection(("127.0.0.1", running.port), timeout=10)


def closed_after(sock: socket.socket, limit: float) -> tuple[float, bytes]:
    """Seconds until the server closes `sock`, and what it sent before; fails past `limit`."""
    start, received = time.monotonic(), b""
    sock.settimeout(0.1)
    while time.monotonic() - start < limit:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionError:
            return time.monotonic() - start, received
        if not data:
            return time.monotonic() - start, received
        received += data
    pytest.fail(f"the connection was still open after {limit} s")


def trickle_until_closed(sock: socket.socket, data: bytes, gap_s: float, limit: float) -> tuple[float, bytes]:
    start = time.monotonic()
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except ConnectionError:
            break
        sock.settimeout(gap_s)
        try:
            answer = sock.recv(65536)
        except TimeoutError:
            assert time.monotonic() - start < limit, "still open"
            continue
        return time.monotonic() - start, answer
    return closed_after(sock, limit - (time.monotonic() - start))


def head(running, method="POST", path="/v1/completions", extra="") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{running.port}\r\n{extra}\r\n".encode()


BOUNDS = ConnectionBounds(keep_alive_s=1, header_timeout_s=1.5, body_timeout_s=1.5, send_timeout_s=1.0)


def test_idle_slow_head_and_slow_body_connections_are_closed(tokenizer):
    _, running = ticking_server(tokenizer, BOUNDS)
    with running:
        took, sent = closed_after(connect(running), 10)  # never sends a byte
        assert 0.8 < took < 4 and sent == b""
        took, answer = trickle_until_closed(connect(running), head(running, "GET", "/health"), 0.3, 10)
        assert 1.2 < took < 5 and answer.startswith(b"HTTP/1.1 408")
        sock = connect(running)
        sock.sendall(head(running, extra=f"{JSON}Content-Length: 100\r\n"))
        took, answer = trickle_until_closed(sock, b"{" + b" " * 99, 0.3, 10)
        assert 1.2 < took < 5 and answer.startswith(b"HTTP/1.1 408")
        assert "did not arrive in time" in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        # Kept alive after an answer: closed after the keep-alive time.
        sock = connect(running)
        sock.sendall(head(running, "GET", "/health"))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        took, _ = closed_after(sock, 10)
        assert 0.8 < took < 4


def test_a_body_sent_at_a_steady_pace_outlasts_the_body_timeout(tokenizer):
    """Each 64 KiB received extends the body timeout by a second: 6 pieces over about 4 s beat a 1.5 s timeout."""
    _, running = ticking_server(tokenizer, BOUNDS, max_body_bytes=2**20)
    piece = 60 * 1024
    body = json.dumps({"prompt": [5] * (6 * piece // 3), "max_tokens": 1}).encode()[: 6 * piece]
    with running:
        sock = connect(running)
        sock.sendall(head(running, extra=f"{JSON}Content-Length: {len(body)}\r\n"))
        start = time.monotonic()
        for i in range(6):
            sock.sendall(body[i * piece : (i + 1) * piece])
            time.sleep(0.7)
        sock.settimeout(10)
        answer = sock.recv(65536)
        assert time.monotonic() - start > BOUNDS.body_timeout_s
        assert answer.startswith(b"HTTP/1.1 4") and not answer.startswith(b"HTTP/1.1 408")


def test_at_the_connection_cap_the_longest_idle_connection_makes_room_then_503(tokenizer):
    executor, running = ticking_server(tokenizer, ConnectionBounds(max_connections=3, keep_alive_s=30))
    body = {"prompt": "add 1 2", "max_tokens": 100000, "stream": True}
    with running, contextlib.ExitStack() as streams:
        idle = [connect(running) for _ in range(3)]
        time.sleep(0.3)
        lines = []
        for _ in range(3):  # each stream's connection closes an idle one to make room
            http = streams.enter_context(httpx.Client(base_url=running.url, timeout=10))
            lines.append(streams.enter_context(http.stream("POST", "/v1/completions", json=body)).iter_lines())
            assert next(lines[-1]).startswith("data: ")
        for sock in idle:
            assert closed_after(sock, 5)[1] == b""
        _, answer = closed_after(connect(running), 5)  # every connection carries a request: refused at once
        assert answer.startswith(b"HTTP/1.1 503") and b"maximum of 3 connections" in answer
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "service_unavailable"
    wait_for(lambda: sorted(executor.cancelled) == [0, 1, 2])


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_an_unread_stream_ends_its_request(tokenizer):
    """A client that stops reading a stream: once the server's buffers are full for the send timeout, the
    connection is dropped and the request cancelled in the executor, freeing its batch slot."""
    executor, running = ticking_server(tokenizer, BOUNDS, per_tick=1024, tick_s=0.002)
    with running:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", running.port))
        body = json.dumps({"prompt": "add 1 2", "max_tokens": 10**6 - 10, "stream": True}).encode()
        sock.sendall(head(running, extra=f"{JSON}Content-Length: {len(body)}\r\n") + body)
        wait_for(lambda: executor.submitted == [0])
        wait_for(lambda: executor.cancelled == [0], timeout=30)
        metrics = httpx.get(f"{running.url}/metrics").text
        assert "dflash_trt_requests_running 0.0" in metrics
        sock.close()


def test_bodies_over_the_limit_are_refused_as_they_stream_in(tokenizer):
    _, running = ticking_server(tokenizer, BOUNDS)

    def chunks():
        for _ in range(20):
            yield b"x" * 8192

    with running:
        start = time.monotonic()
        answer = httpx.post(
            f"{running.url}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}
        )
        assert answer.status_code == 413 and "65536 bytes" in answer.json()["error"]["message"]
        assert time.monotonic() - start < 5
        # Declared too large and never sent: 413 at once; the connection closes after a short silence.
        sock = connect(running)
        sock.sendall(head(running, extra=f"{JSON}Content-Length: {10 * 2**20}\r\n"))
        took, answer = closed_after(sock, 5)
        assert answer.startswith(b"HTTP/1.1 413") and took < 3
        # Declared too large and sent anyway: 413, the rest discarded, the connection still usable.
        with httpx.Client(base_url=running.url) as http:
            big = {"prompt": "x" * 100_000}
            assert http.post("/v1/completions", json=big).status_code == 413
            assert http.get("/health").status_code == 200


@pytest.mark.slow
def test_sigterm_ends_within_the_drain_timeout_whatever_clients_do(tiny):
    """A real `dflash-trt serve` on 0.0.0.0 without a key (it warns) with a client stalled mid-upload and one idle
    connection: SIGTERM exits within the drain timeout."""
    command = [sys.executable, "-m", "dflash_trt.cli", "serve", "--checkpoint_dir", str(tiny), "--port", "0"]
    command += ["--host", "0.0.0.0", "--drain_timeout_s", "2", "--body_timeout_s", "600"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
    try:
        port = int(server.stdout.readline().split(" on ")[1].split("/v1")[0].rsplit(":", 1)[1])
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{JSON}Content-Length: 100\r\n\r\n{{".encode())
        idle = socket.create_connection(("127.0.0.1", port))
        time.sleep(0.5)
        start = time.monotonic()
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 128 + signal.SIGTERM
        assert time.monotonic() - start < 2 + 10  # the drain timeout, then stopping the executor
        err = server.stderr.read()
        assert "serving on 0.0.0.0 without an API key" in err
        stalled.close()
        idle.close()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


class RecordingTokenizer:
    """The tiny pair's real tokenizer, recording which thread encodes and renders what (a spy, not a double: every
    answer is the real tokenizer's)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls: list[tuple[str, str, int]] = []
        self.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, text, **kwargs):
        self.calls.append(("encode", threading.current_thread().name, len(text)))
        return self.tokenizer.encode(text, **kwargs)

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append(("render", threading.current_thread().name, len(messages)))
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, **kwargs)


def test_prompts_are_tokenized_off_the_event_loop_after_a_length_bound(tokenizer):
    """The tiny tokenizer's longest entry is 13 characters, so a 226-token request holds at most 2,938: a 7.9 MB
    prompt is refused without tokenizing; shorter ones are rendered and tokenized in the worker thread."""
    spy = RecordingTokenizer(tokenizer)
    target = ticking_target(TickingExecutor(), Limits(max_seq_len=226, vocab_size=128))
    app = make_app(target, spy, "ticking", max_body_bytes=16 * 2**20)
    longest = max(len(entry) for entry in tokenizer.get_vocab())
    assert longest == 13
    with RunningServer(app, BOUNDS) as running, httpx.Client(base_url=running.url, timeout=60) as http:
        huge = "add 1537 7993 " * (7_900_000 // 14)
        for path, body in (
            ("/v1/completions", {"prompt": huge}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
        ):
            answer = http.post(path, json=body)
            assert answer.status_code == 400 and f"at most {226 * 13} characters" in answer.json()["error"]["message"]
        assert [call for call in spy.calls if call[0] == "encode"] == []
        assert len(spy.calls) == 1 and spy.calls[0][:2] == ("render", "dflash-trt-tokenize_0")
        spy.calls.clear()
        answer = http.post("/v1/completions", json={"prompt": "1 " * 1400, "max_tokens": 1})  # 2,800 characters
        assert answer.status_code == 400 and "prompt" in answer.json()["error"]["param"]
        chat = {"messages": [{"role": "user", "content": "add 1 2"}], "stop_token_ids": [7]}  # the first token
        answer = http.post("/v1/chat/completions", json=chat)
        assert answer.status_code == 200
        kinds = [(kind, thread, size) for kind, thread, size in spy.calls]
        assert kinds == [
            ("encode", "dflash-trt-tokenize_0", 2800),
            ("render", "dflash-trt-tokenize_0", 1),
            ("encode", "dflash-trt-tokenize_0", len("user: add 1 2\nassistant:")),
        ]


def test_the_connection_cap_stays_below_the_descriptor_limit():
    """64 descriptors for the server itself and 4 turns of 16 accepted connections: at ulimit -n 256, 128."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        assert connection_cap(None) == 128 and connection_cap(100) == 100
        with pytest.raises(DFlashTrtError, match=r"--max_connections 200 does not fit the open-file limit 256"):
            connection_cap(200)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
