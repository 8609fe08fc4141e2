"""`dflash-trt serve` through the official `openai` client against a real uvicorn server on the CPU-emulated engine.

Oracles: `dflash-trt generate` (the golden loop) for greedy outputs and `dflash-trt emulate --temperature T --seed S`
for sampled ones (prompt i of an emulate run is seeded S + i), both run through the CLI; the tokenizer's own
`decode` for the text; `prometheus_client`'s parser for /metrics. Chat prompts are rendered with a chat template
written into a copy of the tiny pair's tokenizer folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from _server import RunningServer
from prometheus_client.parser import text_string_to_metric_families

from dflash_trt.cli import main
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.executors.emulated import EmulatedExecutor
from dflash_trt.reference.loop_rules import longest_request
from dflash_trt.server.launch import make_app
from dflash_trt.server.params import Limits
from dflash_trt.server.targets import ServeTarget
from dflash_trt.tiny.heldout import load_heldout
from dflash_trt.tokenizer import load_tokenizer

MAX_NEW = 24
JSON = {"Content-Type": "application/json"}
TEMPERATURE, SEED = 3.0, 1234
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and not enable_thinking %} /q"
    "{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tiny, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer_dir):
    return load_tokenizer(chat_tokenizer_dir)


@pytest.fixture(scope="module")
def engine(tiny) -> EmulatedEngine:
    return EmulatedEngine(tiny, max_batch_size=4, tokens_per_block=16)


def emulated_target(engine: EmulatedEngine, max_seq_len: int | None = None) -> ServeTarget:
    max_seq_len = max_seq_len or longest_request(engine.max_position_embeddings, engine.k)
    eos = frozenset(engine.eos_token_ids)
    return ServeTarget(
        executor=EmulatedExecutor(engine, max_seq_len, sorted(eos)),
        max_batch_size=engine.max_batch_size,
        limits=Limits(max_seq_len=max_seq_len, vocab_size=engine.vocab_size),
        eos_token_ids=eos,
        engine_stops_at_eos=True,
    )


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with RunningServer(make_app(emulated_target(engine), tokenizer, "tiny")) as running:
        yield running


def client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, **kwargs)


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def cli_json(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


def oracle_report(command: str, tiny: Path, tmp: Path, lines: list[dict], *extra: str) -> dict:
    prompts = tmp / f"{command}-{len(list(tmp.iterdir()))}.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = [command, "--checkpoint_dir", str(tiny), "--input_file", str(prompts), "--max_new_tokens", str(MAX_NEW)]
    return cli_json([*argv, *extra, "--json"])


def oracle(command: str, tiny: Path, tmp: Path, lines: list[dict], *extra: str) -> list[list[int]]:
    return [s["output_ids"] for s in oracle_report(command, tiny, tmp, lines, *extra)["sequences"]]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [item.text for item in load_heldout(limit=3)] + ["count 12"]


@pytest.fixture(scope="module")
def greedy(tiny, texts, tmp_path_factory) -> list[list[int]]:
    return oracle("generate", tiny, tmp_path_factory.mktemp("greedy"), [{"text": t} for t in texts])


@pytest.fixture(scope="module")
def sampled(tiny, texts, tmp_path_factory) -> list[list[int]]:
    """Prompt i sampled with seed SEED + i."""
    lines = [{"text": t} for t in texts]
    extra = ("--temperature", str(TEMPERATURE), "--seed", str(SEED), "--max_batch_size", "4")
    return oracle("emulate", tiny, tmp_path_factory.mktemp("sampled"), lines, *extra)


def expected(tokenizer, ids: list[int]) -> tuple[str, int, str]:
    """Text, completion tokens and finish reason of an oracle's output ids."""
    finish = "stop" if ids[-1] == tokenizer.eos_token_id else "length"
    return tokenizer.decode(ids, skip_special_tokens=True), len(ids), finish


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completions_greedy_equal_generate_whole_and_streamed(server, tokenizer, texts, greedy):
    api = client(server)
    for text, ids in zip(texts, greedy, strict=True):
        want_text, want_tokens, want_finish = expected(tokenizer, ids)
        whole = api.completions.create(model="tiny", prompt=text, max_tokens=MAX_NEW, temperature=0)
        assert whole.choices[0].text == want_text and whole.choices[0].finish_reason == want_finish
        assert whole.usage.completion_tokens == want_tokens
        assert whole.usage.prompt_tokens == len(tokenizer.encode(text))
        chunks = list(
            api.completions.create(
                model="tiny",
                prompt=text,
                max_tokens=MAX_NEW,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want_text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want_finish
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want_tokens


def test_completions_with_token_id_prompts_equal_generate(server, tokenizer, texts, greedy):
    whole = client(server).completions.create(
        model="tiny", prompt=tokenizer.encode(texts[0]), max_tokens=MAX_NEW, temperature=0
    )
    assert whole.choices[0].text == expected(tokenizer, greedy[0])[0]


def test_token_ids_whole_and_per_iteration_equal_generate(server, tiny, texts, tmp_path):
    """Each streamed chunk carries one engine iteration's tokens: the first token, then each step's acceptance."""
    report = oracle_report("generate", tiny, tmp_path, [{"text": t} for t in texts])
    api = client(server)
    ids = {"return_token_ids": True}
    for text, want in zip(texts, report["sequences"], strict=True):
        whole = api.completions.create(model="tiny", prompt=text, max_tokens=MAX_NEW, temperature=0, extra_body=ids)
        assert whole.choices[0].token_ids == want["output_ids"]
        chunks = api.completions.create(
            model="tiny", prompt=text, max_tokens=MAX_NEW, temperature=0, stream=True, extra_body=ids
        )
        per_iteration = [c.choices[0].token_ids for c in chunks if c.choices and c.choices[0].token_ids]
        assert sum(per_iteration, []) == want["output_ids"]
        assert [len(r) for r in per_iteration] == [1, *want["acceptance_lengths"]]


def test_sampled_completions_equal_emulate_with_the_same_seed(server, tokenizer, texts, greedy, sampled):
    assert sampled != greedy  # the temperature is high enough to show whether it is honoured
    api = client(server)
    for i, (text, ids) in enumerate(zip(texts, sampled, strict=True)):
        got = api.completions.create(
            prompt=text, max_tokens=MAX_NEW, temperature=TEMPERATURE, seed=SEED + i, model="tiny"
        )
        assert got.choices[0].text == expected(tokenizer, ids)[0]
        assert got.usage.completion_tokens == len(ids)


def test_eight_concurrent_async_streams_each_equal_their_oracle(server, tokenizer, texts, greedy, sampled):
    """Greedy and sampled streams in flight together (more than the engine's 4 slots: some queue)."""

    async def stream(api: openai.AsyncOpenAI, i: int) -> str:
        k = i % len(texts)
        sampling = {"temperature": 0} if i < len(texts) else {"temperature": TEMPERATURE, "seed": SEED + k}
        chunks = await api.completions.create(
            model="tiny", prompt=texts[k], max_tokens=MAX_NEW, stream=True, **sampling
        )
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def run() -> list[str]:
        api = async_client(server)
        return await asyncio.gather(*(stream(api, i) for i in range(8)))

    got = asyncio.run(run())
    want = [expected(tokenizer, ids)[0] for ids in greedy + sampled]
    assert got == want


def chat_ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_equals_generate_on_the_rendered_template_with_its_kwargs(server, tiny, tokenizer, tmp_path):
    messages = [{"role": "system", "content": "count"}, {"role": "user", "content": "count 8644"}]
    plain, no_think = chat_ids(tokenizer, messages), chat_ids(tokenizer, messages, enable_thinking=False)
    assert plain != no_think
    want = oracle("generate", tiny, tmp_path, [{"input_ids": plain}, {"input_ids": no_think}])
    api = client(server)
    whole = api.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=MAX_NEW, temperature=0)
    text, tokens, finish = expected(tokenizer, want[0])
    assert whole.choices[0].message.content == text and whole.choices[0].finish_reason == finish
    assert whole.usage.prompt_tokens == len(plain) and whole.usage.completion_tokens == tokens
    chunks = list(
        api.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=MAX_NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected(tokenizer, want[1])[0]
    assert chunks[-1].usage.prompt_tokens == len(no_think)


async def _async_chat(server, messages):
    api = async_client(server)
    return await api.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW, temperature=0)


def test_async_chat_whole_equals_sync(server):
    messages = [{"role": "user", "content": "add 12 34"}]
    got = asyncio.run(_async_chat(server, messages))
    want = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content


def test_stop_strings_and_stop_ids_cut_the_greedy_output(server, tokenizer, texts, greedy):
    api = client(server)
    ids = greedy[0]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stop = full[5:7]
    cut = full[: full.index(stop)]
    whole = api.completions.create(model="tiny", prompt=texts[0], max_tokens=MAX_NEW, temperature=0, stop=[stop])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    streamed = api.completions.create(
        model="tiny", prompt=texts[0], max_tokens=MAX_NEW, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut
    at = 6
    by_id = api.completions.create(
        model="tiny", prompt=texts[0], max_tokens=MAX_NEW, temperature=0, extra_body={"stop_token_ids": [ids[at]]}
    )
    first = ids.index(ids[at])
    assert by_id.choices[0].text == tokenizer.decode(ids[:first], skip_special_tokens=True)
    assert by_id.usage.completion_tokens == first + 1 and by_id.choices[0].finish_reason == "stop"


def test_a_stop_string_beside_a_stop_id_in_one_iteration_is_never_sent(server, tokenizer, texts, greedy):
    """The stop string "0=" completes in an engine iteration that also holds a stop id: the text ends before the
    string, and the token ids and usage run up to the token that completed it (the stop id is never reached)."""
    api, ids = client(server), greedy[0]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stop = "0="
    last = next(k for k in range(len(ids)) if stop in tokenizer.decode(ids[: k + 1], skip_special_tokens=True))
    plain = {"model": "tiny", "prompt": texts[0], "max_tokens": MAX_NEW, "temperature": 0}
    iterations, start = [], 0
    for chunk in api.completions.create(**plain, stream=True, extra_body={"return_token_ids": True}):
        if chunk.choices and chunk.choices[0].token_ids:
            iterations.append(range(start, start + len(chunk.choices[0].token_ids)))
            start += len(chunk.choices[0].token_ids)
    same = next(r for r in iterations if last in r)
    stop_id = next(ids[i] for i in same if i > last and ids.index(ids[i]) > last)
    extra = {"stop_token_ids": [stop_id], "return_token_ids": True}
    whole = api.completions.create(**plain, stop=stop, extra_body=extra)
    assert whole.choices[0].text == full[: full.index(stop)] and whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].token_ids == ids[: last + 1] and whole.usage.completion_tokens == last + 1
    chunks = list(api.completions.create(**plain, stop=stop, stream=True, stream_options={"include_usage": True},
                                         extra_body=extra))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full[: full.index(stop)]
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids or []] == ids[: last + 1]
    assert chunks[-1].usage.completion_tokens == last + 1


