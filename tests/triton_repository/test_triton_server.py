"""A real Triton Inference Server (2.51, python backend; `.ci/install_tritonserver.sh`, run by `make test`) serving
the CPU-served repository that `dflash-trt triton --checkpoint_dir` writes for the tiny pair (max_batch_size 2).

Oracles: the golden loop (`speculative_generate`) on each prompt for greedy tokens and text, the emulated engine
decoding the same request in this process for seeded sampling, the shipped client and bench's Triton backend as
the clients. One server for the module, on loopback ports, always killed at the end.
"""

from __future__ import annotations

import asyncio
import json
import queue
import shutil
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from _poisoned import POISONED_TOKEN
from _tritonserver import TRITONSERVER, RunningServer

from dflash_trt.bench.driver import run_load
from dflash_trt.clients.triton import TritonExecutor
from dflash_trt.clients.triton_http import TritonHttpExecutor
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.executors.contract import Request
from dflash_trt.executors.emulated import EmulatedStepper
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.sampling_rules import Sampling
from dflash_trt.tiny.heldout import load_heldout
from dflash_trt.tokenizer import load_tokenizer
from dflash_trt.triton import client as triton_client
from dflash_trt.triton import processing as P
from dflash_trt.triton.repository import settings_from_checkpoint, write_repository

grpcclient = pytest.importorskip("tritonclient.grpc")

MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")
MAX_NEW = 16
MAX_SEQ_LEN = 224  # within the longest request the tiny target holds (256 positions less two draft blocks: 226)

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not TRITONSERVER.is_file(), reason="no tritonserver: run `make tritonserver`"),
]


@pytest.fixture(scope="module")
def checkpoint(tiny: Path) -> Path:
    return tiny


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("triton")
    settings = settings_from_checkpoint(checkpoint, checkpoint, max_batch_size=2, max_seq_len=MAX_SEQ_LEN)
    repo = write_repository(settings, root / "repo")
    with RunningServer(repo, root / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(checkpoint)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [item.text for item in load_heldout(limit=3)]


@pytest.fixture(scope="module")
def golden(checkpoint):
    return load_golden_model(checkpoint)


def _greedy_text(golden, tokenizer, text: str) -> str:
    prompt = tokenizer.encode(text)
    stops = list(golden.target.spec.eos_token_ids)
    ids = speculative_generate(golden, [prompt], MAX_NEW, stops)[0].output_ids
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_every_model_is_ready(server):
    client = grpcclient.InferenceServerClient(server.url)
    try:
        assert all(client.is_model_ready(name) for name in MODELS)
    finally:
        client.close()


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_greedy_text_over_grpc_streaming_equals_the_golden_loop(server, golden, tokenizer, texts, model):
    for text in texts:
        gen = triton_client.stream_generate(server.url, text, MAX_NEW, model=model, temperature=0.0, timeout_s=120)
        assert gen.errors == []
        assert gen.text == _greedy_text(golden, tokenizer, text)
        assert gen.draft_tokens is not None and gen.draft_tokens % 15 == 0  # K = 15 drafts per verify step


def _http_stream(server, model: str, body: dict) -> list[dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http}/v2/models/{model}/generate_stream",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: ") :]))
    return events


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_http_generate_stream_equals_the_golden_loop(server, golden, tokenizer, texts, model):
    events = _http_stream(server, model, {"text_input": texts[0], "max_tokens": MAX_NEW, "stream": True})
    assert all("error" not in e for e in events)
    assert "".join(e.get("text_output", "") for e in events) == _greedy_text(golden, tokenizer, texts[0])


def _emulated(checkpoint, prompt: list[int], temperature: float, seed: int, stops=()) -> list[int]:
    stepper = EmulatedStepper(EmulatedEngine(checkpoint, max_batch_size=2), MAX_SEQ_LEN)
    try:
        sampling = Sampling(temperature=temperature, seed=seed)
        stop_words = tuple((s,) for s in stops)
        decoding = stepper.add(
            0, Request(input_ids=prompt, max_new_tokens=MAX_NEW, sampling=sampling, stop_words=stop_words)
        )
        while stepper.has_work():
            stepper.step()
        return decoding.output
    finally:
        stepper.close()


