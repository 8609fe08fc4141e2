"""speculators-format drafters: their config read as speculators' own model classes read it, everything we cannot
build refused by name, their checkpoints converted (quantized too) and hostile files refused.

Oracles: the `speculators` package (its config classes write the files, its models say what the config means),
the quantizers' bit-exact definitions via `verify`, and the golden model's losslessness against its target alone.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from _pairs import PairVariant
from _speculators_pairs import SpeculatorsVariant, make_speculators_pair
from safetensors.torch import load_file, save_file
from speculators.model import SpeculatorModel

from dflash_trt import tensor_names as names
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.conversion.verify import verify_checkpoint
from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.reference.sampling import SamplingParams
from dflash_trt.sampling_rules import REFERENCE
from dflash_trt.spec import SLIDING_ATTENTION, load_draft_spec, load_target_spec, parse_draft_config

SPEC_VARIANTS = {
    "dflash2-defaults": SpeculatorsVariant(),
    "dflash2-sliding-causal-anchor": SpeculatorsVariant(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=7,
        sliding_window_non_causal=False,
        sample_from_anchor=True,
    ),
    "dflash-draft-vocab-llama-layers": SpeculatorsVariant(
        kind="dflash", layer_config="llama", draft_vocab_size=33, aux_ids=[0, 4]
    ),
    "dflash-sliding-all": SpeculatorsVariant(
        kind="dflash", layer_types=["sliding_attention"] * 2, sliding_window=3, block_size=4
    ),
}


@pytest.fixture(scope="module", params=list(SPEC_VARIANTS))
def written(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return make_speculators_pair(root, SPEC_VARIANTS[request.param])


def test_spec_is_what_speculators_builds_from_the_same_file(written):
    target_dir, draft_dir = written
    spec = load_draft_spec(draft_dir, load_target_spec(target_dir))
    model = SpeculatorModel.from_pretrained(str(draft_dir))
    config = model.config
    layers = config.transformer_layer_config
    sliding = tuple(i for i, kind in enumerate(spec.layer_types) if kind == SLIDING_ATTENTION)
    assert sliding == tuple(model.sliding_window_indices)
    assert spec.causal == tuple(i in sliding and not model.sliding_window_non_causal for i in range(len(spec.causal)))
    assert all(spec.layer_window(i) == model.sliding_window for i in sliding) and spec.window_from_anchor
    assert spec.target_layer_ids == tuple(i - 1 for i in model.target_layer_ids)
    assert (spec.block_size, spec.mask_token_id, spec.sample_from_anchor) == (
        model.block_size,
        model.mask_token_id,
        config.sample_from_anchor,
    )
    assert spec.num_drafts == config.speculators_config.proposal_methods[0].speculative_tokens
    assert (spec.hidden_size, spec.num_hidden_layers, spec.head_dim) == (
        layers.hidden_size,
        len(model.layers),
        model.layers[0].self_attn.head_dim,
    )
    assert (spec.draft_vocab_size or spec.vocab_size) == model.draft_vocab_size
    assert (spec.draft_vocab_size is not None) == model.use_draft_vocab
    if spec.dflash2 is None:
        assert not hasattr(model, "candidate_selector")
        return
    conv = model.layers[0].attention_conv
    assert (spec.dflash2.conv_kernel_size, spec.dflash2.conv_group_size) == (conv.kernel_size, conv.group_size)
    assert (spec.dflash2.selector_top_k, spec.dflash2.selector_rank) == (
        model.candidate_selector.top_k,
        model.candidate_selector.hidden_projection.out_features,
    )


@pytest.fixture(scope="module")
def dflash2_pair(tmp_path_factory):
    return make_speculators_pair(tmp_path_factory.mktemp("dflash2"), SpeculatorsVariant())


def _config(pair) -> dict:
    return json.loads((pair[1] / "config.json").read_text())


REFUSED = [
    ({"speculators_model_type": "eagle3"}, "speculators drafter model type 'eagle3' is not a DFlash drafter"),
    ({"speculators_model_type": "dspark"}, "model type 'dspark' is not a DFlash drafter (supported: dflash, dflash2)"),
    ({"speculators_model_type": "medusa2"}, "unknown speculators_model_type 'medusa2'"),
    ({"mask_token_id": None}, "'mask_token_id' is not set"),
    ({"aux_hidden_state_layer_ids": None}, "'aux_hidden_state_layer_ids' must be a non-empty list of integers"),
    ({"aux_hidden_state_layer_ids": [-1, 2]}, "cannot be negative"),
    ({"aux_hidden_state_layer_ids": [2, 5]}, "target layer id 4 is outside the target's 4 layers"),
    ({"target_hidden_size": 32}, "target_hidden_size 32 != the target's hidden_size 64"),
    ({"draft_vocab_size": 97}, "draft_vocab_size 97 exceeds the target vocabulary (96)"),
    ({"draft_vocab_size": 40}, "DFlash2 drafts over the full target vocabulary, got draft_vocab_size 40"),
    ({"conv_group_size": 24}, "hidden_size (64) must be a multiple of conv_group_size (24)"),
    ({"conv_kernel_size": 9}, "conv_kernel_size (9) cannot exceed block_size (8)"),
    ({"selector_top_k": 97}, "selector_top_k (97) cannot exceed the vocabulary (96 tokens)"),
    ({"sample_from_anchor": "yes"}, "'sample_from_anchor' must be true or false"),
    ({"block_size": "8"}, "'block_size' must be an integer"),
    ({"transformer_layer_config": None}, "'transformer_layer_config' must be an object"),
]


@pytest.mark.parametrize("change, message", REFUSED)
def test_what_cannot_be_built_is_refused_by_name(dflash2_pair, change, message):
    config = {**_config(dflash2_pair), **change}
    with pytest.raises(DFlashTrtError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_draft_config(config, load_target_spec(dflash2_pair[0]))


@pytest.mark.parametrize(
    "layer_config, message",
    [
        ({"model_type": "qwen3_moe"}, "transformer_layer_config model_type 'qwen3_moe' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"hidden_size": 32}, "hidden sizes differ"),
        ({"layer_types": ["sliding_attention", "linear_attention"]}, "unknown layer type 'linear_attention'"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention layers need a sliding_window"),
        (
            {"model_type": "llama", "layer_types": ["full_attention", "sliding_attention"]},
            "sliding_attention layers need a sliding_window",
        ),
    ],
)
def test_draft_decoders_we_cannot_build_are_refused(dflash2_pair, layer_config, message):
    config = _config(dflash2_pair)
    config["transformer_layer_config"].update(layer_config)
    with pytest.raises(DFlashTrtError, match=message):
        parse_draft_config(config, load_target_spec(dflash2_pair[0]))


@pytest.mark.parametrize("qformat", ["fp8", "nvfp4"])
def test_quantized_dflash2_keeps_its_extras_16_bit_and_stays_lossless(dflash2_pair, tmp_path, qformat):
    """The draft layers' linears are quantized; convolutions, selector and codebooks keep --dtype (docs say why)."""
    target_dir, draft_dir = dflash2_pair
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"input_ids": [i, i + 1, 5, 6, i % 7 + 2]}) for i in range(10, 30)))
    out = tmp_path / "ckpt"
    convert_checkpoint(
        target_dir, draft_dir, out, dtype="bfloat16", qformat=qformat, kv_cache_dtype="fp8", calib_dataset=calib
    )
    assert verify_checkpoint(out, target_dir, draft_dir).ok
    stored = load_file(out / "rank0.safetensors")
    assert stored[f"{names.draft_layer(0)}.{names.QKV}.weight"].dtype in (torch.float8_e4m3fn, torch.uint8)
    for name in (
        names.tensor(names.draft_layer(1), names.ATTENTION_CONV, names.CONV_BASE_KERNEL),
        names.tensor(names.draft_layer(1), f"{names.MLP_CONV}.{names.CONV_KERNEL_PROJECTION}"),
        names.SELECTOR_PREDECESSOR_CODEBOOK,
        names.SELECTOR_HIDDEN_PROJECTION,
    ):
        assert stored[name].dtype == torch.bfloat16, name
        assert not any(key.startswith(name.removesuffix(".weight") + ".") and key != name for key in stored)
    model = load_golden_model(out)
    prompts = [[3, 4, 5, 6, 7], [9, 10]]
    drafted = speculative_generate(model, prompts, 16)
    alone = speculative_generate(model, prompts, 16, block_size=1)
    assert [r.output_ids for r in drafted] == [r.output_ids for r in alone]


