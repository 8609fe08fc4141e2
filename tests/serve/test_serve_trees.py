"""`dflash-trt serve --checkpoint_dir C --draft_tree N`: the emulated tree engine behind the OpenAI server, through
the official `openai` client against a real uvicorn server.

Oracles: HF transformers' greedy decoding of the tiny pair's target alone (lossless), and `dflash-trt generate
--draft_tree N` (the golden tree loop, run through the CLI) for the tokens each verify step accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from pathlib import Path

import openai
import pytest
import torch
from _server import RunningServer
from transformers import AutoModelForCausalLM

from dflash_trt.cli import main
from dflash_trt.server.launch import make_app
from dflash_trt.server.targets import checkpoint_target
from dflash_trt.tiny.heldout import load_heldout, target_dir
from dflash_trt.tokenizer import load_tokenizer

NODES = 40
MAX_NEW = 48
TOKEN_IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(tiny)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [item.text for item in load_heldout(limit=4)]


@pytest.fixture(scope="module")
def server(tiny, tokenizer):
    target = checkpoint_target(str(tiny), 4, None, False, draft_tree=NODES)
    with RunningServer(make_app(target, tokenizer, "tiny-tree")) as running:
        yield running


def golden(tiny: Path, tmp: Path, texts: list[str], *extra: str) -> list[dict]:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    argv = ["generate", "--checkpoint_dir", str(tiny), "--input_file", str(prompts)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--max_new_tokens", str(MAX_NEW), *extra, "--json"]) == 0
    return json.loads(out.getvalue())["sequences"]


@pytest.fixture(scope="module")
def tree_loop(tiny, texts, tmp_path_factory) -> list[dict]:
    return golden(tiny, tmp_path_factory.mktemp("tree"), texts, "--draft_tree", str(NODES))


@pytest.fixture(scope="module")
def chain_loop(tiny, texts, tmp_path_factory) -> list[dict]:
    return golden(tiny, tmp_path_factory.mktemp("chain"), texts)


@pytest.fixture(scope="module")
def target_alone(tokenizer, texts) -> list[list[int]]:
    """HF greedy on the target alone, stopping at (and keeping) its EOS as the server does."""
    model = AutoModelForCausalLM.from_pretrained(target_dir()).eval()
    outputs = []
    for text in texts:
        prompt = tokenizer.encode(text)
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=0,
            )
        outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_the_oracles_tell_a_tree_from_the_chain(tree_loop, chain_loop, target_alone):
    """The checks below would catch a server that verified chains: the tree accepts differently on these prompts."""
    assert [s["output_ids"] for s in tree_loop] == [s["output_ids"] for s in chain_loop] == target_alone
    assert [s["acceptance_lengths"] for s in tree_loop] != [s["acceptance_lengths"] for s in chain_loop]


def test_greedy_completions_equal_the_target_alone_whole_and_streamed(server, tokenizer, texts, target_alone):
    api = client(server)
    for text, want in zip(texts, target_alone, strict=True):
        whole = api.completions.create(
            model="tiny-tree", prompt=text, max_tokens=MAX_NEW, temperature=0, extra_body=TOKEN_IDS
        )
        assert whole.choices[0].token_ids == want
        assert whole.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
        chunks = api.completions.create(model="tiny-tree", prompt=text, max_tokens=MAX_NEW, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_each_streamed_chunk_is_one_tree_verify_step(server, texts, tree_loop):
    """The context step's first token, then what each step's accepted path yielded, as the golden tree loop."""
    api = client(server)
    for text, want in zip(texts, tree_loop, strict=True):
        chunks = api.completions.create(
            model="tiny-tree", prompt=text, max_tokens=MAX_NEW, temperature=0, stream=True, extra_body=TOKEN_IDS
        )
        per_step = [c.choices[0].token_ids for c in chunks if c.choices and c.choices[0].token_ids]
        assert sum(per_step, []) == want["output_ids"]
        assert [len(tokens) for tokens in per_step] == [1, *want["acceptance_lengths"]]


def test_concurrent_text_and_token_id_streams_each_equal_the_target_alone(server, tokenizer, texts, target_alone):
    """Eight streams over the engine's 4 slots (some queue), text and token-id prompts mixed."""

    async def stream(api: openai.AsyncOpenAI, i: int) -> list[int]:
        k = i % len(texts)
        prompt = texts[k] if i % 2 else tokenizer.encode(texts[k])
        chunks = await api.completions.create(
            model="tiny-tree", prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True, extra_body=TOKEN_IDS
        )
        return [t async for c in chunks if c.choices for t in (c.choices[0].token_ids or [])]

    async def run() -> list[list[int]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as api:
            return await asyncio.gather(*(stream(api, i) for i in range(8)))

    assert asyncio.run(run()) == [target_alone[i % len(texts)] for i in range(8)]
