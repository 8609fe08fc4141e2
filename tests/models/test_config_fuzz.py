"""Property test of config parsing: any JSON value in any key we read gives one clear error or the model it says.

Starting from the embedded tiny pair's real configs, one key at a time takes a random JSON value (wrong types,
strings that look like booleans or numbers, NaN, infinities, huge integers, nesting). The parser must raise
DFlashTrtError with a one-line message, or accept the value exactly as JSON means it: a bool key holds a JSON
boolean, an integer key a JSON integer, a number key a finite JSON number. Anything else (a traceback, the string
"false" read as true, a NaN epsilon) is a silently different model.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_trt.checkpoint.trtllm_config import checkpoint_config, specs_from_config
from dflash_trt.errors import DFlashTrtError
from dflash_trt.spec import DraftSpec, TargetSpec, parse_draft_config, parse_target_config
from dflash_trt.tiny.heldout import dflash2_draft_dir, draft_dir, target_dir

TARGET = json.loads((target_dir() / "config.json").read_text())
DRAFT = json.loads((draft_dir() / "config.json").read_text())
NO_DIR = Path(__file__).parents[1] / "data"  # holds no generation_config.json

# The JSON values a hand-edited or hostile config holds.
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, 2, -1, 16, 128, 10**400])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["false", "true", "128", "NaN", "1e-6", "silu", "default", "full_attention", ""])
    | st.text(max_size=8)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)

BOOL, INT, NUMBER, TEXT, OTHER = "bool", "int", "number", "text", "other"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond any float
        return False


# key path -> (kind, field of the parsed spec that must hold the value when accepted; None: no single field)
TARGET_KEYS: dict[tuple[str, ...], tuple[str, Callable[[TargetSpec], Any] | None]] = {
    ("architectures",): (OTHER, None),
    ("vocab_size",): (INT, lambda s: s.vocab_size),
    ("hidden_size",): (INT, lambda s: s.hidden_size),
    ("intermediate_size",): (INT, lambda s: s.intermediate_size),
    ("num_hidden_layers",): (INT, lambda s: s.num_hidden_layers),
    ("num_attention_heads",): (INT, lambda s: s.num_attention_heads),
    ("num_key_value_heads",): (INT, lambda s: s.num_key_value_heads),
    ("head_dim",): (INT, lambda s: s.head_dim),
    ("max_position_embeddings",): (INT, lambda s: s.max_position_embeddings),
    ("rms_norm_eps",): (NUMBER, lambda s: s.rms_norm_eps),
    ("hidden_act",): (TEXT, lambda s: s.hidden_act),
    ("attention_bias",): (BOOL, lambda s: s.attention_bias),
    ("mlp_bias",): (BOOL, None),  # Qwen3 has no MLP bias whatever the key says
    ("tie_word_embeddings",): (BOOL, lambda s: s.tie_word_embeddings),
    ("use_sliding_window",): (BOOL, None),
    ("eos_token_id",): (OTHER, None),
    ("dtype",): (TEXT, lambda s: s.torch_dtype),
    ("rope_parameters",): (OTHER, None),
    ("rope_scaling",): (OTHER, None),
    ("rope_parameters", "rope_theta"): (NUMBER, lambda s: s.rope.theta),
    ("rope_parameters", "rope_type"): (TEXT, lambda s: s.rope.rope_type),
    ("rope_parameters", "factor"): (NUMBER, None),
    ("rope_parameters", "low_freq_factor"): (NUMBER, lambda s: s.rope.low_freq_factor),
    ("rope_parameters", "high_freq_factor"): (NUMBER, lambda s: s.rope.high_freq_factor),
    ("rope_parameters", "original_max_position_embeddings"): (INT, None),
    ("rope_parameters", "partial_rotary_factor"): (NUMBER, None),
    ("rope_parameters", "attention_factor"): (NUMBER, lambda s: s.rope.attention_factor),
    ("rope_parameters", "mscale"): (NUMBER, lambda s: s.rope.mscale),
    ("rope_parameters", "truncate"): (BOOL, lambda s: s.rope.truncate),
}
DRAFT_KEYS: dict[tuple[str, ...], tuple[str, Callable[[DraftSpec], Any] | None]] = {
    ("architectures",): (OTHER, None),
    ("vocab_size",): (INT, lambda s: s.vocab_size),
    ("hidden_size",): (INT, lambda s: s.hidden_size),
    ("intermediate_size",): (INT, lambda s: s.intermediate_size),
    ("num_hidden_layers",): (INT, lambda s: s.num_hidden_layers),
    ("num_attention_heads",): (INT, lambda s: s.num_attention_heads),
    ("num_key_value_heads",): (INT, lambda s: s.num_key_value_heads),
    ("head_dim",): (INT, lambda s: s.head_dim),
    ("num_target_layers",): (INT, None),
    ("rms_norm_eps",): (NUMBER, lambda s: s.rms_norm_eps),
    ("hidden_act",): (TEXT, lambda s: s.hidden_act),
    ("attention_bias",): (BOOL, lambda s: s.attention_bias),
    ("block_size",): (INT, lambda s: s.block_size),
    ("dflash_config",): (OTHER, None),
    ("dflash_config", "mask_token_id"): (INT, lambda s: s.mask_token_id),
    ("dflash_config", "target_layer_ids"): (OTHER, None),
    ("dflash_config", "input_embedding_scale"): (NUMBER, lambda s: s.input_embedding_scale),
    ("dflash_config", "output_multiplier"): (NUMBER, lambda s: s.output_multiplier),
    ("dflash_config", "final_logit_softcapping"): (NUMBER, None),
    ("layer_types",): (OTHER, None),
    ("is_causal",): (BOOL, None),
    ("use_sliding_window",): (BOOL, None),
    ("sliding_window",): (INT, None),
    ("max_window_layers",): (INT, None),
    ("rope_parameters", "rope_theta"): (NUMBER, lambda s: s.rope.theta),
    ("rope_theta",): (NUMBER, None),
    ("dtype",): (TEXT, lambda s: s.torch_dtype),
}


# The embedded DFlash2 drafter's config, as speculators' save_pretrained wrote it.
SPECULATORS_DRAFT = json.loads((dflash2_draft_dir() / "config.json").read_text())
SPECULATORS_KEYS: dict[tuple[str, ...], tuple[str, Callable[[DraftSpec], Any] | None]] = {
    ("speculators_model_type",): (TEXT, None),
    ("aux_hidden_state_layer_ids",): (OTHER, None),
    ("mask_token_id",): (INT, lambda s: s.mask_token_id),
    ("block_size",): (INT, lambda s: s.block_size),
    ("draft_vocab_size",): (INT, None),
    ("sliding_window_non_causal",): (BOOL, None),
    ("sample_from_anchor",): (BOOL, lambda s: s.sample_from_anchor),
    ("conv_kernel_size",): (INT, lambda s: s.dflash2.conv_kernel_size),
    ("conv_group_size",): (INT, lambda s: s.dflash2.conv_group_size),
    ("selector_rank",): (INT, lambda s: s.dflash2.selector_rank),
    ("selector_top_k",): (INT, lambda s: s.dflash2.selector_top_k),
    ("target_hidden_size",): (INT, None),
    ("dtype",): (TEXT, lambda s: s.torch_dtype),
    ("transformer_layer_config",): (OTHER, None),
    ("transformer_layer_config", "model_type"): (TEXT, None),
    ("transformer_layer_config", "hidden_size"): (INT, lambda s: s.hidden_size),
    ("transformer_layer_config", "num_hidden_layers"): (INT, lambda s: s.num_hidden_layers),
    ("transformer_layer_config", "num_key_value_heads"): (INT, lambda s: s.num_key_value_heads),
    ("transformer_layer_config", "head_dim"): (INT, lambda s: s.head_dim),
    ("transformer_layer_config", "rms_norm_eps"): (NUMBER, lambda s: s.rms_norm_eps),
    ("transformer_layer_config", "layer_types"): (OTHER, None),
    ("transformer_layer_config", "sliding_window"): (INT, None),
    ("transformer_layer_config", "use_sliding_window"): (BOOL, None),
    ("transformer_layer_config", "rope_parameters"): (OTHER, None),
    ("transformer_layer_config", "vocab_size"): (INT, lambda s: s.vocab_size),
}


def _with(config: dict, path: tuple[str, ...], value: Any) -> dict:
    edited = copy.deepcopy(config)
    holder = edited
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    return edited


def _value_of_kind(kind: str, value: Any) -> bool:
    return {
        BOOL: lambda v: isinstance(v, bool),
        INT: _is_int,
        NUMBER: _is_number,
        TEXT: lambda v: isinstance(v, str),
        OTHER: lambda v: True,
    }[kind](value)


def _check(parse: Callable[[dict], Any], config: dict, path: tuple[str, ...], kind: str, field, value: Any) -> None:
    try:
        spec = parse(_with(config, path, value))
    except DFlashTrtError as exc:
        message = str(exc)
        assert "\n" not in message and len(message) < 400, message
        return
    if value is None:  # an absent value takes its documented default
        return
    assert _value_of_kind(kind, value), f"{'.'.join(path)} = {value!r} was accepted as a {kind}"
    if field is not None:
        got = field(spec)
        assert got == value and type(got) in (type(value), float), f"{'.'.join(path)}: {value!r} became {got!r}"


_FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_TARGET_SPEC = parse_target_config(TARGET, NO_DIR)


@pytest.mark.parametrize("path", list(TARGET_KEYS), ids=".".join)
@_FUZZ
@given(value=JSON_VALUES)
def test_any_value_in_a_target_key(path: tuple[str, ...], value: Any) -> None:
    kind, field = TARGET_KEYS[path]
    _check(lambda cfg: parse_target_config(cfg, NO_DIR), TARGET, path, kind, field, value)


@pytest.mark.parametrize("path", list(DRAFT_KEYS), ids=".".join)
@_FUZZ
@given(value=JSON_VALUES)
def test_any_value_in_a_drafter_key(path: tuple[str, ...], value: Any) -> None:
    kind, field = DRAFT_KEYS[path]
    _check(lambda cfg: parse_draft_config(cfg, _TARGET_SPEC), DRAFT, path, kind, field, value)


@pytest.mark.parametrize("path", list(SPECULATORS_KEYS), ids=".".join)
@_FUZZ
@given(value=JSON_VALUES)
def test_any_value_in_a_speculators_drafter_key(path: tuple[str, ...], value: Any) -> None:
    kind, field = SPECULATORS_KEYS[path]
    _check(lambda cfg: parse_draft_config(cfg, _TARGET_SPEC), SPECULATORS_DRAFT, path, kind, field, value)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("tie_word_embeddings",), "false", "'tie_word_embeddings' must be true or false, got 'false'"),
        (("attention_bias",), "false", "'attention_bias' must be true or false, got 'false'"),
        (("rms_norm_eps",), math.nan, "'rms_norm_eps' must be a finite number > 0, got nan"),
        (("rms_norm_eps",), -1e-6, "'rms_norm_eps' must be a finite number > 0"),
        (("rope_parameters", "rope_theta"), 0, "'rope_theta' must be a finite number > 0, got 0"),
        (("rope_parameters", "rope_theta"), -10000.0, "'rope_theta' must be a finite number > 0"),
        (("architectures",), "Qwen3ForCausalLM", "'architectures' must be a list of names, got 'Qwen3ForCausalLM'"),
        (("vocab_size",), "128", "'vocab_size' must be an integer >= 1 and <= 16777216, got '128'"),
    ],
)
def test_the_reported_target_values_are_refused_by_name(path, value, message) -> None:
    with pytest.raises(DFlashTrtError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_target_config(_with(TARGET, path, value), NO_DIR)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("attention_bias",), "false", "'attention_bias' must be true or false"),
        (("vocab_size",), "128", "'vocab_size' must be an integer"),
        (("rms_norm_eps",), math.inf, "'rms_norm_eps' must be a finite number > 0"),
        (("is_causal",), "no", "'is_causal' must be true or false"),
        (("dflash_config", "output_multiplier"), -1.0, "'output_multiplier' must be a finite number > 0"),
    ],
)
def test_the_reported_drafter_values_are_refused_by_name(path, value, message) -> None:
    with pytest.raises(DFlashTrtError, match=message):
        parse_draft_config(_with(DRAFT, path, value), _TARGET_SPEC)


def test_the_unedited_configs_parse() -> None:
    """The properties above start from configs that are valid as they are."""
    assert parse_draft_config(DRAFT, _TARGET_SPEC).block_size == DRAFT["block_size"]
    assert not _TARGET_SPEC.tie_word_embeddings and _TARGET_SPEC.rope.theta == 10000.0


# The converted checkpoint's own config.json, which generate and the engine build read back (an edit after
# conversion is caught by the integrity record; one without it must still be refused or read as it says).
CHECKPOINT = checkpoint_config(_TARGET_SPEC, parse_draft_config(DRAFT, _TARGET_SPEC), "float32")
CHECKPOINT_KEYS: dict[tuple[str, ...], tuple[str, Callable[[tuple[TargetSpec, DraftSpec]], Any] | None]] = {
    ("architecture",): (OTHER, None),
    ("vocab_size",): (INT, lambda s: s[0].vocab_size),
    ("hidden_size",): (INT, lambda s: s[0].hidden_size),
    ("num_hidden_layers",): (INT, lambda s: s[0].num_hidden_layers),
    ("head_size",): (INT, lambda s: s[0].head_dim),
    ("max_position_embeddings",): (INT, lambda s: s[0].max_position_embeddings),
    ("norm_epsilon",): (NUMBER, lambda s: s[0].rms_norm_eps),
    ("rotary_base",): (NUMBER, lambda s: s[0].rope.theta),
    ("rotary_scaling",): (OTHER, None),
    ("attn_bias",): (BOOL, lambda s: s[0].attention_bias),
    ("mlp_bias",): (BOOL, lambda s: s[0].mlp_bias),
    ("qk_layernorm",): (BOOL, lambda s: s[0].qk_norm),
    ("tie_word_embeddings",): (BOOL, lambda s: s[0].tie_word_embeddings),
    ("eos_token_ids",): (OTHER, None),
    ("dflash_config", "norm_epsilon"): (NUMBER, lambda s: s[1].rms_norm_eps),
    ("dflash_config", "attn_bias"): (BOOL, lambda s: s[1].attention_bias),
    ("dflash_config", "mask_token_id"): (INT, lambda s: s[1].mask_token_id),
    ("dflash_config", "block_size"): (INT, lambda s: s[1].block_size),
    ("dflash_config", "target_layer_ids"): (OTHER, None),
    ("dflash_config", "layer_types"): (OTHER, None),
    ("dflash_config", "causal"): (OTHER, None),
    ("dflash_config", "sliding_window"): (INT, lambda s: s[1].sliding_window),
    ("dflash_config", "input_embedding_scale"): (NUMBER, lambda s: s[1].input_embedding_scale),
    ("dflash_config", "output_multiplier"): (NUMBER, lambda s: s[1].output_multiplier),
    ("dflash_config", "final_logit_softcapping"): (NUMBER, lambda s: s[1].final_logit_softcapping),
    ("dflash_config", "checkpoint_format"): (TEXT, lambda s: s[1].checkpoint_format),
    ("dflash_config", "sample_from_anchor"): (BOOL, lambda s: s[1].sample_from_anchor),
    ("dflash_config", "window_from_anchor"): (BOOL, lambda s: s[1].window_from_anchor),
    ("dflash_config", "draft_vocab_size"): (INT, lambda s: s[1].draft_vocab_size),
    ("dflash_config", "dflash2"): (OTHER, None),
}
# The embedded DFlash2 drafter's converted config (DFlash2 keys present).
DFLASH2_CHECKPOINT = checkpoint_config(_TARGET_SPEC, parse_draft_config(SPECULATORS_DRAFT, _TARGET_SPEC), "float32")
DFLASH2_CHECKPOINT_KEYS: dict[tuple[str, ...], tuple[str, Callable[[tuple[TargetSpec, DraftSpec]], Any] | None]] = {
    ("dflash_config", "dflash2", key): (INT, lambda s, key=key: getattr(s[1].dflash2, key))
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
}


@pytest.mark.parametrize("path", list(CHECKPOINT_KEYS), ids=".".join)
@_FUZZ
@given(value=JSON_VALUES)
def test_any_value_in_a_checkpoint_config_key(path: tuple[str, ...], value: Any) -> None:
    kind, field = CHECKPOINT_KEYS[path]
    _check(specs_from_config, CHECKPOINT, path, kind, field, value)


@pytest.mark.parametrize("path", list(DFLASH2_CHECKPOINT_KEYS), ids=".".join)
@_FUZZ
@given(value=JSON_VALUES)
def test_any_value_in_a_dflash2_checkpoint_config_key(path: tuple[str, ...], value: Any) -> None:
    kind, field = DFLASH2_CHECKPOINT_KEYS[path]
    _check(specs_from_config, DFLASH2_CHECKPOINT, path, kind, field, value)


def test_the_unedited_checkpoint_config_reads_back() -> None:
    target, draft = specs_from_config(CHECKPOINT)  # the source dtype is not part of a converted checkpoint
    assert target == replace(_TARGET_SPEC, torch_dtype=None)
    assert draft == replace(parse_draft_config(DRAFT, _TARGET_SPEC), torch_dtype=None)
    _, dflash2 = specs_from_config(DFLASH2_CHECKPOINT)
    assert dflash2 == replace(parse_draft_config(SPECULATORS_DRAFT, _TARGET_SPEC), torch_dtype=None)