def test_tensor_parallel_dflash2_decodes_like_tp1(dflash2_pair, tmp_path):
    outputs = []
    for tp in (1, 2, 4):
        convert_checkpoint(*dflash2_pair, tmp_path / f"tp{tp}", dtype="float32", tp_size=tp)
        result = speculative_generate(load_golden_model(tmp_path / f"tp{tp}"), [[3, 4, 5, 6, 7]], 16)[0]
        outputs.append((result.output_ids, result.acceptance_lengths, [s.draft_ids for s in result.steps]))
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.fixture(scope="module")
def vocab_pair(tmp_path_factory):
    variant = SpeculatorsVariant(kind="dflash", draft_vocab_size=40)
    return make_speculators_pair(tmp_path_factory.mktemp("vocab"), variant)


def _edited_drafter(pair, tmp_path, edit) -> tuple:
    draft = tmp_path / "draft"
    shutil.copytree(pair[1], draft)
    weights = load_file(draft / "model.safetensors")
    edit(weights)
    save_file(weights, draft / "model.safetensors", metadata={"format": "pt"})
    return pair[0], draft


def _swap_two(weights):
    weights["d2t"][[3, 4]] = weights["d2t"][[4, 3]] + torch.tensor([1, -1])


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda w: w.update(d2t=w["d2t"].int()), "drafter tensor 'd2t' has dtype I32 (int32); expected int64"),
        (lambda w: w["d2t"].__setitem__(-1, 10**6), "the draft vocabulary maps outside the target's 96 tokens"),
        (lambda w: w["d2t"].__setitem__(1, w["d2t"][0] - 1), "maps two draft ids to the same target id"),
        (lambda w: w["t2d"].__setitem__(95, True), "'d2t' and 't2d' describe different draft vocabularies"),
        (lambda w: w.pop("d2t"), "drafter checkpoint is missing tensor 'd2t'"),
        (lambda w: w.update(t2d=w["t2d"].float()), "drafter tensor 't2d' has dtype F32 (float32); expected bool"),
        (lambda w: w.update(lm_head=torch.zeros(2)), "unexpected tensor 'lm_head'"),
        (lambda w: w.update({"verifier_norm.weight": torch.ones(3)}), "'verifier_norm.weight' has shape (3,)"),
    ],
    ids=[
        "d2t-int32",
        "d2t-out-of-range",
        "d2t-duplicate",
        "t2d-disagrees",
        "d2t-missing",
        "t2d-float",
        "extra",
        "verifier-shape",
    ],
)
def test_hostile_vocabulary_maps_are_refused(vocab_pair, tmp_path, edit, message):
    target_dir, draft_dir = _edited_drafter(vocab_pair, tmp_path, edit)
    with pytest.raises(DFlashTrtError, match=message.replace("(", r"\(").replace(")", r"\)")):
        convert_checkpoint(target_dir, draft_dir, tmp_path / "out", dtype="float32")
    assert not (tmp_path / "out").exists()


