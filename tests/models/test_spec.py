"""Spec parsing against what `transformers` and the `dflash` reference derive from the same config.json."""

from __future__ import annotations

import json

import pytest
import torch
from dflash.model import DFlashDraftModel
from dflash.model import build_target_layer_ids as reference_taps
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dflash_trt.errors import DFlashTrtError
from dflash_trt.rope import inv_freq_and_scale
from dflash_trt.spec import (
    build_target_layer_ids,
    load_draft_spec,
    load_target_spec,
    parse_draft_config,
    parse_target_config,
)


def _configs(pair):
    target_dir, draft_dir = pair
    return json.loads((target_dir / "config.json").read_text()), json.loads((draft_dir / "config.json").read_text())


def test_target_spec_reads_hf_fields(pair):
    spec = load_target_spec(pair[0])
    assert (spec.architecture, spec.hidden_size, spec.num_hidden_layers) == ("Qwen3ForCausalLM", 64, 4)
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (4, 2, 16)
    assert spec.qk_norm and not spec.tie_word_embeddings
    assert 1 in spec.eos_token_ids


@pytest.mark.parametrize("num_target, num_draft", [(36, 5), (36, 1), (28, 3), (61, 6), (4, 2)])
def test_default_taps_match_reference(num_target, num_draft):
    assert build_target_layer_ids(num_target, num_draft) == reference_taps(num_target, num_draft)


def test_draft_keys_may_sit_top_level_or_in_dflash_config(pair):
    target_cfg, draft_cfg = _configs(pair)
    target = parse_target_config(target_cfg)
    nested = dict(
        draft_cfg,
        block_size=4,
        dflash_config={"block_size": 16, "mask_token_id": 5, "target_layer_ids": [1, 3], "output_multiplier": 0.5},
    )
    spec = parse_draft_config(nested, target)
    assert (spec.block_size, spec.mask_token_id, spec.target_layer_ids, spec.output_multiplier) == (16, 5, (1, 3), 0.5)
    top = dict(
        draft_cfg,
        block_size=4,
        mask_token_id=7,
        target_layer_ids=[2],
        input_embedding_scale=3.0,
        final_logit_softcapping=30.0,
        dflash_config={},
    )
    spec = parse_draft_config(top, target)
    assert (spec.block_size, spec.mask_token_id, spec.target_layer_ids) == (4, 7, (2,))
    assert (spec.input_embedding_scale, spec.final_logit_softcapping) == (3.0, 30.0)


def test_missing_taps_use_reference_default(pair):
    target_cfg, draft_cfg = _configs(pair)
    draft_cfg["dflash_config"].pop("target_layer_ids")
    spec = parse_draft_config(draft_cfg, parse_target_config(target_cfg))
    assert list(spec.target_layer_ids) == reference_taps(draft_cfg["num_target_layers"], draft_cfg["num_hidden_layers"])


@pytest.mark.parametrize(
    "extra",
    [
        {
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "use_sliding_window": True,
            "sliding_window": 6,
        },
        {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 6},
        {"use_sliding_window": True, "sliding_window": 9, "max_window_layers": 1},
        {"is_causal": True},
        {"is_causal": False, "layer_types": ["sliding_attention"] * 3, "use_sliding_window": True, "sliding_window": 4},
    ],
)
def test_layer_kinds_match_reference_attention_modules(pair, extra):
    """Per-layer causality and window exactly as DFlashDraftModel's attention modules derive them."""
    target_cfg, draft_cfg = _configs(pair)
    draft_cfg = {k: v for k, v in draft_cfg.items() if k not in ("layer_types", "sliding_window", "use_sliding_window")}
    draft_cfg.update(num_hidden_layers=3, **extra)
    spec = parse_draft_config(draft_cfg, parse_target_config(target_cfg))
    hf_cfg = Qwen3Config(**{k: v for k, v in draft_cfg.items() if k not in ("architectures",)})
    modules = DFlashDraftModel(hf_cfg).layers
    assert spec.causal == tuple(m.self_attn.is_causal for m in modules)
    assert tuple(spec.layer_window(i) for i in range(3)) == tuple(m.self_attn.sliding_window for m in modules)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 1e6},
        {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 4096},
        {
            "rope_type": "yarn",
            "rope_theta": 5e4,
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ],
)
def test_rope_tables_match_transformers(rope):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 512,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rope_parameters": rope,
    }
    spec = parse_target_config(cfg)
    hf = Qwen3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    want_freq, want_scale = (
        ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
        if rope["rope_type"] != "default"
        else (1.0 / (rope["rope_theta"] ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128)), 1.0)
    )
    freq, scale = inv_freq_and_scale(spec.rope)
    torch.testing.assert_close(freq, want_freq.float(), rtol=0, atol=0)
    assert scale == pytest.approx(want_scale)


