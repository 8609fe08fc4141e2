"""One request never breaks `dflash-trt serve`: what the engine cannot hold is a 400 naming the limit, degenerate
temperatures decode greedily, a request the engine fails on fails alone, and `/health` says 503 only while the
executor itself cannot step. The official `openai` client against a real uvicorn server over the target
`serve --checkpoint_dir --ignore_eos` builds (the emulated engine of the tiny pair: 256 positions, 15 drafts).

Oracles: hand-computed limits (256 - 2 x 15 = 226), the golden loop (`speculative_generate`) for tokens, a
checkpoint with one poisoned embedding row (`_poisoned.py`) for a real engine fault, and, for a fault of the
executor as a whole, the emulated executor wrapped so that its `step` raises while a flag is set.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time

import httpx
import openai
import pytest
from _poisoned import POISONED_TOKEN
from _server import RunningServer

from dflash_trt.decoding_modes import DFLASH
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.executors import worker
from dflash_trt.executors.emulated import EmulatedStepper
from dflash_trt.executors.worker import WorkerExecutor
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.server.launch import make_app
from dflash_trt.server.params import Limits
from dflash_trt.server.targets import ServeTarget, checkpoint_target
from dflash_trt.tokenizer import load_tokenizer

LONGEST = 226  # the tiny target's 256 positions less two blocks of 15 drafts
TEXT = "add 1537 7993\n"
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer(tiny, tmp_path_factory):
    """The tiny pair's tokenizer with a chat template that renders the messages' contents back to back."""
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return load_tokenizer(folder)


def serving(checkpoint, tokenizer) -> RunningServer:
    """What `dflash-trt serve --checkpoint_dir CHECKPOINT --max_batch_size 4 --ignore_eos` runs."""
    return RunningServer(make_app(checkpoint_target(str(checkpoint), 4, None, True), tokenizer, "tiny"))


@pytest.fixture(scope="module")
def server(tiny, tokenizer):
    with serving(tiny, tokenizer) as running:
        yield running


@pytest.fixture(scope="module")
def golden(tiny):
    return load_golden_model(tiny)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def prompt_of(tokenizer, length: int) -> list[int]:
    """`length` token ids of real text (TEXT, repeated)."""
    ids = tokenizer.encode(TEXT)
    return (ids * (length // len(ids) + 1))[:length]


def still_serving(server, tokenizer) -> None:
    """After whatever came before: a small request decodes and /health is 200."""
    answer = client(server).completions.create(model="tiny", prompt=TEXT, max_tokens=3, temperature=0)
    assert answer.usage.completion_tokens == 3
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_max_model_len_is_the_longest_request_the_engine_holds(server):
    assert [card.max_model_len for card in client(server).models.list().data] == [LONGEST]


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "param", "message"),
    [
        (241, 1, "prompt", "the prompt has 241 tokens; this engine takes at most 226 tokens per request"),
        (LONGEST, 1, "prompt", "so at most 225 prompt tokens"),
        (200, 56, "max_tokens", "max_tokens 56 is too large: the prompt has 200 tokens"),
        (200, 27, "max_tokens", "so max_tokens must be <= 26"),
    ],
)
def test_a_request_that_does_not_fit_is_a_400_naming_the_limit(
    server, tokenizer, prompt_len, max_tokens, param, message
):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).completions.create(
            model="tiny", prompt=prompt_of(tokenizer, prompt_len), max_tokens=max_tokens, temperature=0
        )
    assert refused.value.body["param"] == param and message in refused.value.body["message"]
    still_serving(server, tokenizer)


def test_a_chat_that_does_not_fit_is_a_400_naming_the_limit(server, tokenizer):
    content = tokenizer.decode(prompt_of(tokenizer, 200))
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_completion_tokens=40, temperature=0
        )
    assert refused.value.body["param"] == "max_completion_tokens"
    assert "this engine takes at most 226 tokens per request" in refused.value.body["message"]
    still_serving(server, tokenizer)


def test_a_request_that_fills_the_engine_decodes_as_the_golden_loop(server, tokenizer, golden):
    """200 + 26 tokens: the engine's last step drafts up to position 255, the last of the target's 256."""
    prompt = prompt_of(tokenizer, 200)
    answer = client(server).completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=26,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert answer.choices[0].token_ids == speculative_generate(golden, [prompt], 26)[0].output_ids
    assert answer.choices[0].finish_reason == "length"
    still_serving(server, tokenizer)


def test_the_default_budget_is_what_the_engine_holds_past_the_prompt(server, tokenizer):
    """A chat without max_tokens may fill the engine (OpenAI's default: as many as fit); with ignore_eos it does."""
    content = tokenizer.decode(prompt_of(tokenizer, 210))
    answer = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.usage.prompt_tokens == 210 and answer.usage.completion_tokens == LONGEST - 210
    assert answer.choices[0].finish_reason == "length"
    still_serving(server, tokenizer)


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 5e-324, 9.9e-6])
def test_temperatures_too_small_to_invert_decode_greedily(server, tokenizer, golden, temperature):
    prompt = tokenizer.encode(TEXT)
    answer = client(server).completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=20,
        temperature=temperature,
        seed=1,
        extra_body={"return_token_ids": True},
    )
    stops = list(golden.target.spec.eos_token_ids)
    assert answer.choices[0].token_ids == speculative_generate(golden, [prompt], 20, stops)[0].output_ids
    still_serving(server, tokenizer)


