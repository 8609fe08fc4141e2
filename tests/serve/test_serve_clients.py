"""`dflash-trt serve` as the clients people use meet it: keep-alive connections, vLLM's and OpenAI's optional
fields, lists of prompts (lm-eval's batches), /tokenize and /detokenize, model lookup, wrong methods, and the tiny
pair's own chat template. Through the official `openai` client and raw HTTP against a real uvicorn server.

Oracles: `dflash-trt generate` (the golden loop) for the greedy outputs, the tokenizer's own `encode` / `decode` /
`apply_chat_template`, and a server listening on a socket made the old way (no `IPPROTO_TCP`: Nagle left on) as
the control for the first-chunk latency.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import logging
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from _server import RunningServer

from dflash_trt.cli import main
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.executors.emulated import EmulatedExecutor
from dflash_trt.reference.loop_rules import longest_request
from dflash_trt.server.launch import make_app, uvicorn_server
from dflash_trt.server.observability import LOGGER
from dflash_trt.server.params import Limits
from dflash_trt.server.targets import ServeTarget
from dflash_trt.tiny.heldout import load_heldout
from dflash_trt.tokenizer import load_tokenizer

MAX_NEW = 64  # past the tiny pair's longest held-out answer (about 47 tokens with its EOS)


@pytest.fixture(scope="module")
def engine(tiny) -> EmulatedEngine:
    return EmulatedEngine(tiny, max_batch_size=4, tokens_per_block=16)


def emulated_target(engine: EmulatedEngine, ignore_eos: bool = False) -> ServeTarget:
    max_seq_len = longest_request(engine.max_position_embeddings, engine.k)
    eos = frozenset(engine.eos_token_ids)
    return ServeTarget(
        executor=EmulatedExecutor(engine, max_seq_len, [] if ignore_eos else sorted(eos)),
        max_batch_size=engine.max_batch_size,
        limits=Limits(max_seq_len=max_seq_len, vocab_size=engine.vocab_size),
        eos_token_ids=eos,
        engine_stops_at_eos=not ignore_eos,
    )


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(tiny)


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with RunningServer(make_app(emulated_target(engine), tokenizer, "tiny")) as running:
        yield running


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [item.text for item in load_heldout(limit=3)]


@pytest.fixture(scope="module")
def greedy(tiny, texts, tmp_path_factory) -> list[list[int]]:
    """`generate`'s output ids for each text, the independent oracle of every greedy answer here."""
    prompts = tmp_path_factory.mktemp("greedy") / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = io.StringIO()
    argv = ["generate", "--checkpoint_dir", str(tiny), "--input_file", str(prompts)]
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--max_new_tokens", str(MAX_NEW), "--json"]) == 0
    return [s["output_ids"] for s in json.loads(out.getvalue())["sequences"]]