def test_the_verifier_copies_a_checkpoint_may_carry_are_accepted_and_ignored(vocab_pair, tmp_path):
    """speculators may also store the target's embeddings, final norm and head: shapes checked, never converted."""

    def add_verifier(weights):
        weights["embed_tokens.weight"] = torch.randn(96, 64)
        weights["verifier_norm.weight"] = torch.ones(64)
        weights["verifier_lm_head.weight"] = torch.randn(40, 64)

    target_dir, draft_dir = _edited_drafter(vocab_pair, tmp_path, add_verifier)
    convert_checkpoint(target_dir, draft_dir, tmp_path / "out", dtype="float32")
    plain = tmp_path / "plain"
    convert_checkpoint(*vocab_pair, plain, dtype="float32")
    assert (tmp_path / "out" / "rank0.safetensors").read_bytes() == (plain / "rank0.safetensors").read_bytes()


@pytest.mark.parametrize("both", [False, True])
def test_codebooks_in_either_spelling(dflash2_pair, tmp_path, both):
    """The dflash package saves the selector codebooks as `.weight`; published checkpoints do not. Both read; a
    checkpoint with both spellings is ambiguous."""

    def respell(weights):
        for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
            weights[name + ".weight"] = weights[name].clone() if both else weights.pop(name)

    target_dir, draft_dir = _edited_drafter(dflash2_pair, tmp_path, respell)
    if both:
        with pytest.raises(DFlashTrtError, match="two spellings of one tensor"):
            convert_checkpoint(target_dir, draft_dir, tmp_path / "out", dtype="float32")
        return
    convert_checkpoint(target_dir, draft_dir, tmp_path / "out", dtype="float32")
    assert verify_checkpoint(tmp_path / "out", target_dir, draft_dir).ok


def test_speculators_drafter_over_an_expert_parallel_moe_target(tmp_path):
    """A speculators drafter over a Qwen3-MoE target converts and decodes losslessly."""
    pair = make_speculators_pair(tmp_path, SpeculatorsVariant(target=PairVariant(arch="qwen3_moe")))
    convert_checkpoint(*pair, tmp_path / "ckpt", dtype="float32", tp_size=2, moe_ep_size=2)
    model = load_golden_model(tmp_path / "ckpt")
    drafted = speculative_generate(model, [[5, 6, 7]], 16)[0]
    assert drafted.output_ids == speculative_generate(model, [[5, 6, 7]], 16, block_size=1)[0].output_ids


def test_reference_sampling_drafts_inside_the_reduced_vocabulary(vocab_pair, tmp_path):
    """Rejection sampling with a reduced vocabulary samples drafts from it (mapped to target ids); DFlash2, whose
    selector gives no draft distribution, is refused for that method by name."""
    convert_checkpoint(*vocab_pair, tmp_path / "ckpt", dtype="float32")
    model = load_golden_model(tmp_path / "ckpt")
    held = set(model.draft.head.target_ids.tolist())
    assert len(held) == 40
    sampled = speculative_generate(model, [[3, 4, 5], [9, 10]], 24, sampling=SamplingParams(1.0, method=REFERENCE))
    drafts = {token for result in sampled for step in result.steps for token in step.draft_ids}
    assert drafts and drafts <= held


def test_reference_sampling_is_refused_for_dflash2(dflash2_pair, tmp_path):
    convert_checkpoint(*dflash2_pair, tmp_path / "ckpt", dtype="float32")
    model = load_golden_model(tmp_path / "ckpt")
    with pytest.raises(DFlashTrtError, match="DFlash2 drafter's selector does not give"):
        speculative_generate(model, [[3, 4, 5]], 8, sampling=SamplingParams(0.8, method=REFERENCE))
