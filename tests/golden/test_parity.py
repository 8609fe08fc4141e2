"""Golden model of a converted checkpoint vs the `dflash` reference and HF transformers on the same files."""

from __future__ import annotations

import dflash.model as reference
import pytest
import torch
from _pairs import PairVariant, make_pair
from _reference import assert_matches_dflash_generate
from transformers import AutoModelForCausalLM

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.reference.model import load_golden_model

DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 12, "selector_top_k": 6}
VARIANTS = {
    "qwen3-gqa-b8": PairVariant(),
    "qwen3-tied-b4-one-tap": PairVariant(tie=True, block_size=4, taps=[3], draft_layers=1),
    "llama-bias-headdim": PairVariant(
        arch="llama",
        target_bias=True,
        head_dim=24,
        heads=4,
        kv_heads=1,
        draft_head_dim=8,
        draft_heads=8,
        draft_kv_heads=4,
        draft_bias=True,
    ),
    "qwen3-b16-scales-softcap": PairVariant(
        block_size=16,
        taps=[0, 1, 3],
        draft_layers=3,
        dflash_extra={"input_embedding_scale": 1.7, "output_multiplier": 0.6, "final_logit_softcapping": 2.5},
    ),
    "qwen3-sliding-mix": PairVariant(
        draft_layers=3, sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"]
    ),
    "llama3-rope-noncausal-window": PairVariant(
        arch="llama",
        tie=True,
        is_causal=False,
        sliding_window=3,
        layer_types=["sliding_attention"] * 2,
        rope={
            "rope_type": "llama3",
            "rope_theta": 5000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen3-causal-full-top-level-keys": PairVariant(is_causal=True, taps=None, top_level={"block_size": 6}),
    "qwen3-drafter-own-rope": PairVariant(draft_rope={"rope_type": "default", "rope_theta": 500.0}),
    "qwen3-dflash2-sliding-noncausal": PairVariant(
        dflash2=DFLASH2,
        is_causal=False,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        taps=[-1, 3],
    ),
    "llama-dflash2-saved-codebooks-kernel3": PairVariant(
        arch="llama",
        dflash2={**DFLASH2, "conv_kernel_size": 3, "conv_group_size": 8, "selector_top_k": 9},
        published_codebooks=False,
        block_size=10,
    ),
}
PROMPTS = [[3, 4, 5, 6, 7], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module", params=list(VARIANTS))
def parity_models(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target_dir, draft_dir = make_pair(root, VARIANTS[request.param])
    convert_checkpoint(target_dir, draft_dir, root / "ckpt", dtype="float32")
    hf_target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    reference_class = reference.DFlash2DraftModel if VARIANTS[request.param].dflash2 else reference.DFlashDraftModel
    ref_draft = reference_class.from_pretrained(draft_dir).eval()
    return load_golden_model(root / "ckpt"), hf_target, ref_draft


def test_target_logits_and_taps_match_transformers(parity_models):
    golden, hf_target, ref_draft = parity_models
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        out = hf_target(ids, output_hidden_states=True)
    cache = golden.target.new_cache(1, 16)
    positions = torch.arange(ids.shape[1])[None]
    logits, taps = golden.target.forward(ids, positions, torch.ones_like(ids, dtype=torch.bool), cache)
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        taps, reference.extract_context_feature(out.hidden_states, ref_draft.target_layer_ids), rtol=1e-5, atol=1e-5
    )


def test_drafter_forward_matches_reference(parity_models):
    golden, hf_target, ref_draft = parity_models
    torch.manual_seed(0)
    spec = golden.draft.spec
    ctx_len, block = 11, spec.block_size
    taps = torch.randn(1, ctx_len, len(spec.target_layer_ids) * spec.hidden_size)
    block_ids = torch.full((1, block), spec.mask_token_id)
    block_ids[0, 0] = 7
    with torch.no_grad():
        noise = reference._raw_input_embeddings(hf_target, block_ids, spec.input_embedding_scale)
        want = ref_draft(position_ids=torch.arange(ctx_len + block)[None], noise_embedding=noise, target_hidden=taps)
        want_logits = ref_draft.compute_logits(want, hf_target.lm_head)
    cache = golden.draft.new_cache(1, ctx_len + block)
    positions = torch.arange(ctx_len)[None]
    golden.draft.inject(taps, positions, torch.ones(1, ctx_len, dtype=torch.bool), cache)
    got = golden.draft.forward(block_ids, torch.tensor([ctx_len]), torch.ones(1, block, dtype=torch.bool), cache)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(golden.draft.unary_logits(got), want_logits, rtol=1e-5, atol=1e-5)
    if isinstance(ref_draft, reference.DFlash2DraftModel):  # the selector's chain over the draft slots
        with torch.no_grad():
            chain = ref_draft.propose(want[:, 1:], block_ids[:, 0], hf_target.lm_head, 0.0)[0]
        assert golden.draft.choose(got, block_ids[:, 0]).tokens().tolist() == chain.tolist()


@pytest.mark.parametrize("max_new, stops", [(30, None), (13, [5, 17, 40, 60])])
def test_generate_matches_dflash_generate(parity_models, monkeypatch, max_new, stops):
    assert_matches_dflash_generate(*parity_models, PROMPTS, max_new, stops, monkeypatch)
