"""The engine network with DFlash2 drafters and speculators-format drafters, run under the emulated TensorRT-LLM
1.2.x and EAGLE runtime loop, against the golden model: the same tokens, acceptance lengths and drafted chains.

The golden model is the side speculators' and dflash's own modules were checked against (test_parity_speculators,
test_parity); here the network's convolutions, in-graph top-k and selector walk, reduced-vocabulary head, embedding
taps and anchor-slot drafts must reproduce it, at tp 1 and 2, on a Qwen3-MoE target, greedy and sampled, and on
the embedded trained DFlash2 drafter (which accepts long chains, so a wrong chain shows in acceptance too).
"""

from __future__ import annotations

import pytest
from _emulation import PROMPTS, SAMPLED, SAMPLED_TOKENS, STOP, divergences, per_request, sampled_runs
from _pairs import PairVariant, make_pair
from _speculators_pairs import SpeculatorsVariant, make_speculators_pair

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.stand_ins import load_engine_module
from dflash_trt.executors.emulated import decode_batch
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.tiny.heldout import dflash2_draft_dir, load_heldout, target_dir
from dflash_trt.tokenizer import load_tokenizer

NEW_TOKENS = 12
# Speculators drafters (written by speculators), and z-lab DFlash2 drafters (written by the dflash package).
SPECULATORS = {
    "dflash2-qwen3-tp2": (SpeculatorsVariant(), {"tp_size": 2}),
    "dflash2-llama-sample-from-anchor": (
        SpeculatorsVariant(
            target=PairVariant(arch="llama", head_dim=24, heads=4, kv_heads=1),
            sample_from_anchor=True,
            draft_heads=4,
            draft_kv_heads=1,
            draft_head_dim=24,
        ),
        {},
    ),
    "dflash2-moe-kernel3-noncausal-window": (
        SpeculatorsVariant(
            target=PairVariant(arch="qwen3_moe"),
            conv_kernel_size=3,
            conv_group_size=8,
            selector_rank=5,
            selector_top_k=9,
            block_size=10,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=1024,  # never binds below the engine's sequence cap
        ),
        {},
    ),
    "dflash-draft-vocab-embedding-tap": (
        SpeculatorsVariant(kind="dflash", draft_vocab_size=40, aux_ids=[0, 3]),
        {"tp_size": 2},
    ),
}
ZLAB = {
    "zlab-dflash2-qwen3": PairVariant(
        dflash2={"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 12, "selector_top_k": 6}, taps=[-1, 3]
    ),
}


def _checkpoint(root, name):
    if name in ZLAB:
        target_dir_, draft_dir_ = make_pair(root, ZLAB[name])
        options = {}
    else:
        variant, options = SPECULATORS[name]
        target_dir_, draft_dir_ = make_speculators_pair(root, variant)
    convert_checkpoint(target_dir_, draft_dir_, root / "ckpt", dtype="float32", **options)
    return root / "ckpt"


@pytest.fixture(scope="module", params=[*SPECULATORS, *ZLAB])
def ckpt(request, tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def test_the_network_drafts_the_golden_chains(ckpt):
    model = load_golden_model(ckpt)
    golden = speculative_generate(model, PROMPTS, NEW_TOKENS + model.draft.spec.num_drafts, STOP)
    runtime = EmulatedEngine(ckpt, max_batch_size=2, tokens_per_block=16)
    emulated = decode_batch(runtime, PROMPTS, NEW_TOKENS, STOP)
    assert divergences(ckpt, golden, emulated, NEW_TOKENS) == []
    assert runtime.model.unused_tensors == []
    assert all(len(step.draft_ids) == model.draft.spec.num_drafts for r in emulated for step in r.steps)


@pytest.mark.parametrize("setting", list(SAMPLED))
def test_sampled_requests_keep_the_selector_chains(ckpt, setting):
    greedy, golden, emulated = sampled_runs(ckpt, PROMPTS, setting, tokens_per_block=16)
    temperatures = per_request(setting, len(PROMPTS))
    assert divergences(ckpt, golden, emulated, SAMPLED_TOKENS, temperatures) == []
    for t, g, e in zip(temperatures, greedy, emulated, strict=True):
        if t == 0:
            assert e.output_ids == g.output_ids


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The embedded DFlash2 drafter (speculators format) converted with its target."""
    out = tmp_path_factory.mktemp("trained-dflash2") / "ckpt"
    convert_checkpoint(target_dir(), dflash2_draft_dir(), out, dtype="float32")
    tokenizer = load_tokenizer(out)
    return out, [tokenizer.encode(p.text) for p in load_heldout(limit=6)]


def test_the_trained_dflash2_drafter_through_the_network(trained):
    ckpt, prompts = trained
    model = load_golden_model(ckpt)
    golden = speculative_generate(model, prompts, 24 + model.draft.spec.num_drafts)
    emulated = decode_batch(EmulatedEngine(ckpt, max_batch_size=3, tokens_per_block=16), prompts, 24)
    assert divergences(ckpt, golden, emulated, 24) == []
    assert max(max(r.acceptance_lengths) for r in emulated) >= 6  # long chains: the selector is exercised


@pytest.fixture(scope="module")
def random_dflash2(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("random-dflash2"), "zlab-dflash2-qwen3")


@pytest.mark.parametrize("breakage", ["no-transition", "no-output-convolution"])
def test_a_wrong_selector_or_convolution_is_caught(random_dflash2, monkeypatch, breakage):
    """A walk scoring the unary logits alone, or layers skipping the convolution after attention, drafts other
    chains than the golden model's (a random drafter: every slot's choice depends on both)."""
    engine = load_engine_module()
    if breakage == "no-transition":
        rows = engine.CandidateSelector._rows
        monkeypatch.setattr(
            engine.CandidateSelector, "_rows", lambda self, codebook, ids: rows(self, codebook, ids) * 0.0
        )
    else:
        original = engine.GroupedDynamicConv.convolve

        def skip_after(self, x, coefficients, which, batch):
            return x if which == engine.AFTER else original(self, x, coefficients, which, batch)

        monkeypatch.setattr(engine.GroupedDynamicConv, "convolve", skip_after)
    model = load_golden_model(random_dflash2)
    golden = speculative_generate(model, PROMPTS, NEW_TOKENS + model.draft.spec.num_drafts, STOP)
    emulated = decode_batch(
        EmulatedEngine(random_dflash2, max_batch_size=2, tokens_per_block=16), PROMPTS, NEW_TOKENS, STOP
    )
    assert divergences(random_dflash2, golden, emulated, NEW_TOKENS) != []
