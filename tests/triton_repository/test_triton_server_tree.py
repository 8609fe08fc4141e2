"""A real Triton Inference Server serving the CPU repository `dflash-trt triton --checkpoint_dir C --draft_tree N`
writes: the emulated tree engine behind the tensorrtllm contract.

Oracles: the golden tree loop (`speculative_generate(..., draft_tree=N)`) for each prompt's tokens, the tokens each
verify step yielded and the text; the tree's node count for the backend's drafted total; the client's tokens per
verify step worked out from those counts.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from _tritonserver import TRITONSERVER, RunningServer

from dflash_trt.bench.driver import run_load
from dflash_trt.cli import main
from dflash_trt.clients.triton import TritonExecutor
from dflash_trt.executors.contract import Request
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.tiny.heldout import load_heldout
from dflash_trt.tokenizer import load_tokenizer
from dflash_trt.triton import client as triton_client

pytest.importorskip("tritonclient.grpc")

NODES = 40
MAX_NEW = 32
pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not TRITONSERVER.is_file(), reason="no tritonserver: run `make tritonserver`"),
]


@pytest.fixture(scope="module")
def repo(tiny: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("triton_tree") / "repo"
    flags = ["--max_batch_size", "2", "--max_seq_len", "224", "--draft_tree", str(NODES)]
    assert (
        main(["triton", "--checkpoint_dir", str(tiny), "--tokenizer_dir", str(tiny), *flags, "--output_dir", str(out)])
        == 0
    )
    return out


@pytest.fixture(scope="module")
def server(repo: Path):
    with RunningServer(repo, repo.parent / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(tiny)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(item.text) for item in load_heldout(limit=3)]


@pytest.fixture(scope="module")
def golden(tiny):
    return load_golden_model(tiny)


def test_the_repository_runs_the_tree_engine(repo: Path):
    """The tree's nodes are the repository's drafts per request; its EAGLE choices stay the chain of the 15 draft
    positions (what the runtime checks against the engine's EAGLE layers [read])."""
    recorded = json.loads((repo / "dflash_triton.json").read_text())
    assert (recorded["max_draft_len"], recorded["eagle_depth"]) == (NODES, 15)
    params = (repo / "tensorrt_llm/config.pbtxt").read_text()
    assert f'parameters {{ key: "draft_tree" value {{ string_value: "{NODES}" }} }}' in params


def test_token_ids_and_tokens_per_step_equal_the_golden_tree_loop(server, golden, prompts):
    """tensorrt_llm streams one response per engine iteration: the first token, then each tree step's accepted path."""
    expected = [speculative_generate(golden, [p], MAX_NEW, [], draft_tree=NODES)[0] for p in prompts]
    chain = [speculative_generate(golden, [p], MAX_NEW, [])[0] for p in prompts]
    assert [e.acceptance_lengths for e in expected] != [c.acceptance_lengths for c in chain]  # a chain would fail
    requests = [Request(input_ids=p, max_new_tokens=MAX_NEW) for p in prompts]
    backend = TritonExecutor(server.url, model="tensorrt_llm", vocab_size=golden.target.spec.vocab_size)
    trace = asyncio.run(run_load(backend, requests, prompt_indices=[0, 1, 2], concurrency=2, timeout_s=300))
    for record in trace.records:
        want = expected[record.prompt_index]
        assert record.error is None and record.output_ids == want.output_ids
        assert record.chunks == [1, *want.acceptance_lengths]


def test_the_clients_acceptance_length_counts_the_tree_steps(server, golden, tokenizer, prompts):
    """Over the ensemble: the text is the golden tree loop's; the backend drafted N nodes every verify step, and the
    client's tokens per step is the golden loop's mean accepted length per step."""
    stops = list(golden.target.spec.eos_token_ids)
    for prompt in prompts:
        (want,) = speculative_generate(golden, [prompt], MAX_NEW, stops, draft_tree=NODES)
        text = tokenizer.decode(prompt)
        gen = triton_client.stream_generate(server.url, text, MAX_NEW, temperature=0.0, timeout_s=120)
        assert gen.errors == [] and gen.text == tokenizer.decode(want.output_ids, skip_special_tokens=True)
        steps = len(want.acceptance_lengths)
        assert gen.chunks == steps + 1 and gen.draft_tokens == NODES * steps
        assert gen.accepted_draft_tokens == sum(want.acceptance_lengths) - steps
        mean = sum(want.acceptance_lengths) / steps
        assert f"mean acceptance length {mean:.2f} over {steps} verify steps" in triton_client.summary(gen)