def decoded(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


# --- keep-alive connections -----------------------------------------------------------------------------------


def first_chunk_ms(port: int, requests: int = 8) -> list[float]:
    """Milliseconds from a streamed chat answer's headers to its first SSE line (the role chunk, which the server
    sends at once, before any engine work), each on the same kept-alive connection (the first request opens it
    and is not counted)."""
    connection = http.client.HTTPConnection("127.0.0.1", port)
    messages = [{"role": "user", "content": "add 1 2"}]
    body = json.dumps({"messages": messages, "max_tokens": 1, "temperature": 0, "stream": True})
    times = []
    for _ in range(requests + 1):
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        headers_read = time.perf_counter()
        assert response.status == 200 and response.readline().startswith(b"data: ")
        times.append((time.perf_counter() - headers_read) * 1000)
        response.read()
    connection.close()
    return times[1:]


def nagle_socket() -> socket.socket:
    """A listening socket made as `listen` made it before: no protocol named, so asyncio leaves Nagle on."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def test_a_stream_on_a_reused_connection_is_not_held_back_by_nagle(engine, tokenizer, server):
    """With Nagle on, the headers go out and the first chunk waits for the client's delayed ACK (~40 ms on Linux:
    on a reused connection the client is out of quick-ACK mode); with TCP_NODELAY it follows at once. The control
    serves the same app from a socket made without IPPROTO_TCP."""
    ours = first_chunk_ms(server.port)
    sock = nagle_socket()
    control = uvicorn_server(make_app(emulated_target(engine), tokenizer, "tiny"))
    thread = threading.Thread(target=control.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not control.started:
            time.sleep(0.02)
        nagled = first_chunk_ms(sock.getsockname()[1])
    finally:
        control.should_exit = True
        thread.join(60)
    assert statistics.median(nagled) >= 30, f"the control shows no Nagle delay here: {nagled}"
    assert statistics.median(ours) < statistics.median(nagled) / 2, (ours, nagled)


# --- fields of OpenAI's and vLLM's schemas ----------------------------------------------------------------------

NO_OPS = {
    "user": "someone",
    "metadata": {"run": "7"},
    "store": False,
    "service_tier": "auto",
    "safety_identifier": "hash",
    "prompt_cache_key": "k",
    "top_k": -1,
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
    "priority": 0,
}


@pytest.mark.parametrize("field", sorted(NO_OPS))
def test_fields_that_change_nothing_are_accepted_and_change_nothing(server, tokenizer, texts, greedy, field):
    body = {"model": "tiny", "prompt": texts[0], "max_tokens": MAX_NEW, "temperature": 0, field: NO_OPS[field]}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == decoded(tokenizer, greedy[0])


REFUSED = [
    ("store", True, "stores no completions"),
    ("service_tier", "flex", "one processing tier"),
    ("skip_special_tokens", False, "special tokens"),
    ("include_stop_str_in_output", True, "stop string"),
    ("priority", 3, "arrival order"),
    ("top_k", -2, "top_k"),
]


@pytest.mark.parametrize(("field", "value", "why"), REFUSED, ids=[f for f, _, _ in REFUSED])
def test_fields_that_would_be_silently_ignored_are_refused_by_name(server, field, value, why):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).completions.create(model="tiny", prompt="add 1 2\n", max_tokens=2, extra_body={field: value})
    assert refused.value.param == field and why in refused.value.message


def test_ignore_eos_is_refused_with_its_reason_unless_serve_runs_past_eos(server, engine, tokenizer, texts, greedy):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).completions.create(model="tiny", prompt=texts[0], max_tokens=2, extra_body={"ignore_eos": True})
    assert refused.value.param == "ignore_eos" and "--ignore_eos" in refused.value.message
    assert len(greedy[0]) < MAX_NEW and greedy[0][-1] == tokenizer.eos_token_id
    with RunningServer(make_app(emulated_target(engine, ignore_eos=True), tokenizer, "tiny")) as past_eos:
        api = client(past_eos)
        past, stopped = [
            api.completions.create(
                model="tiny", prompt=texts[0], max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": flag}
            )
            for flag in (True, False)
        ]
    assert past.usage.completion_tokens == MAX_NEW and past.choices[0].finish_reason == "length"
    assert past.choices[0].text.startswith(decoded(tokenizer, greedy[0]))
    assert stopped.choices[0].text == decoded(tokenizer, greedy[0]) and stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == len(greedy[0])


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server, texts, greedy):
    for endpoint in ("completions", "chat"):
        options = {"include_usage": True, "continuous_usage_stats": True}
        common = {"model": "tiny", "max_tokens": MAX_NEW, "temperature": 0, "stream": True}
        common |= {"stream_options": options, "extra_body": {"return_token_ids": True}}
        api = client(server)
        if endpoint == "completions":
            chunks = list(api.completions.create(prompt=texts[0], **common))
        else:
            chunks = list(api.chat.completions.create(messages=[{"role": "user", "content": texts[0]}], **common))
        produced = 0
        for chunk in chunks[:-1]:
            produced += len(chunk.choices[0].model_extra.get("token_ids") or [])
            assert chunk.usage is not None and chunk.usage.completion_tokens == produced
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == produced == len(greedy[0])


# --- lists of prompts -------------------------------------------------------------------------------------------


def test_a_list_of_prompts_gets_one_choice_per_prompt_in_order(server, tokenizer, texts, greedy):
    api = client(server)
    want = [decoded(tokenizer, ids) for ids in greedy]
    for prompt in (texts, [tokenizer.encode(t) for t in texts]):
        whole = api.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        assert [c.index for c in whole.choices] == [0, 1, 2]
        assert [c.text for c in whole.choices] == want
        assert whole.usage.completion_tokens == sum(len(ids) for ids in greedy)
        assert whole.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    chunks = list(
        api.completions.create(
            model="tiny", prompt=texts, max_tokens=MAX_NEW, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    texts_by_index = ["", "", ""]
    finished = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts_by_index[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert texts_by_index == want and sorted(finished) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == sum(len(ids) for ids in greedy)


def test_one_refused_prompt_refuses_the_list_and_leaves_nothing_running(server, texts):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).completions.create(model="tiny", prompt=[texts[0], "x" * 400], max_tokens=4)
    assert refused.value.param == "prompt"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "dflash_trt_requests_running 0.0" in metrics and "dflash_trt_requests_waiting 0.0" in metrics


# --- tokens, models, methods ------------------------------------------------------------------------------------


def test_tokenize_and_detokenize_in_vllms_shapes(server, tokenizer, texts):
    text = texts[1]
    got = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": text}).json()
    assert got["tokens"] == tokenizer.encode(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == client(server).models.retrieve("tiny").model_extra["max_model_len"]
    strs = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(tokenizer.encode(text))
    messages = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    back = httpx.post(f"{server.url}/detokenize", json={"model": "tiny", "tokens": got["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(got["tokens"])}
    for path, body, param, status in (
        ("/tokenize", {"prompt": "x", "messages": messages}, "prompt", 400),
        ("/tokenize", {}, "prompt", 400),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model", 404),
        ("/detokenize", {"tokens": [10**6]}, "tokens", 400),
        ("/detokenize", {"tokens": "abc"}, "tokens", 400),
    ):
        answer = httpx.post(f"{server.url}{path}", json=body)
        assert answer.status_code == status and answer.json()["error"]["param"] == param, (path, body)


def test_a_model_is_found_by_its_id_and_wrong_methods_are_405(server):
    card = client(server).models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("other")
    assert httpx.head(f"{server.url}/health").status_code == 200
    for method, path, allowed in (("POST", "/health", "GET"), ("GET", "/v1/completions", "POST")):
        answer = httpx.request(method, f"{server.url}{path}")
        assert answer.status_code == 405 and allowed in answer.headers["allow"], (method, path)
        assert answer.json()["error"]["code"] == 405


def test_a_refusal_is_logged_with_its_reason_and_an_answer_is_not(server, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        for body in ({"prompt": "x", "stream_options": {"bogus": True}}, {"prompt": "x", "top_p": 0.5}):
            assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 400
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 2 and "stream_options.bogus" in refusals[0] and "top_p 0.5 refused" in refusals[1]


# --- the tiny pair's chat template, and serve --chat_template ---------------------------------------------------


def test_the_tiny_pair_chats_as_it_completes(server, tokenizer, texts, greedy):
    """Its template renders a user message as a problem line, so chat answers what completions answers."""
    api = client(server)
    for text, ids in zip(texts, greedy, strict=True):
        messages = [{"role": "user", "content": text.strip()}]
        got = api.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW, temperature=0)
        assert got.choices[0].message.content == decoded(tokenizer, ids)
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "be brief"}], max_tokens=2)
    assert "user and assistant messages" in refused.value.message


def test_serve_chat_template_replaces_the_tokenizers_and_refuses_a_broken_file(tiny, tmp_path, capsys):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }\n")
    argv = ["serve", "--checkpoint_dir", str(tiny), "--port", "0"]
    for path, message in ((broken, "line 1"), (tmp_path / "missing.jinja", "does not exist"), (tmp_path, "not a file")):
        assert main([*argv, "--chat_template", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and "chat template" in err[0]


def test_serve_chat_template_file_is_the_one_chat_renders(engine, tiny, tmp_path):
    from dflash_trt.tokenizer import read_chat_template

    template = tmp_path / "shout.jinja"
    template.write_text("{% for m in messages %}{{ m.content | upper }}{{ '\\n' }}{% endfor %}")
    tokenizer = load_tokenizer(tiny)
    tokenizer.chat_template = read_chat_template(template)
    with RunningServer(make_app(emulated_target(engine), tokenizer, "tiny")) as shouting:
        got = httpx.post(f"{shouting.url}/tokenize", json={"messages": [{"role": "user", "content": "add 1 2"}]})
    assert got.json()["tokens"] == tokenizer.encode("ADD 1 2\n", add_special_tokens=False)


def test_tokenizer_info_lets_a_client_tokenize_and_template_as_the_server_does(server, tokenizer):
    """What lm-eval's remote tokenizer reads: the special tokens and the chat template, as the tokenizer has them."""
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["pad_token"] == tokenizer.pad_token
    assert info["chat_template"] == tokenizer.chat_template and info["bos_token"] is None
    assert info["model_max_length"] == client(server).models.retrieve("tiny").model_extra["max_model_len"]


def test_metrics_help_texts_say_what_docs_serving_md_says(server):
    """Each metric's HELP and type, as `prometheus_client`'s parser reads them, against the table in the docs."""
    from prometheus_client.parser import text_string_to_metric_families

    docs = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    table = {}
    for line in docs.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`dflash_trt_"):
            name = cells[0].strip("`").split("{")[0].removesuffix("_total")
            table[name] = (cells[1], cells[2])
    exposed = text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
    families = {f.name: f for f in exposed if not f.name.endswith("_created")}  # the client library's own
    assert set(families) == set(table)
    for name, family in families.items():
        kind, meaning = table[name]
        assert kind == family.type and meaning.startswith(family.documentation), name