def test_seeded_sampling_equals_the_emulated_engine(server, checkpoint, golden, tokenizer, texts):
    prompt = tokenizer.encode(texts[1])
    stops = list(golden.target.spec.eos_token_ids)
    for seed in (3, 4):
        expected = _emulated(checkpoint, prompt, 0.9, seed, stops)
        gen = triton_client.stream_generate(
            server.url, texts[1], MAX_NEW, model="tensorrt_llm_bls", temperature=0.9, seed=seed, timeout_s=120
        )
        assert gen.errors == [] and gen.text == tokenizer.decode(expected, skip_special_tokens=True)


def _stream_raw(
    server, model: str, inputs: list, timeout_s: float = 120, request_id: str = ""
) -> tuple[list, list[str]]:
    """Every response of one streamed request, and its errors."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.url)
    results, errors = [], []
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=timeout_s)
            if error is not None:
                errors.append(str(error))
                break
            results.append(result)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    return results, errors


def _tensor(name: str, array: np.ndarray, dtype: str):
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def _llm_inputs(prompt: list[int], max_new: int, **extra) -> list:
    inputs = [
        _tensor(P.LLM_INPUT_IDS, np.array([prompt], np.int32), "INT32"),
        _tensor(P.LLM_INPUT_LENGTHS, np.array([[len(prompt)]], np.int32), "INT32"),
        _tensor(P.LLM_REQUEST_OUTPUT_LEN, np.array([[max_new]], np.int32), "INT32"),
        _tensor(P.LLM_STREAMING, np.array([[True]]), "BOOL"),
    ]
    dtypes = {np.dtype(np.float32): "FP32", np.dtype(np.uint64): "UINT64", np.dtype(np.int32): "INT32"}
    return inputs + [_tensor(name, value, dtypes[value.dtype]) for name, value in extra.items()]


def _split_character_tokenizer(checkpoint: Path, lead: str, continuation: str, out: Path) -> Path:
    """The checkpoint's tokenizer, encoding as before, but decoding `lead` and `continuation` as the two UTF-8
    bytes of "é" (0xC3 0xA9): a character that spans two tokens, for a model that never learned one."""
    out.mkdir()
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(checkpoint / name, out / name)
    spec = json.loads((checkpoint / "tokenizer.json").read_text())
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": lead}, "content": "<0xC3>"},
            {"type": "Replace", "pattern": {"String": continuation}, "content": "<0xA9>"},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ],
    }
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def _ensemble_inputs(text: str) -> list:
    return [
        _tensor("text_input", np.array([[text.encode()]], object), "BYTES"),
        _tensor("max_tokens", np.array([[MAX_NEW]], np.int32), "INT32"),
        _tensor("stream", np.array([[True]]), "BOOL"),
    ]


def _pieces(results: list) -> list[str]:
    arrays = [r.as_numpy(P.TEXT_OUTPUT) for r in results]
    return [b"".join(a.ravel()).decode("utf-8") for a in arrays if a is not None]


def test_streamed_ensemble_text_never_splits_a_character(server, checkpoint, golden, tokenizer, texts, tmp_path):
    """The last token of tensorrt_llm's first streamed response and the first of its second become the two bytes
    of one character; a server whose tokenizer decodes them so must stream that character whole through the
    ensemble to clients that send a request id (gRPC `request_id`, HTTP `id`), concurrent requests included."""
    prompt = tokenizer.encode(texts[0])
    greedy = np.array([[0.0]], np.float32)
    results, errors = _stream_raw(server, "tensorrt_llm", _llm_inputs(prompt, MAX_NEW, temperature=greedy))
    chunks = [
        r.as_numpy(P.LLM_OUTPUT_IDS).ravel().tolist() for r in results if r.as_numpy(P.LLM_OUTPUT_IDS) is not None
    ]
    assert errors == [] and len(chunks) >= 2
    lead, continuation = tokenizer.convert_ids_to_tokens([chunks[0][-1], chunks[1][0]])
    assert lead != continuation and not {lead, continuation} & set("<0xC3A9>")  # replaced one after the other
    split_dir = _split_character_tokenizer(checkpoint, lead, continuation, tmp_path / "split_tokenizer")
    expected = _greedy_text(golden, load_tokenizer(split_dir), texts[0])
    assert "é" in expected
    settings = settings_from_checkpoint(checkpoint, split_dir, max_batch_size=2, max_seq_len=MAX_SEQ_LEN)
    with RunningServer(write_repository(settings, tmp_path / "repo"), tmp_path / "server.log") as split_server:
        results, errors = _stream_raw(split_server, "ensemble", _ensemble_inputs(texts[0]))
        assert errors == [] and "".join(_pieces(results)) != expected  # without an id: each response on its own
        with ThreadPoolExecutor(2) as pool:
            streams = pool.map(
                lambda rid: _stream_raw(split_server, "ensemble", _ensemble_inputs(texts[0]), request_id=rid),
                ["first", "second"],
            )
            for results, errors in streams:
                assert errors == [] and "".join(_pieces(results)) == expected
        body = {"id": "over-http", "text_input": texts[0], "max_tokens": MAX_NEW, "stream": True}
        events = _http_stream(split_server, "ensemble", body)
        assert all("error" not in e for e in events)
        assert "".join(e.get("text_output", "") for e in events) == expected


def test_tensorrt_llm_samples_at_one_when_no_temperature_is_sent(server, checkpoint):
    """The C++ backend's default: an absent temperature is 1.0, an absent seed 0 (on a prompt where the tiny pair is
    unsure, so that differs from greedy)."""
    prompt = [5, 90, 33, 7, 64, 2]
    results, errors = _stream_raw(server, "tensorrt_llm", _llm_inputs(prompt, MAX_NEW))
    assert errors == []
    chunks = [r.as_numpy(P.LLM_OUTPUT_IDS).ravel() for r in results if r.as_numpy(P.LLM_OUTPUT_IDS) is not None]
    tokens = [int(t) for chunk in chunks for t in chunk]
    assert tokens == _emulated(checkpoint, prompt, 1.0, 0) != _emulated(checkpoint, prompt, 0.0, 0)


@pytest.mark.parametrize(
    ("model", "inputs", "message"),
    [
        ("ensemble", {"top_p": np.array([[0.5]], np.float32)}, "top_p"),
        ("tensorrt_llm_bls", {"temperature": np.array([[-1.0]], np.float32)}, "temperature"),
    ],
)
def test_refusals_come_back_as_errors(server, model, inputs, message):
    tensors = [
        _tensor("text_input", np.array([[b"hello"]], object), "BYTES"),
        _tensor("max_tokens", np.array([[4]], np.int32), "INT32"),
        _tensor("stream", np.array([[True]]), "BOOL"),
        *(_tensor(name, value, "FP32") for name, value in inputs.items()),
    ]
    _, errors = _stream_raw(server, model, tensors)
    assert len(errors) == 1 and message in errors[0]


def test_tensorrt_llm_refuses_bad_words_and_out_of_vocabulary_prompts(server):
    bad = np.array([[[5], [1]]], np.int32)
    _, errors = _stream_raw(server, "tensorrt_llm", _llm_inputs([1, 2], 4, bad_words_list=bad))
    assert len(errors) == 1 and "bad_words_list refused" in errors[0]
    _, errors = _stream_raw(server, "tensorrt_llm", _llm_inputs([1, 100000], 4))
    assert len(errors) == 1 and "outside the vocabulary" in errors[0]


def test_a_client_that_disconnects_frees_its_slot(server, tokenizer, texts):
    """Both slots taken by long requests whose clients leave after the first token: a third request then starts at
    once instead of waiting for one of them to finish."""
    prompt = tokenizer.encode(texts[0])
    long_new = MAX_SEQ_LEN - len(prompt)
    start = time.perf_counter()
    _, errors = _stream_raw(server, "tensorrt_llm", _llm_inputs(prompt, long_new))
    alone_s = time.perf_counter() - start
    assert errors == []
    clients = []
    for _ in range(2):
        first: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.url)
        client.start_stream(callback=lambda result, error, q=first: q.put((result, error)))
        client.async_stream_infer("tensorrt_llm", _llm_inputs(prompt, long_new))
        clients.append((client, first))
    for client, first in clients:
        result, error = first.get(timeout=60)
        assert error is None
        client.stop_stream(cancel_requests=True)
        client.close()
    start = time.perf_counter()
    results, errors = _stream_raw(server, "tensorrt_llm", _llm_inputs(prompt, 4))
    assert errors == [] and time.perf_counter() - start < alone_s / 3


def _tokens(results: list) -> list[int]:
    arrays = [r.as_numpy(P.LLM_OUTPUT_IDS) for r in results]
    return [int(t) for a in arrays if a is not None for t in a.ravel()]


def _is_final(result) -> bool:
    final = result.get_response().parameters.get("triton_final_response")
    return final is not None and final.bool_param


def _finished(responses: queue.Queue) -> bool:
    """Whether the responses received so far (still in `responses`) hold the final one."""
    return any(result is not None and _is_final(result) for result, _ in list(responses.queue))


def test_a_request_that_breaks_the_engine_fails_alone(poisoned_tiny, golden, tokenizer, texts, tmp_path):
    """A long greedy stream in flight while three requests beside it go wrong, on a server over the checkpoint with
    one poisoned token: a sampled request holding it makes the engine raise (its error comes back as a final
    response), temperature 1e-40 (a float32 whose inverse is inf) decodes greedily, and a request longer than the
    repository's max_seq_len is refused. The stream is not touched: it ends with the golden loop's tokens."""
    settings = settings_from_checkpoint(poisoned_tiny, poisoned_tiny, max_batch_size=2, max_seq_len=MAX_SEQ_LEN)
    running = RunningServer(write_repository(settings, tmp_path / "repo"), tmp_path / "server.log")
    prompt = tokenizer.encode(texts[0])
    long_new = 100
    with running:
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(running.url)
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(
            "tensorrt_llm", _llm_inputs(prompt, long_new, temperature=np.array([[0.0]], np.float32)),
            enable_empty_final_response=True,
        )  # fmt: skip
        streamed = [responses.get(timeout=120)]  # the stream is in the engine
        poisoned = [*prompt[:3], POISONED_TOKEN, *prompt[3:]]
        hot = {"temperature": np.array([[1.0]], np.float32)}
        _, errors = _stream_raw(running, "tensorrt_llm", _llm_inputs(poisoned, 8, **hot))
        assert len(errors) == 1 and "the engine failed on this request: EmulationError" in errors[0]
        assert not _finished(responses)
        tiny_t = {"temperature": np.array([[1e-40]], np.float32), "random_seed": np.array([[3]], np.uint64)}
        results, errors = _stream_raw(running, "tensorrt_llm", _llm_inputs(prompt, MAX_NEW, **tiny_t))
        assert errors == [] and _tokens(results) == speculative_generate(golden, [prompt], MAX_NEW)[0].output_ids
        _, errors = _stream_raw(running, "tensorrt_llm", _llm_inputs(prompt, MAX_SEQ_LEN))
        assert len(errors) == 1 and f"exceeds max_seq_len {MAX_SEQ_LEN}" in errors[0]
        while streamed[-1][1] is None and not _is_final(streamed[-1][0]):
            streamed.append(responses.get(timeout=120))
        client.stop_stream()
        client.close()
        assert all(error is None for _, error in streamed)
        assert _tokens([r for r, _ in streamed]) == speculative_generate(golden, [prompt], long_new)[0].output_ids


@pytest.mark.parametrize("concurrency", [1, 2, 4])
@pytest.mark.parametrize("model", ["tensorrt_llm", "tensorrt_llm_bls", "ensemble"])
def test_bench_tokens_equal_the_golden_loop(server, golden, tokenizer, texts, model, concurrency):
    """Token ids from tensorrt_llm; from the text models, the streamed text re-tokenized (ids equal where the text
    round-trips, so the text is compared)."""
    prompts = [tokenizer.encode(t) for t in texts]
    stops = [] if model == "tensorrt_llm" else list(golden.target.spec.eos_token_ids)  # preprocessing's end_id
    expected = [speculative_generate(golden, [p], MAX_NEW, stops)[0].output_ids for p in prompts]
    requests = [Request(input_ids=p, max_new_tokens=MAX_NEW) for p in prompts] * 2
    indices = list(range(len(prompts))) * 2
    backend = TritonExecutor(server.url, model=model, vocab_size=golden.target.spec.vocab_size, tokenizer=tokenizer)
    trace = asyncio.run(run_load(backend, requests, prompt_indices=indices, concurrency=concurrency, timeout_s=300))
    assert len(trace.records) == len(requests)
    for record in trace.records:
        assert record.error is None
        if model == "tensorrt_llm":
            assert record.output_ids == expected[record.prompt_index]
        else:
            text = tokenizer.decode(expected[record.prompt_index], skip_special_tokens=True)
            assert tokenizer.decode(record.output_ids) == text
    assert max(n for _, n in trace.in_flight) == min(concurrency, len(requests))


@pytest.mark.parametrize("concurrency", [1, 2])
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_bench_over_http_generate_stream_equals_the_golden_loop(server, golden, tokenizer, texts, model, concurrency):
    prompts = [tokenizer.encode(t) for t in texts]
    stops = list(golden.target.spec.eos_token_ids)
    expected = [speculative_generate(golden, [p], MAX_NEW, stops)[0].output_ids for p in prompts]
    requests = [Request(input_ids=p, max_new_tokens=MAX_NEW) for p in prompts] * 2
    indices = list(range(len(prompts))) * 2
    backend = TritonHttpExecutor(f"http://127.0.0.1:{server.http}", model=model, tokenizer=tokenizer)
    trace = asyncio.run(run_load(backend, requests, prompt_indices=indices, concurrency=concurrency, timeout_s=300))
    assert len(trace.records) == len(requests)
    for record in trace.records:
        assert record.error is None
        text = tokenizer.decode(expected[record.prompt_index], skip_special_tokens=True)
        assert tokenizer.decode(record.output_ids) == text
    assert max(n for _, n in trace.in_flight) == concurrency


def _stubs(server) -> list[int]:
    """The python stubs the server started (children whose command is the stub)."""
    stubs = []
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if parent == server.process.pid and b"triton_python_backend_stub" in command:
            stubs.append(int(entry.name))
    return stubs


def test_serve_over_triton_refuses_ids_the_model_cannot_take_and_serves_on(server, tokenizer, texts, golden):
    """`serve --triton_url` checks prompt ids against the tokenizer's vocabulary and INT32 before a request leaves:
    each such prompt is a 400 naming the range (before: a 500 from the model, or a request never answered that
    kept its batch slot), and with one batch slot the next request is served with the golden loop's text."""
    from _server import RunningServer

    from dflash_trt.server.launch import make_app
    from dflash_trt.server.targets import triton_target

    eos = list(golden.target.spec.eos_token_ids)
    target = triton_target(server.url, "tensorrt_llm", 1, MAX_SEQ_LEN, eos, False, len(tokenizer))
    with RunningServer(make_app(target, tokenizer, "tiny")) as running:
        for prompt in ([5, 2**31], [5, 2**40], [5, len(tokenizer)], [-1, 5]):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
            answer = httpx.post(f"{running.url}/v1/completions", json=body, timeout=30)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt", (prompt, answer.text)
            if prompt[0] == 5:
                assert f"must lie in [0, {len(tokenizer) - 1}]" in answer.json()["error"]["message"], answer.text
        body = {"model": "tiny", "prompt": texts[0], "max_tokens": MAX_NEW, "temperature": 0}
        answer = httpx.post(f"{running.url}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["text"] == _greedy_text(golden, tokenizer, texts[0])


def _group(pid: int) -> list[int]:
    """The processes still alive in process group `pid` (the server's, which its stubs join)."""
    members = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def test_cancelled_streams_are_closed_and_sigterm_exits_at_once(checkpoint, tokenizer, texts, tmp_path):
    """Streams cancelled by their clients (to tensorrt_llm, the BLS and the ensemble) get their final responses,
    so Triton releases them: SIGTERM then unloads every model and exits well within its exit timeout, leaving no
    python stub behind (before, it waited the whole timeout)."""
    settings = settings_from_checkpoint(checkpoint, checkpoint, max_batch_size=2, max_seq_len=MAX_SEQ_LEN)
    repo = write_repository(settings, tmp_path / "repo")
    with RunningServer(repo, tmp_path / "server.log", exit_timeout_s=120) as running:
        prompt = tokenizer.encode(texts[0])
        text = [
            _tensor("text_input", np.array([[texts[0].encode()]], object), "BYTES"),
            _tensor("max_tokens", np.array([[MAX_NEW]], np.int32), "INT32"),
            _tensor("stream", np.array([[True]]), "BOOL"),
        ]
        cancelled = [
            ("tensorrt_llm", _llm_inputs(prompt, MAX_SEQ_LEN - len(prompt))),
            ("tensorrt_llm", _llm_inputs(prompt, MAX_SEQ_LEN - len(prompt))),
            ("tensorrt_llm_bls", text),  # they cannot cancel their tensorrt_llm request: it runs its 16 tokens
            ("ensemble", text),
        ]
        for model, inputs in cancelled:
            first: queue.Queue = queue.Queue()
            client = grpcclient.InferenceServerClient(running.url)
            client.start_stream(callback=lambda result, error, q=first: q.put((result, error)))
            client.async_stream_infer(model, inputs)
            assert first.get(timeout=60)[1] is None
            client.stop_stream(cancel_requests=True)
            client.close()
        _, errors = _stream_raw(running, "tensorrt_llm", _llm_inputs(prompt, 2))  # steps after the cancels
        assert errors == []
        pid, start = running.process.pid, time.perf_counter()
        running.process.terminate()
        running.process.wait(timeout=150)
        took = time.perf_counter() - start
        deadline = time.monotonic() + 10
        while _group(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert took < running.exit_timeout_s / 2 and _group(pid) == [], (took, _group(pid))
        print(f"SIGTERM after four cancelled streams: exit in {took:.1f} s")


def test_the_server_restarts_and_a_preloaded_library_stays_out_of_the_stubs(server, golden, tokenizer, texts, tmp_path):
    """launch_triton.sh preloads the plugin into the server; each Python model's stub wrapper keeps it out of the
    stubs. A stand-in library (an empty shared object) is preloaded the same way, through the environment."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler for the stand-in preload library")
    (tmp_path / "empty.c").write_text("int dflash_trt_preload_probe(void) { return 1; }\n")
    library = tmp_path / "libpreload_probe.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(tmp_path / "empty.c")], check=True)
    server.stop()
    server.start(LD_PRELOAD=str(library))
    gen = triton_client.stream_generate(server.url, texts[0], MAX_NEW, model="ensemble", temperature=0.0)
    assert gen.errors == [] and gen.text == _greedy_text(golden, tokenizer, texts[0])
    assert str(library) in Path(f"/proc/{server.process.pid}/maps").read_text()
    stubs = _stubs(server)
    assert len(stubs) == 4  # preprocessing, postprocessing, BLS, tensorrt_llm: one instance each
    for pid in stubs:
        assert str(library) not in Path(f"/proc/{pid}/maps").read_text()
        assert b"LD_PRELOAD=" not in Path(f"/proc/{pid}/environ").read_bytes()
    print(f"tritonserver start-up: {server.startup_s:.1f} s, {len(stubs)} stubs")