def test_legacy_rope_scaling_keys_are_read():
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    spec = parse_target_config(cfg)
    assert (spec.rope.rope_type, spec.rope.theta, spec.rope.factor, spec.head_dim) == ("llama3", 500000.0, 8.0, 16)


BAD_DRAFTS = [
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2 drafter config: 'conv_kernel_size' must be an integer >= 1"),
    ({"architectures": ["LlamaForCausalLM"]}, "is not a DFlash drafter"),
    ({"hidden_size": 32}, "hidden sizes differ: drafter hidden_size 32 != target hidden_size 64"),
    ({"vocab_size": 100}, "vocab mismatch: drafter vocab_size 100 != target vocab_size 96"),
    ({"dflash_config": {"mask_token_id": 96, "target_layer_ids": [0]}}, "mask_token_id 96 is outside the target"),
    (
        {"dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 4]}},
        "target layer id 4 is outside the target's 4 layers",
    ),
    ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": []}}, "'target_layer_ids' must be a non-empty list"),
    ({"block_size": 1}, "'block_size' must be an integer >= 2"),
    ({"block_size": 10**6}, "'block_size' must be an integer >= 2 and <= 1024"),
    ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads (3)"),
    ({"layer_types": ["full_attention"]}, "'layer_types' must list one kind per draft layer (2)"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope type 'dynamic'"),
]


@pytest.mark.parametrize("change, message", BAD_DRAFTS)
def test_bad_drafter_configs_are_refused_with_clear_messages(pair, change, message):
    target_cfg, draft_cfg = _configs(pair)
    draft_cfg.update(change)
    with pytest.raises(DFlashTrtError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_draft_config(draft_cfg, parse_target_config(target_cfg))


def test_taps_may_outnumber_draft_layers(pair):
    target_cfg, draft_cfg = _configs(pair)
    draft_cfg["dflash_config"]["target_layer_ids"] = [0, 1, 2, 3]
    assert len(parse_draft_config(draft_cfg, parse_target_config(target_cfg)).target_layer_ids) == 4


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["MistralForCausalLM"]}, "target architecture 'MistralForCausalLM' is not supported"),
        ({"hidden_size": 0}, "'hidden_size' must be an integer >= 1"),
        ({"head_dim": 15}, "'head_dim' must be even for rotary embeddings, got 15"),
        ({"num_hidden_layers": 10**9}, "'num_hidden_layers' must be an integer >= 1 and <= 1024"),
        ({"vocab_size": 2**40}, "'vocab_size' must be an integer >= 1 and <= 16777216"),
        ({"num_key_value_heads": -2}, "'num_key_value_heads' must be an integer >= 1"),
        ({"use_sliding_window": True}, "sliding-window attention in the target is not supported yet"),
    ],
)
def test_bad_target_configs_are_refused(pair, change, message):
    target_cfg, _ = _configs(pair)
    target_cfg.update(change)
    with pytest.raises(DFlashTrtError, match=message):
        parse_target_config(target_cfg)


def test_unreadable_config_is_one_clear_error(tmp_path):
    with pytest.raises(DFlashTrtError, match="has no config.json"):
        load_target_spec(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DFlashTrtError, match="is not valid JSON"):
        load_draft_spec(tmp_path, None)
