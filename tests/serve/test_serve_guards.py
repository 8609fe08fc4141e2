"""Who may call `dflash-trt serve`, over a real uvicorn server with httpx and the official `openai` client: the
API key (the `Bearer` scheme in any case, the key compared exactly), JSON bodies only (no CORS-simple cross-site
POST), and the Host header of a keyless loopback server (DNS rebinding).
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from _server import RunningServer

from dflash_trt.executors.contract import Executor, Response
from dflash_trt.server.guards import host_name, is_loopback
from dflash_trt.server.launch import make_app
from dflash_trt.server.params import Limits
from dflash_trt.server.targets import ServeTarget
from dflash_trt.tiny.heldout import target_dir
from dflash_trt.tokenizer import load_tokenizer

BODY = {"model": "instant", "prompt": "add 1 2", "max_tokens": 2}


class InstantExecutor(Executor):
    """Every request is answered at once: token 7, then its final token 8."""

    async def start(self, deliver):
        self.deliver = deliver
        self.loop = asyncio.get_running_loop()

    def submit(self, request_id, request):
        answers = [Response(request_id=request_id, tokens=[7]), Response(request_id=request_id, tokens=[8], final=True)]
        self.loop.call_soon(self.deliver, answers)

    def cancel(self, request_id):
        pass

    async def stop(self):
        pass


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(target_dir())


def instant_server(tokenizer, **kwargs) -> RunningServer:
    target = ServeTarget(
        executor=InstantExecutor(),
        max_batch_size=4,
        limits=Limits(max_seq_len=256, vocab_size=128),
        eos_token_ids=frozenset(),
        engine_stops_at_eos=True,
    )
    return RunningServer(make_app(target, tokenizer, "instant", **kwargs))


def test_the_bearer_scheme_is_case_insensitive_and_the_key_exact(tokenizer):
    with instant_server(tokenizer, api_key="s3same") as running:
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
            answer = httpx.post(
                f"{running.url}/v1/completions", json=BODY, headers={"Authorization": f"{scheme} s3same"}
            )
            assert answer.status_code == 200, scheme
        assert (
            httpx.post(
                f"{running.url}/v1/completions", json=BODY, headers={"Authorization": "Bearer   s3same"}
            ).status_code
            == 200
        )  # RFC 7235: one or more spaces after the scheme
        for wrong in ("Bearer s3sam", "Bearer s3samee", "Bearer S3SAME", "Basic s3same", "s3same", "Bearer", ""):
            answer = httpx.post(f"{running.url}/v1/completions", json=BODY, headers={"Authorization": wrong})
            assert answer.status_code == 401 and answer.json()["error"]["type"] == "authentication_error", wrong
        assert httpx.post(f"{running.url}/v1/completions", json=BODY).status_code == 401
        api = openai.OpenAI(base_url=f"{running.url}/v1", api_key="s3same", max_retries=0)
        assert api.completions.create(**BODY).choices[0].finish_reason == "length"  # 2 tokens: 7, 8
        # A keyed server takes any Host: a page that does not know the key gains nothing by rebinding a name.
        answer = httpx.get(
            f"{running.url}/v1/models", headers={"Host": "attacker.example", "Authorization": "Bearer s3same"}
        )
        assert answer.status_code == 200


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]
)
def test_post_bodies_must_be_json(tokenizer, content_type):
    """The content types a page can POST cross-site without a preflight, and no type at all, are refused."""
    with instant_server(tokenizer) as running:
        headers = {} if content_type is None else {"Content-Type": content_type}
        content = httpx.Request("POST", "/", json=BODY).content
        answer = httpx.post(f"{running.url}/v1/chat/completions", content=content, headers=headers)
        assert answer.status_code == 415 and "Content-Type: application/json" in answer.json()["error"]["message"]
        for accepted in ("application/json", "Application/JSON; charset=utf-8"):
            answer = httpx.post(f"{running.url}/v1/completions", content=content, headers={"Content-Type": accepted})
            assert answer.status_code == 200


LOOPBACK_HOSTS = ["localhost", "LOCALHOST:8000", "127.0.0.1", "127.0.0.1:1", "127.1.2.3:80", "[::1]", "[::1]:8000"]
FOREIGN_HOSTS = [
    "attacker.example",
    "attacker.example:8000",
    "localhost.attacker.example",
    "127.0.0.1.nip.io",
    "10.0.0.1",
]


def test_a_keyless_loopback_server_answers_only_loopback_hosts_and_the_names_it_was_given(tokenizer):
    with instant_server(tokenizer, allowed_hosts=frozenset({"box.lan"})) as running:
        for host in LOOPBACK_HOSTS + ["box.lan", "BOX.LAN:8000"]:
            assert httpx.get(f"{running.url}/v1/models", headers={"Host": host}).status_code == 200, host
            assert httpx.post(f"{running.url}/v1/completions", json=BODY, headers={"Host": host}).status_code == 200
        for host in FOREIGN_HOSTS:
            for method, path in (("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics"), ("POST", "/x")):
                answer = httpx.request(method, f"{running.url}{path}", json=BODY, headers={"Host": host})
                assert answer.status_code == 403, (host, path)
                assert answer.json()["error"]["type"] == "permission_error" and "--allowed_hosts" in answer.text
            answer = httpx.post(f"{running.url}/v1/completions", json=BODY, headers={"Host": host})
            assert answer.status_code == 403


def test_a_server_beyond_loopback_takes_any_host(tokenizer):
    with instant_server(tokenizer, allowed_hosts=None) as running:
        for host in FOREIGN_HOSTS:
            assert httpx.post(f"{running.url}/v1/completions", json=BODY, headers={"Host": host}).status_code == 200


def test_loopback_names_and_host_headers():
    assert all(is_loopback(h) for h in ("localhost", "localhost.", "127.0.0.1", "127.255.0.9", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "192.168.1.2", "example.com", "localhost.com"))
    names = [host_name(h) for h in ("a:80", "[::1]:80", "[::1]", "a", "a:b")]
    assert names == ["a", "[::1]", "[::1]", "a", "a:b"]
