"""TensorRT-LLM backend on CPU: engine-directory checks, and its control flow against a scripted executor double.

The double stands in for `tensorrt_llm.bindings.executor` and proves ONLY the backend's control flow (what it
configures, sends and how it turns responses into per-iteration records). Whether the real 1.2.x executor behaves
as the double does was read in its sources (tests/data/trtllm_api.json), not run; `dflash-trt selftest` on a GPU
host is where it is run.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_trt.bench.driver import run_load
from dflash_trt.cli import main
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import FollowerRank, Request, Response
from dflash_trt.executors.trtllm import TrtllmExecutor, inspect_engine
from dflash_trt.sampling_rules import Sampling

CHAIN = [[0], [0, 0], [0, 0, 0]]


def write_engine(root: Path, mode: str = "dflash", library: Path | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "pretrained_config": {
            "vocab_size": 128,
            "eos_token_ids": [0],
            "mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1},
        },
        "build_config": {"max_batch_size": 8},
    }
    (root / "config.json").write_text(json.dumps(config))
    if mode == "dflash":
        (root / "dflash_trt.json").write_text(
            json.dumps({"eagle_choices": CHAIN, "plugin_library": str(library or root / "missing.so")})
        )
    return root


class Recorded:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class ScriptedExecutor:
    """Each await_responses call is one iteration: every running request gets its next chunk.

    A request's chunks are [1, 3, 2] tokens; input token 13 makes the request fail."""

    instances: list = []

    def __init__(self, model_path, model_type, config, leader=True):
        self.model_path, self.model_type, self.config = model_path, model_type, config
        self.leader = leader
        self.requests: dict[int, list | None] = {}
        self.lock = threading.Lock()
        self.shut = False
        self.ids: dict[int, int] = {}  # client id -> the id enqueue_request returned
        self.cancelled: list[int] = []
        self.enqueued: list = []
        ScriptedExecutor.instances.append(self)

    def can_enqueue_requests(self):
        return self.leader

    def enqueue_request(self, request):
        with self.lock:
            self.enqueued.append(request)
            chunks = [[1], [2, 3, 4], [5, 6]] if 13 not in request.kwargs["input_token_ids"] else None
            self.requests[request.kwargs["client_id"]] = chunks
            self.ids[request.kwargs["client_id"]] = 1000 + len(self.ids)
            return self.ids[request.kwargs["client_id"]]

    def await_responses(self, timeout):
        time.sleep(0.001)
        out = []
        with self.lock:
            for client_id, chunks in list(self.requests.items()):
                if chunks is None:
                    out.append(
                        SimpleNamespace(has_error=lambda: True, error_msg="prompt has token 13", client_id=client_id)
                    )
                    del self.requests[client_id]
                    continue
                tokens = chunks.pop(0)
                result = SimpleNamespace(output_token_ids=[tokens], is_final=not chunks)
                out.append(SimpleNamespace(has_error=lambda: False, client_id=client_id, result=result))
                if not chunks:
                    del self.requests[client_id]
        return out

    def cancel_request(self, id):
        with self.lock:
            self.cancelled.append(id)
            self.requests = {c: chunks for c, chunks in self.requests.items() if self.ids[c] != id}

    def shutdown(self):
        self.shut = True


def double(leader=True):
    return SimpleNamespace(
        DecodingConfig=lambda: SimpleNamespace(eagle_config=None),
        EagleConfig=Recorded,
        KvCacheConfig=Recorded,
        ExecutorConfig=Recorded,
        SamplingConfig=Recorded,
        OutputConfig=Recorded,
        Request=Recorded,
        ModelType=SimpleNamespace(DECODER_ONLY="decoder-only"),
        Executor=lambda path, kind, config: ScriptedExecutor(path, kind, config, leader),
    )


def test_dflash_engine_control_flow_against_the_scripted_executor(tmp_path):
    library = tmp_path / "libdflash_trt_plugins.so"
    library.write_bytes(b"")
    info = inspect_engine(write_engine(tmp_path / "engine", library=library))
    assert info.eagle_choices == CHAIN and info.gpus == 2 and info.end_id == 0 and info.plugin_library == library
    prepared = []
    backend = TrtllmExecutor(info, max_batch_size=64, trtllm=double(), prepare=prepared.append)
    requests = [Request(input_ids=[5, 6, 7 + i], max_new_tokens=8) for i in range(5)] + [
        Request(input_ids=[13], max_new_tokens=8)
    ]
    trace = asyncio.run(run_load(backend, requests, concurrency=3))
    executor = ScriptedExecutor.instances[-1]
    assert prepared == [info] and executor.shut and executor.model_path == info.engine_dir
    config = executor.config.kwargs
    assert config["max_batch_size"] == 8  # capped by the engine's build
    assert config["kv_cache_config"].kwargs["enable_block_reuse"] is False
    assert config["decoding_config"].eagle_config.args == (CHAIN, True, None, False, None)
    ok = [r for r in trace.records if r.error is None]
    assert len(ok) == 5 and all(r.chunks == [1, 3, 2] and r.output_ids == [1, 2, 3, 4, 5, 6] for r in ok)
    assert [r.error for r in trace.records if r.error] == ["prompt has token 13"]
    assert max(n for _, n in trace.in_flight) == 3