def test_a_request_the_engine_fails_on_fails_alone(poisoned_tiny, tokenizer, golden):
    """The poisoned request (sampled) makes the engine raise while a long greedy stream is in flight beside it: it
    gets a 500 naming the engine's error; the stream ends with the golden loop's tokens; the server keeps serving."""
    prompt = prompt_of(tokenizer, 30)

    async def together(url: str) -> tuple[list[int], openai.APIStatusError]:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stream = await api.completions.create(
            model="tiny", prompt=prompt, max_tokens=120, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        chunks = stream.__aiter__()
        ids = (await anext(chunks)).choices[0].token_ids  # the stream is in the engine
        with pytest.raises(openai.InternalServerError) as failed:
            await api.completions.create(
                model="tiny", prompt=[*prompt[:5], POISONED_TOKEN, *prompt[5:]], max_tokens=10, temperature=1.0
            )
        async for chunk in chunks:
            ids += chunk.choices[0].token_ids if chunk.choices and chunk.choices[0].token_ids else []
        return ids, failed.value

    with serving(poisoned_tiny, tokenizer) as running:
        ids, failure = asyncio.run(together(running.url))
        assert "the engine failed on this request: EmulationError: gather index out of range" in failure.message
        assert ids == speculative_generate(golden, [prompt], 120)[0].output_ids
        still_serving(running, tokenizer)


class Faulty:
    """The emulated stepper, whose `step` raises while `fault` is set: a failure of the executor as a whole."""

    def __init__(self, inner: EmulatedStepper, fault: threading.Event):
        self.inner, self.fault = inner, fault

    def add(self, request_id, request):
        self.inner.add(request_id, request)

    def cancel(self, request_id):
        self.inner.cancel(request_id)

    def step(self):
        if self.fault.is_set():
            raise RuntimeError("device lost")
        return self.inner.step()

    def has_work(self):
        return self.inner.has_work()

    def close(self):
        self.inner.close()


def faulty_server(tiny, tokenizer, fault: threading.Event, building: threading.Event) -> RunningServer:
    engine = EmulatedEngine(tiny, max_batch_size=2, tokens_per_block=16)

    def make_executor() -> Faulty:
        if building.is_set():
            raise MemoryError("no room for the KV pool")
        return Faulty(EmulatedStepper(engine, LONGEST), fault)

    target = ServeTarget(
        executor=WorkerExecutor(make_executor, DFLASH),
        max_batch_size=2,
        limits=Limits(max_seq_len=LONGEST, vocab_size=engine.vocab_size),
        eos_token_ids=frozenset(),
        engine_stops_at_eos=True,
    )
    return RunningServer(make_app(target, tokenizer, "tiny"))


def failed_request(server) -> str:
    with pytest.raises(openai.InternalServerError) as failed:
        client(server).completions.create(model="tiny", prompt=TEXT, max_tokens=3, temperature=0)
    return failed.value.message


def health(server) -> tuple[int, str]:
    answer = httpx.get(f"{server.url}/health")
    return answer.status_code, answer.json()["error"]["message"] if answer.status_code != 200 else ""


def test_health_is_503_while_the_executor_cannot_step_and_200_once_it_can(tiny, tokenizer):
    """The first failure replaces the executor (health stays 200); the fresh one failing too marks the backend
    broken (503 with the cause) until a step works again."""
    fault, building = threading.Event(), threading.Event()
    with faulty_server(tiny, tokenizer, fault, building) as running:
        still_serving(running, tokenizer)
        fault.set()
        assert "the executor failed: device lost" in failed_request(running)
        assert health(running) == (200, "")
        failed_request(running)
        assert health(running) == (503, "the engine is broken: the executor failed: device lost")
        fault.clear()
        still_serving(running, tokenizer)


def test_an_executor_that_cannot_be_rebuilt_refuses_requests_until_a_retry_builds_one(tiny, tokenizer, monkeypatch):
    """Without an executor every request is refused at once with the cause; every RETRY_S the backend builds again,
    and once one is built requests run and the first working step makes it healthy."""
    monkeypatch.setattr(worker, "RETRY_S", 0.2)
    fault, building = threading.Event(), threading.Event()
    with faulty_server(tiny, tokenizer, fault, building) as running:
        fault.set()
        building.set()
        failed_request(running)
        code, reason = health(running)
        assert code == 503 and reason.endswith("no fresh executor: no room for the KV pool")
        assert "no fresh executor" in failed_request(running)
        fault.clear()
        building.clear()
        deadline = time.monotonic() + 30
        while True:
            try:
                still_serving(running, tokenizer)
                break
            except openai.InternalServerError as refused:  # until the next retry has built an executor
                assert "no fresh executor" in refused.message and time.monotonic() < deadline
                time.sleep(0.05)
