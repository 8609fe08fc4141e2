"""The one rule of what a DFlash engine honours of a request's sampling parameters."""

from __future__ import annotations

import math

import pytest

from dflash_trt.sampling_rules import (
    FEATURES,
    HONOURED,
    NEUTRAL,
    SamplingRefused,
    engine_request_sampling,
    sampling_refusal,
)


def test_temperature_and_seed_are_honoured():
    assert HONOURED == ("temperature", "seed")
    assert engine_request_sampling({}) == {"temperature": 0.0}  # never the runtime's default of 1.0
    assert engine_request_sampling({"temperature": 0.7, "random_seed": 9}) == {"temperature": 0.7, "seed": 9}
    assert engine_request_sampling({"temperature": None, "top_k": None}) == {"temperature": 0.0}


@pytest.mark.parametrize("name", sorted(NEUTRAL))
def test_every_other_parameter_is_accepted_only_when_neutral(name: str):
    for value in NEUTRAL[name]:
        assert sampling_refusal({"temperature": 0.9, name: value}) is None
    message = sampling_refusal({"temperature": 0.9, name: 7})
    assert message.startswith(f"{name} 7 refused: a DFlash engine samples with temperature and seed only")
    assert "omit it or send" in message
    with pytest.raises(SamplingRefused, match=f"^{name} 7 refused"):
        engine_request_sampling({name: 7})


@pytest.mark.parametrize(
    "alias, name",
    [
        ("runtime_top_k", "top_k"),
        ("runtime_top_p", "top_p"),
        ("num_beams", "beam_width"),
        ("n", "num_return_sequences"),
        ("min_length", "min_tokens"),
    ],
)
def test_other_spellings_are_the_same_parameter(alias: str, name: str):
    assert sampling_refusal({alias: 3}).startswith(f"{name} 3 refused")


def test_top_k_one_means_greedy_and_needs_temperature_zero():
    assert sampling_refusal({"top_k": 1}) is None
    assert sampling_refusal({"top_k": 1, "temperature": 0.5}).startswith("top_k 1 refused")


@pytest.mark.parametrize("temperature", [-0.1, math.nan, math.inf, "hot"])
def test_bad_temperatures_are_refused(temperature):
    assert "must be a finite number >= 0" in sampling_refusal({"temperature": temperature})


@pytest.mark.parametrize(
    "name, spelling, value",
    [
        ("bad_words", "bad_words", ["fox"]),
        ("bad_words", "bad_words_list", [[[17, 18], [2, -1]]]),
        ("guided_decoding", "guided_decoding_guide_type", "json_schema"),
        ("guided_decoding", "guided_decoding_params", {"guide": "{}"}),
        ("logits_post_processor", "logits_post_processor_name", "my_processor"),
        ("embedding_bias", "embedding_bias_words", ["fox"]),
        ("embedding_bias", "embedding_bias_weights", [0.5]),
    ],
)
def test_request_features_the_eagle_mode_never_applies_are_refused(name: str, spelling: str, value):
    message = sampling_refusal({"temperature": 0.0, spelling: value})
    assert message.startswith(f"{name} refused: it ") and message.endswith("so it would be silently ignored; omit it")
    with pytest.raises(SamplingRefused, match=f"^{name} refused"):
        engine_request_sampling({spelling: value})


@pytest.mark.parametrize("empty", [None, "", [], [""], [[]], ["", ""]])
def test_features_not_really_sent_are_accepted(empty):
    for name in FEATURES:
        assert sampling_refusal({name: empty}) is None
