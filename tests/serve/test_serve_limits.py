"""`dflash-trt serve`'s admission and connection handling over a real uvicorn server: the bounded queue (503),
cancellation when a client goes away (streamed, queued and whole requests), the API key, the body limit, and
SIGTERM draining the requests in flight of a real `dflash-trt serve` process.

A held backend answers each request's first iteration at once and its last only when the test releases it, so
the test decides what is in flight; the assertions are on what real HTTP clients see and what the backend was
asked to do.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from _server import RunningServer

from dflash_trt.executors.contract import Executor, Response
from dflash_trt.server.launch import make_app
from dflash_trt.server.params import Limits
from dflash_trt.server.targets import ServeTarget
from dflash_trt.tiny.heldout import target_dir
from dflash_trt.tokenizer import load_tokenizer


class HeldExecutor(Executor):
    """Every request gets token 7 at once and its final token 8 when `release`d; cancels are recorded."""

    def __init__(self):
        self.submitted: list[int] = []
        self.cancelled: list[int] = []

    async def start(self, deliver):
        self.deliver = deliver
        self.loop = asyncio.get_running_loop()

    def submit(self, request_id, request):
        self.submitted.append(request_id)
        self.loop.call_soon(self.deliver, [Response(request_id=request_id, tokens=[7])])

    def cancel(self, request_id):
        self.cancelled.append(request_id)

    def release(self, request_id):
        self.loop.call_soon_threadsafe(self.deliver, [Response(request_id=request_id, tokens=[8], final=True)])

    async def stop(self):
        pass


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(target_dir())


def held_server(tokenizer, *, max_batch_size=1, max_queue=1, **kwargs):
    backend = HeldExecutor()
    target = ServeTarget(
        executor=backend,
        max_batch_size=max_batch_size,
        limits=Limits(max_seq_len=256, vocab_size=128),
        eos_token_ids=frozenset(),
        engine_stops_at_eos=True,
    )
    return backend, RunningServer(make_app(target, tokenizer, "held", max_queue=max_queue, **kwargs))


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


BODY = {"model": "held", "prompt": "add 1 2", "max_tokens": 4, "temperature": 0, "stream": True}


def test_a_full_queue_answers_503_and_a_freed_slot_admits_the_next(tokenizer):
    backend, running = held_server(tokenizer)

    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json=BODY) as first:
                lines = first.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                second = asyncio.ensure_future(http.post("/v1/completions", json={**BODY, "stream": False}))
                await asyncio.to_thread(wait_for, lambda: len(backend.submitted) == 1 and not second.done())
                third = await http.post("/v1/completions", json=BODY)
                assert third.status_code == 503 and third.json()["error"]["type"] == "service_unavailable"
                metrics = (await http.get("/metrics")).text
                assert "dflash_trt_requests_running 1.0" in metrics and "dflash_trt_requests_waiting 1.0" in metrics
                backend.release(backend.submitted[0])
                rest = [line async for line in lines if line]
                assert rest[-1] == "data: [DONE]"
            await asyncio.to_thread(wait_for, lambda: len(backend.submitted) == 2)
            backend.release(backend.submitted[1])
            answer = (await second).json()
            assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] == 2

    with running:
        asyncio.run(scenario(running.url))
    assert backend.cancelled == []


def test_clients_that_go_away_cancel_their_requests(tokenizer):
    backend, running = held_server(tokenizer, max_batch_size=1, max_queue=4)
    with running:
        with httpx.Client(base_url=running.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=BODY) as streamed:
                lines = streamed.iter_lines()
                assert next(lines).startswith("data: ")
                # A second stream waits in the queue; its client leaves before it is admitted.
                with httpx.Client(base_url=running.url, timeout=0.5) as impatient:
                    with pytest.raises(httpx.ReadTimeout):
                        impatient.post("/v1/completions", json={**BODY, "stream": False})
                wait_for(lambda: "dflash_trt_requests_waiting 0.0" in http.get("/metrics").text)
                assert backend.submitted == [0] and backend.cancelled == []
            wait_for(lambda: backend.cancelled == [0])  # the streamed request, cancelled in the backend
            # The queued one left the queue without reaching the backend; a whole (non-streamed) request whose
            # client leaves is cancelled too.
            with httpx.Client(base_url=running.url, timeout=0.5) as impatient:
                with pytest.raises(httpx.ReadTimeout):
                    impatient.post("/v1/completions", json={**BODY, "stream": False})
            wait_for(lambda: backend.cancelled == [0, 2])
            assert backend.submitted == [0, 2]
            metrics = http.get("/metrics").text
            assert "dflash_trt_requests_running 0.0" in metrics and "dflash_trt_requests_waiting 0.0" in metrics


def test_the_api_key_guards_the_api_and_bodies_are_bounded(tokenizer):
    backend, running = held_server(tokenizer, api_key="sesame", max_body_bytes=2048)
    with running:
        base = f"{running.url}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).completions.create(
                model="held", prompt="x", max_tokens=1
            )
        assert [m.id for m in openai.OpenAI(base_url=base, api_key="sesame").models.list().data] == ["held"]
        assert httpx.get(f"{running.url}/health").status_code == 200
        big = {"model": "held", "prompt": "x" * 4096, "max_tokens": 1}
        answer = httpx.post(f"{base}/completions", json=big, headers={"Authorization": "Bearer sesame"})
        assert answer.status_code == 413 and "2048 bytes" in answer.json()["error"]["message"]
    assert backend.submitted == []


@pytest.mark.slow
def test_sigterm_lets_the_streams_in_flight_finish_then_exits(tiny):
    command = [sys.executable, "-m", "dflash_trt.cli", "serve", "--checkpoint_dir", str(tiny), "--port", "0"]
    command += ["--ignore_eos", "--max_batch_size", "2"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
    try:
        banner = server.stdout.readline()
        url = banner.split(" on ")[1].split()[0]
        body = {"prompt": "count 8644", "max_tokens": 120, "temperature": 0, "stream": True, "ignore_eos": True}
        body["stream_options"] = {"include_usage": True}
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            server.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: ") :])["usage"]["completion_tokens"] == 120
        assert server.wait(60) == 128 + signal.SIGTERM
        with pytest.raises(httpx.ConnectError):
            httpx.get(url.removesuffix("/v1") + "/health")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_the_bench_openai_backend_cancels_by_closing_and_reports_refusals(tokenizer):
    """bench's OpenAI backend: `cancel` closes the request's connection (the server cancels it in its backend), and a
    request the server refuses comes back as that request's error."""
    from dflash_trt.clients.openai_http import OpenAIExecutor
    from dflash_trt.executors.contract import Request

    backend, running = held_server(tokenizer, max_batch_size=2, max_queue=0)
    seen: list[Response] = []

    async def scenario(url: str) -> None:
        client = OpenAIExecutor(f"{url}/v1")
        await client.start(seen.extend)
        client.submit(10, Request(input_ids=[5, 6], max_new_tokens=8))
        client.submit(11, Request(input_ids=[5, 6], max_new_tokens=10_000))
        while not (any(r.request_id == 10 for r in seen) and any(r.request_id == 11 for r in seen)):
            await asyncio.sleep(0.01)
        client.cancel(10)
        await asyncio.to_thread(wait_for, lambda: backend.cancelled == [0])
        await client.stop()

    with running:
        asyncio.run(scenario(running.url))
    assert [(r.tokens, r.final) for r in seen if r.request_id == 10] == [([7], False)]
    refused = [r for r in seen if r.request_id == 11]
    assert (
        len(refused) == 1 and refused[0].final and "HTTP 400" in refused[0].error and "max_tokens" in refused[0].error
    )
