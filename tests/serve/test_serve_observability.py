"""What `serve` tells its operator and its clients about each request: an id (X-Request-Id, in every error body and
in the completion's id), an opt-in access log without prompts, and every 5xx logged with its cause. Over a real
uvicorn server and the `httpx` client; the executor is scripted so that a chosen prompt fails in the engine."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from _server import RunningServer

from dflash_trt.executors.contract import Executor, Response, failed
from dflash_trt.server.launch import make_app
from dflash_trt.server.params import Limits
from dflash_trt.server.targets import ServeTarget
from dflash_trt.tiny.heldout import target_dir
from dflash_trt.tokenizer import load_tokenizer

FAILING_TOKEN = 13  # a prompt holding it fails in the scripted engine
ENGINE_FAULT = "out of KV pages in step 7"


class ScriptedExecutor(Executor):
    """Answers every request with tokens [7, 8] in one final response; a prompt holding FAILING_TOKEN fails."""

    async def start(self, deliver):
        self.deliver = deliver

    def submit(self, request_id, request):
        answer = (
            failed(request_id, ENGINE_FAULT)
            if FAILING_TOKEN in request.input_ids
            else Response(request_id=request_id, tokens=[7, 8], final=True)
        )
        asyncio.get_running_loop().call_soon(self.deliver, [answer])

    def cancel(self, request_id):
        pass

    async def stop(self):
        pass


def scripted_server(access_log: bool = False) -> RunningServer:
    target = ServeTarget(
        executor=ScriptedExecutor(),
        max_batch_size=4,
        limits=Limits(max_seq_len=64, vocab_size=128),
        eos_token_ids=frozenset(),
        engine_stops_at_eos=True,
    )
    return RunningServer(make_app(target, load_tokenizer(target_dir()), "scripted", access_log=access_log))


def _complete(running: RunningServer, prompt, headers=None, **extra) -> httpx.Response:
    body = {"model": "scripted", "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(f"{running.url}/v1/completions", json=body, headers=headers or {}, timeout=30)


def test_every_answer_carries_its_request_id_and_a_client_id_is_kept():
    with scripted_server() as running:
        fresh = [_complete(running, [5, 6]) for _ in range(2)]
        ids = [r.headers["x-request-id"] for r in fresh]
        assert all(r.status_code == 200 for r in fresh) and len(set(ids)) == 2 and all(len(i) == 32 for i in ids)
        assert [r.json()["id"] for r in fresh] == [f"cmpl-{i}" for i in ids]
        kept = _complete(running, [5, 6], headers={"X-Request-Id": "trace-42.a"})
        assert kept.headers["x-request-id"] == "trace-42.a" and kept.json()["id"] == "cmpl-trace-42.a"
        # An id that could pass for several log fields (or is huge) is replaced, not echoed.
        for unusable in ('x id=other "GET /"', "x" * 129):
            replaced = _complete(running, [5, 6], headers={"X-Request-Id": unusable}).headers["x-request-id"]
            assert replaced != unusable and len(replaced) == 32
        health = httpx.get(f"{running.url}/health", timeout=30)
        assert health.status_code == 200 and len(health.headers["x-request-id"]) == 32


def test_an_error_names_its_request():
    with scripted_server() as running:
        refused = _complete(running, [5, 6], top_p=0.5, headers={"X-Request-Id": "client-7"})
        assert refused.status_code == 400
        assert refused.json()["error"]["request_id"] == "client-7" == refused.headers["x-request-id"]
        missing = httpx.get(f"{running.url}/v2/nothing", timeout=30)
        assert missing.status_code == 404 and missing.json()["error"]["request_id"] == missing.headers["x-request-id"]


def test_an_engine_failure_is_a_500_logged_with_its_cause_and_id(caplog):
    with scripted_server() as running, caplog.at_level(logging.INFO, logger="dflash_trt.server"):
        answer = _complete(running, [5, FAILING_TOKEN], headers={"X-Request-Id": "fails-1"})
        streamed = _complete(running, [FAILING_TOKEN], headers={"X-Request-Id": "fails-2"}, stream=True)
    assert answer.status_code == 500 and answer.json()["error"]["request_id"] == "fails-1"
    assert ENGINE_FAULT in answer.json()["error"]["message"]
    assert streamed.status_code == 200 and '"request_id":"fails-2"' in streamed.text.replace(" ", "")
    logged = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [("fails-1" in r.getMessage(), ENGINE_FAULT in r.getMessage()) for r in logged] == [
        (True, True),
        (False, True),
    ]
    assert "fails-2" in logged[1].getMessage()


@pytest.mark.parametrize("access_log", [False, True])
def test_the_access_log_is_opt_in_and_never_holds_a_prompt(caplog, access_log):
    secret_prompt = "mul 9876 5432"
    with scripted_server(access_log) as running, caplog.at_level(logging.INFO, logger="dflash_trt.server"):
        answer = _complete(running, secret_prompt, headers={"X-Request-Id": "seen-3"})
        refused = _complete(running, secret_prompt, n=3)
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash_trt.server.access"]
    if not access_log:
        assert answer.status_code == 200 and lines == []
        return
    assert [line.split('"')[1] for line in lines] == ["POST /v1/completions"] * 2
    assert lines[0].startswith("127.0.0.1 ") and " 200 " in lines[0] and lines[0].endswith(" id=seen-3")
    assert " 400 " in lines[1] and lines[1].endswith(f"id={refused.headers['x-request-id']}")
    assert all(secret_prompt not in r.getMessage() for r in caplog.records)


def test_an_unhandled_exception_is_an_openai_500_logged_with_its_traceback(caplog, monkeypatch):
    from dflash_trt.server import serving_completion

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the front")

    monkeypatch.setattr(serving_completion, "start_generations", broken)
    with scripted_server() as running, caplog.at_level(logging.INFO, logger="dflash_trt.server"):
        answer = _complete(running, [5, 6], headers={"X-Request-Id": "bug-1"})
    assert answer.status_code == 500 and answer.headers["x-request-id"] == "bug-1"
    assert answer.json()["error"]["type"] == "internal_server_error" and answer.json()["error"]["request_id"] == "bug-1"
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "bug-1" in record.getMessage() and "a bug in the front" in str(record.exc_info[1])