def test_requests_carry_streaming_end_id_and_our_request_id(tmp_path):
    info = inspect_engine(write_engine(tmp_path / "ar", mode="ar"), mode="ar")
    seen = []
    trtllm = double()
    trtllm.Request = lambda **kw: seen.append(kw) or Recorded(**kw)
    backend = TrtllmExecutor(info, ignore_eos=True, trtllm=trtllm, prepare=lambda _: None)
    asyncio.run(
        run_load(
            backend,
            [Request(input_ids=[9, 9], max_new_tokens=5), Request(input_ids=[8], max_new_tokens=5)],
            concurrency=2,
        )
    )
    assert [(kw["client_id"], kw["input_token_ids"], kw["max_tokens"]) for kw in seen] == [(0, [9, 9], 5), (1, [8], 5)]
    assert all(kw["streaming"] and kw["end_id"] == -1 for kw in seen)  # synthetic prompts never stop early
    assert ScriptedExecutor.instances[-1].config.kwargs["decoding_config"].eagle_config is None  # AR


def test_non_leader_rank_shuts_down_and_sends_nothing(tmp_path):
    info = inspect_engine(write_engine(tmp_path / "ar", mode="ar"), mode="ar")
    backend = TrtllmExecutor(info, trtllm=double(leader=False), prepare=lambda _: None)
    with pytest.raises(FollowerRank):
        asyncio.run(backend.start(lambda batch: None))
    assert ScriptedExecutor.instances[-1].shut


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: root / "nope", "does not exist"),
        (lambda root: root.mkdir() or root, "no config.json"),
        (lambda root: write_engine(root, mode="ar"), "has no dflash_trt.json"),
        (lambda root: write_engine(root), "plugin library .* not found"),
    ],
)
def test_bad_engine_directories_are_refused(tmp_path, make, message):
    with pytest.raises(DFlashTrtError, match=message):
        inspect_engine(make(tmp_path / "engine"))


def test_bench_cli_refuses_a_bad_engine_with_one_line_and_writes_nothing(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2]}\n')
    out = tmp_path / "out"
    engine = write_engine(tmp_path / "engine", mode="ar")
    argv = [
        "bench",
        "--engine_dir",
        str(engine),
        "--input_file",
        str(prompts),
        "--concurrency",
        "1",
        "--output_dir",
        str(out),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no dflash_trt.json" in err[0]
    assert not out.exists()


def test_follower_rank_builds_every_executor_rank_0_builds_and_writes_nothing(tmp_path):
    """Under mpirun every rank must construct each point's executors (warm-up and run) in step with rank 0."""
    from dflash_trt.bench.measure import measure_point
    from dflash_trt.bench.workload import Workload

    info = inspect_engine(write_engine(tmp_path / "ar", mode="ar"), mode="ar")
    built = []

    def factory(in_flight):
        built.append(in_flight)
        return TrtllmExecutor(info, trtllm=double(leader=False), prepare=lambda _: None)

    workload = Workload([Request(input_ids=[1], max_new_tokens=4)], ignore_eos=False, description={})
    with pytest.raises(FollowerRank):
        measure_point(factory, workload, "ar", concurrency=2, warmup=1)
    assert built == [2, 2]


def test_bench_cli_on_a_host_without_tensorrt_llm_is_one_clear_error(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("tensorrt_llm is installed: tests/gpu/test_engine_selftest.py runs bench on a real engine")
    library = tmp_path / "libdflash_trt_plugins.so"
    library.write_bytes(b"")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2]}\n')
    engine = write_engine(tmp_path / "engine", library=library)
    out = tmp_path / "out"
    argv = ["bench", "--engine_dir", str(engine), "--input_file", str(prompts), "--concurrency", "1",
            "--output_dir", str(out)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensorrt_llm 1.2.x is not installed" in err[0]
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_requests_carry_their_sampling_and_cancel_with_the_executor_id(tmp_path):
    info = inspect_engine(write_engine(tmp_path / "ar", mode="ar"), mode="ar")
    backend = TrtllmExecutor(info, trtllm=double(), prepare=lambda _: None)
    seen: list[Response] = []

    async def run():
        await backend.start(seen.extend)
        backend.submit(5, Request(input_ids=[9, 9], max_new_tokens=8, sampling=Sampling(temperature=0.7, seed=11)))
        backend.submit(6, Request(input_ids=[8], max_new_tokens=8))
        backend.cancel(6)
        backend.cancel(6)  # already gone: nothing more is sent
        while not any(r.final for r in seen):
            await asyncio.sleep(0.005)
        await backend.stop()

    asyncio.run(run())
    executor = ScriptedExecutor.instances[-1]
    assert executor.cancelled == [executor.ids[6]] == [1001]
    assert {r.request_id for r in seen} == {5}
    sampling = [call.kwargs["sampling_config"].kwargs for call in executor.enqueued]
    assert sampling == [{"beam_width": 1, "temperature": 0.7, "seed": 11}, {"beam_width": 1, "temperature": 0.0}]
