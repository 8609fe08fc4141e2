"""The tiny pair widened to head_dim 128 (`dflash_trt/tiny/widen.py`), the pair `selftest` builds so that an engine runs
the kernels production models run: the same function at another head size. Oracles: HF `transformers` on both target
folders, and the golden loop on both converted pairs (tokens and acceptance lengths)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen3ForCausalLM

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir
from dflash_trt.tiny.widen import embedded_index, widen_pair
from dflash_trt.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def widened(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("widen")
    return widen_pair(target_dir(), draft_dir(), root / "pair", 128)


def test_rope_pairs_keep_their_frequency():
    """Narrow element i pairs with i + 16 at theta^(-2i/32); its wide place pairs with +64 at theta^(-2i'/128)."""
    for i in range(16):
        low, high = embedded_index(i, 32, 128), embedded_index(i + 16, 32, 128)
        assert high == low + 64 and 2 * low / 128 == 2 * i / 32
    assert len({embedded_index(j, 32, 128) for j in range(32)}) == 32


def test_the_widened_target_computes_the_same_logits(widened):
    assert json.loads((widened[0] / "config.json").read_text())["head_dim"] == 128
    ids = torch.tensor([load_tokenizer(target_dir()).encode(load_heldout(limit=1)[0].text)])
    with torch.no_grad():
        narrow = Qwen3ForCausalLM.from_pretrained(target_dir()).eval()(ids).logits
        wide = Qwen3ForCausalLM.from_pretrained(widened[0]).eval()(ids).logits
    assert torch.allclose(narrow, wide, atol=1e-4, rtol=1e-4)


def test_the_widened_pair_decodes_like_the_tiny_pair(widened, tmp_path):
    tokenizer = load_tokenizer(target_dir())
    prompts = [tokenizer.encode(p.text) for p in load_heldout(limit=6)]
    results = []
    for name, (target, draft) in {"narrow": (target_dir(), draft_dir()), "wide": widened}.items():
        convert_checkpoint(target, draft, tmp_path / name, dtype="float32")
        results.append(speculative_generate(load_golden_model(tmp_path / name), prompts, 24))
    narrow, wide = results
    assert [r.output_ids for r in wide] == [r.output_ids for r in narrow]
    assert [r.acceptance_lengths for r in wide] == [r.acceptance_lengths for r in narrow]
    assert max(max(r.acceptance_lengths) for r in wide) > 4  # the drafter is really exercised
