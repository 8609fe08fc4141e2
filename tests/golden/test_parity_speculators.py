"""Golden model of a converted speculators-format drafter vs the `speculators` package's own modules (0.9.0).

Each variant's drafter is written by speculators (`DFlashDraftModel` / `DFlash2DraftModel`, `save_pretrained`), loaded
back by speculators, and run over the same sequences: every block slot's hidden state and logits, and the chain of
drafts (DFlash2: its selector's walk), for anchored blocks and for every step our decoding loop drafted.
"""

from __future__ import annotations

import pytest
import torch
from _pairs import PairVariant
from _speculators_pairs import SpeculatorsVariant, make_speculators_pair
from _speculators_reference import anchored_blocks, load_reference
from transformers import AutoModelForCausalLM

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "dflash-qwen3": SpeculatorsVariant(kind="dflash"),
    "dflash-llama-embedding-and-last-taps": SpeculatorsVariant(
        kind="dflash", target=PairVariant(arch="llama", tie=True), aux_ids=[0, 2, 4], block_size=6
    ),
    "dflash-qwen3-moe-draft-vocab": SpeculatorsVariant(
        kind="dflash", target=PairVariant(arch="qwen3_moe"), draft_vocab_size=40
    ),
    "dflash-sliding-causal-llama-layers": SpeculatorsVariant(
        kind="dflash",
        layer_config="llama",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=5,
        rope=LLAMA3_ROPE,
        target=PairVariant(rope=LLAMA3_ROPE),
    ),
    "dflash-sample-from-anchor": SpeculatorsVariant(kind="dflash", sample_from_anchor=True, block_size=5),
    "dflash2-qwen3": SpeculatorsVariant(),
    "dflash2-sliding-noncausal": SpeculatorsVariant(
        layer_types=["sliding_attention", "sliding_attention"], sliding_window=4, aux_ids=[2, 3, 4]
    ),
    "dflash2-llama-sample-from-anchor": SpeculatorsVariant(
        target=PairVariant(arch="llama", head_dim=24, heads=4, kv_heads=1), sample_from_anchor=True
    ),
    "dflash2-qwen3-moe-kernel3": SpeculatorsVariant(
        target=PairVariant(arch="qwen3_moe"),
        conv_kernel_size=3,
        conv_group_size=8,
        selector_rank=5,
        selector_top_k=9,
        block_size=10,
        draft_layers=3,
    ),
}
PROMPTS = [[3, 4, 5, 6, 7], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
MAX_NEW = 24
SCORE_TOLERANCE = 1e-4  # two float32 implementations may order candidates closer than this either way


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target_dir, draft_dir = make_speculators_pair(root, VARIANTS[request.param])
    convert_checkpoint(target_dir, draft_dir, root / "ckpt", dtype="float32")
    hf_target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    return load_golden_model(root / "ckpt"), hf_target, load_reference(draft_dir, hf_target)


def _golden_blocks(golden, tokens: list[int], anchors: list[int]):
    """Our drafter's hidden states, logits and chains for blocks anchored at `anchors` of `tokens`."""
    spec, n = golden.draft.spec, len(tokens)
    ids, positions = torch.tensor([tokens]), torch.arange(n)[None]
    valid = torch.ones(1, n, dtype=torch.bool)
    with torch.no_grad():
        _, taps = golden.target.forward(ids, positions, valid, golden.target.new_cache(1, n + spec.block_size))
        cache = golden.draft.new_cache(1, n + spec.block_size)
        golden.draft.inject(taps, positions, valid, cache)
        rows = []
        for anchor in anchors:
            block = torch.full((1, spec.block_size), spec.mask_token_id)
            block[0, 0] = tokens[anchor]
            hidden = golden.draft.forward(
                block, torch.tensor([anchor]), torch.ones(1, spec.block_size, dtype=torch.bool), cache
            )
            rows.append((hidden[0], golden.draft.unary_logits(hidden)[0], golden.draft.choose(hidden, block[:, 0])))
    return rows


def _assert_same_chain(ours, theirs: list[int], choice) -> None:
    """Equal chains, or a first difference at a near-tie of our scores (the rest then follows other predecessors)."""
    if ours == theirs:
        return
    slot = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
    candidates = choice.candidates[0, slot] if choice.candidates is not None else torch.arange(choice.scores.shape[-1])
    scores = choice.scores[0, slot]
    margin = float(scores[candidates == ours[slot]].max() - scores[candidates == theirs[slot]].max())
    assert margin < SCORE_TOLERANCE * max(1.0, float(scores.abs().max())), (ours, theirs, margin)


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_anchored_blocks_match_speculators(models, prompt, monkeypatch):
    golden, hf_target, reference = models
    tokens = speculative_generate(golden, [PROMPTS[prompt]], MAX_NEW)[0]
    tokens = tokens.input_ids + tokens.output_ids
    anchors = list(range(1, len(tokens), 3))
    theirs = anchored_blocks(reference, hf_target, tokens, anchors, monkeypatch)
    for row, (hidden, logits, choice) in enumerate(_golden_blocks(golden, tokens, anchors)):
        torch.testing.assert_close(hidden, theirs.hidden[row], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits, theirs.logits[row].float(), rtol=1e-4, atol=1e-4)
        _assert_same_chain(choice.tokens()[0].tolist(), theirs.chains[row], choice)


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_decoding_drafts_match_speculators_and_stay_lossless(models, prompt, monkeypatch):
    """Every full step of our loop drafted the chain speculators gives at that step's anchor; output = target's."""
    golden, hf_target, reference = models
    result = speculative_generate(golden, [PROMPTS[prompt]], MAX_NEW)[0]
    alone = speculative_generate(golden, [PROMPTS[prompt]], MAX_NEW, block_size=1)[0]
    assert result.output_ids == alone.output_ids
    tokens = result.input_ids + result.output_ids
    anchors, start = [], len(result.input_ids)
    for produced in result.acceptance_lengths:
        anchors.append(start)
        start += produced
    full = [i for i, step in enumerate(result.steps) if len(step.draft_ids) == golden.draft.spec.num_drafts]
    theirs = anchored_blocks(reference, hf_target, tokens, [anchors[i] for i in full], monkeypatch)
    ours = _golden_blocks(golden, tokens, [anchors[i] for i in full])
    for row, step in enumerate(full):
        _assert_same_chain(result.steps[step].draft_ids, theirs.chains[row], ours[row][2])