REFUSED = [
    ("completions", {"n": 2}, "n"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"top_p": 0.9}, "top_p"),
    ("completions", {"extra_body": {"top_k": 5}}, "top_k"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -0.5}, "frequency_penalty"),
    ("completions", {"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty"),
    ("completions", {"extra_body": {"min_p": 0.1}}, "min_p"),
    ("completions", {"logprobs": 2}, "logprobs"),
    ("completions", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": 10_000}, "max_tokens"),
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"seed": -3}, "seed"),
    ("completions", {"stop": [""]}, "stop"),
    ("completions", {"extra_body": {"stop_token_ids": [10_000]}}, "stop_token_ids"),
    ("completions", {"extra_body": {"ignore_this": 1}}, "ignore_this"),
    ("completions", {"prompt": "x" * 300}, "prompt"),
    ("completions", {"extra_body": {"ignore_eos": True}}, "ignore_eos"),
    ("completions", {"prompt": [5, 10_000]}, "prompt"),
    ("chat", {"n": 2}, "n"),
    ("chat", {"top_p": 0.5}, "top_p"),
    ("chat", {"logprobs": True}, "logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"presence_penalty": 1.0}, "presence_penalty"),
    ("chat", {"extra_body": {"chat_template_kwargs": {"tokenize": True}}}, "chat_template_kwargs"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
]


@pytest.mark.parametrize(("endpoint", "kwargs", "param"), REFUSED, ids=[f"{e}-{p}" for e, _, p in REFUSED])
def test_every_parameter_the_engine_cannot_honour_gets_400_naming_it(server, endpoint, kwargs, param):
    api = client(server)
    with pytest.raises(openai.BadRequestError) as refused:
        if endpoint == "completions":
            api.completions.create(**{"model": "tiny", "prompt": "add 1 2", "max_tokens": 4, **kwargs})
        else:
            messages = [{"role": "user", "content": "add 1 2"}]
            api.chat.completions.create(**{"model": "tiny", "messages": messages, "max_tokens": 4, **kwargs})
    assert refused.value.status_code == 400 and refused.value.type == "invalid_request_error"
    if param is not None:
        assert refused.value.param == param and param in refused.value.message


def test_malformed_bodies_and_unknown_models(server):
    for body in (b"{", b"[1, 2]", b'{"prompt": "x", "max_tokens": "many"}', b'{"max_tokens": 2}'):
        answer = httpx.post(f"{server.url}/v1/completions", content=body, headers=JSON)
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
    for field, value in (("max_tokens", True), ("max_tokens", 2.5), ("temperature", "hot"), ("stream", "yes")):
        answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": "add 1 2", field: value})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field
    answer = httpx.post(
        f"{server.url}/v1/completions", content=b'{"prompt": "add 1 2", "temperature": NaN}', headers=JSON
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="other", prompt="add 1 2", max_tokens=2)


def test_metrics_parse_and_count_what_was_served(server, tokenizer, texts):
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{server.url}/metrics").text
        return {
            sample.name + json.dumps(sample.labels, sort_keys=True): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    before = scrape()
    got = client(server).completions.create(
        model="tiny", prompt=texts[3], max_tokens=MAX_NEW, temperature=0, stream=True
    )
    pieces = list(got)
    assert pieces
    after = scrape()

    def delta(name: str, **labels: str) -> float:
        key = name + json.dumps(labels, sort_keys=True)
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("dflash_trt_requests_total", endpoint="completions", status="200") == 1
    assert delta("dflash_trt_prompt_tokens_total") == len(tokenizer.encode(texts[3]))
    assert delta("dflash_trt_time_to_first_token_seconds_count") == 1
    produced = delta("dflash_trt_generation_tokens_total")
    assert 1 <= produced <= MAX_NEW
    assert delta("dflash_trt_acceptance_length_sum") == produced - 1  # every iteration after the first
    assert after["dflash_trt_requests_running{}"] == 0 and after["dflash_trt_requests_waiting{}"] == 0


def test_chat_without_a_template_is_a_clear_400(engine, tiny):
    untemplated = load_tokenizer(tiny)
    untemplated.chat_template = None
    with RunningServer(make_app(emulated_target(engine), untemplated, "tiny")) as bare:
        with pytest.raises(openai.BadRequestError) as refused:
            client(bare).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.param == "messages" and "chat template" in refused.value.message


def test_bench_over_the_openai_url_measures_what_generate_decodes(server, tiny, chat_tokenizer_dir, texts, tmp_path):
    """`bench --openai_url` records each request's tokens and per-iteration acceptance from the streamed chunks,
    and says in its provenance that it measured that OpenAI server."""
    report = oracle_report("generate", tiny, tmp_path, [{"text": t} for t in texts])
    prompts = tmp_path / "bench.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "bench"
    argv = ["bench", "--openai_url", f"{server.url}/v1", "--input_file", str(prompts), "--concurrency", "2"]
    argv += ["--max_new_tokens", str(MAX_NEW), "--tokenizer_dir", str(chat_tokenizer_dir), "--output_dir", str(out)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert (results["provenance"]["backend"], results["provenance"]["target"]) == ("openai", f"{server.url}/v1")
    point = results["points"][0]
    assert point["failed"] == 0 and point["requests"] == len(texts)
    for entry in point["per_request"]:
        want = report["sequences"][entry["prompt_index"]]
        assert entry["output_ids"] == want["output_ids"] and entry["acceptance"] == want["acceptance_lengths"]


def test_bench_refuses_an_unreachable_openai_url(tmp_path, capsys):
    argv = ["bench", "--openai_url", "http://127.0.0.1:9/v1", "--synthetic", "8,8,2", "--vocab_size", "100"]
    assert main([*argv, "--concurrency", "1", "--output_dir", str(tmp_path / "out")]) == 2
    assert "cannot reach an OpenAI server at http://127.0.0.1:9/v1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
