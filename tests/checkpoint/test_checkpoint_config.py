"""The converted config.json round-trips the specs the converter parsed, through one key map for both directions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dflash_trt.checkpoint.trtllm_config import (
    DECODER_KEYS,
    checkpoint_config,
    draft_spec_from_config,
    specs_from_config,
)
from dflash_trt.errors import DFlashTrtError
from dflash_trt.rope import RopeConfig
from dflash_trt.spec import DecoderSpec, load_draft_spec, load_target_spec


def test_the_key_map_covers_every_shared_decoder_field() -> None:
    written_elsewhere = {"architecture", "vocab_size", "rope"}  # base_architecture / vocab_size / rotary_* keys
    assert set(DECODER_KEYS) == {f.name for f in dataclasses.fields(DecoderSpec)} - written_elsewhere


def test_specs_round_trip_through_config_json(pair: tuple[Path, Path]) -> None:
    target = load_target_spec(pair[0])
    draft = load_draft_spec(pair[1], target)
    config = json.loads(json.dumps(checkpoint_config(target, draft, "bfloat16", tp_size=2)))
    # The source dtype is the only field the converted checkpoint does not record (its own `dtype` replaces it).
    expected = (dataclasses.replace(target, torch_dtype=None), dataclasses.replace(draft, torch_dtype=None))
    assert specs_from_config(config) == expected
    assert draft_spec_from_config(config) == expected[1]
    assert config["dflash_config"]["head_size"] == draft.head_dim and config["norm_epsilon"] == target.rms_norm_eps


def test_yarn_rope_survives_the_round_trip(pair: tuple[Path, Path]) -> None:
    target = load_target_spec(pair[0])
    draft = dataclasses.replace(
        load_draft_spec(pair[1], target),
        rope=RopeConfig(16, 1e6, "yarn", factor=4.0, original_max_position_embeddings=128),
    )
    config = json.loads(json.dumps(checkpoint_config(target, draft, "float32")))
    assert draft_spec_from_config(config).rope == draft.rope


def test_a_missing_drafter_key_is_one_clear_error(pair: tuple[Path, Path]) -> None:
    target = load_target_spec(pair[0])
    config = checkpoint_config(target, load_draft_spec(pair[1], target), "float32")
    del config["dflash_config"]["norm_epsilon"]
    with pytest.raises(
        DFlashTrtError, match="checkpoint config.json is missing or has a malformed key: 'norm_epsilon'"
    ):
        draft_spec_from_config(config)
