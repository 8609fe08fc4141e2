"""The one rule of what a DFlash engine honours of a request's sampling parameters."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dflash_trt.sampling_rules import (
    DEFAULT_SEED,
    DEFAULT_TEMPERATURE,
    FEATURES,
    HONOURED,
    MAX_SAMPLING_TEMPERATURE,
    MAX_SEED,
    MIN_SAMPLING_TEMPERATURE,
    NEUTRAL,
    Sampling,
    SamplingRefused,
    effective_temperature,
    is_greedy,
    request_sampling,
    sampling_refusal,
)


def test_temperature_and_seed_are_honoured():
    assert HONOURED == ("temperature", "seed")
    assert request_sampling({}) == Sampling(temperature=0.0)  # never the runtime's default of 1.0
    assert request_sampling({"temperature": 0.7, "random_seed": 9}) == Sampling(temperature=0.7, seed=9)
    assert request_sampling({"temperature": None, "top_k": None}) == Sampling(temperature=0.0, seed=None)


def test_an_unsent_temperature_takes_the_edges_default_and_an_unsent_seed_the_runtimes():
    assert request_sampling({"seed": 4}, DEFAULT_TEMPERATURE) == Sampling(temperature=1.0, seed=4)
    assert Sampling(temperature=0.5).runtime_seed == DEFAULT_SEED == 0
    assert Sampling(temperature=0.5, seed=7).runtime_seed == 7


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"seed": -1}, "seed"),
        ({"seed": MAX_SEED + 1}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_a_sampling_record_refuses_what_the_engine_cannot_honour_and_names_it(fields, param):
    with pytest.raises(SamplingRefused) as refused:
        Sampling(**fields)
    assert refused.value.param == param and str(refused.value).startswith(param)
    assert Sampling(seed=MAX_SEED).seed == MAX_SEED and Sampling(temperature=2).temperature == 2.0


@pytest.mark.parametrize("name", sorted(NEUTRAL))
def test_every_other_parameter_is_accepted_only_when_neutral(name: str):
    for value in NEUTRAL[name]:
        assert sampling_refusal({"temperature": 0.9, name: value}) is None
    message = sampling_refusal({"temperature": 0.9, name: 7})
    assert message.startswith(f"{name} 7 refused: a DFlash engine samples with temperature and seed only")
    assert "omit it or send" in message
    with pytest.raises(SamplingRefused, match=f"^{name} 7 refused") as refused:
        request_sampling({name: 7})
    assert refused.value.param == name


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
        request_sampling({spelling: value})


@pytest.mark.parametrize("empty", [None, "", [], [""], [[]], ["", ""]])
def test_features_not_really_sent_are_accepted(empty):
    for name in FEATURES:
        assert sampling_refusal({name: empty}) is None


FLOAT32_MIN = float(np.float32(MIN_SAMPLING_TEMPERATURE))  # what the engine compares a float32 temperature with


@pytest.mark.parametrize(
    "temperature",
    [0.0, 1e-45, 1e-40, 2.0**-149, 5e-324, 1e-6, 9.9e-6, float(np.nextafter(np.float32(FLOAT32_MIN), np.float32(0)))],
)
def test_temperatures_too_small_to_invert_decode_greedily(temperature):
    """Hand values: 1e-40 and 1e-45 are float32 denormals whose inverse is inf; everything below the float32 value
    of 1e-5 (vLLM's greedy threshold) is greedy, and sent to the runtime as 0."""
    assert sampling_refusal({"temperature": temperature}) is None
    assert is_greedy(temperature) and effective_temperature(temperature) == 0.0
    assert (
        Sampling(temperature=temperature).temperature == request_sampling({"temperature": temperature}).temperature == 0
    )
    assert sampling_refusal({"temperature": temperature, "top_k": 1}) is None  # greedy, so top_k 1 is neutral


@pytest.mark.parametrize("temperature", [MIN_SAMPLING_TEMPERATURE, 1e-5 - 1e-13, 1e-4, 0.7, 1e29])
def test_temperatures_from_the_minimum_on_sample_as_given(temperature):
    """1e-5 - 1e-13 rounds to the same float32 as 1e-5: the rule splits values as the engine's float32 compare does."""
    assert np.float32(temperature) >= np.float32(FLOAT32_MIN)
    assert not is_greedy(temperature) and effective_temperature(temperature) == temperature


@pytest.mark.parametrize("temperature", [1e30, 3e38, 1e39, 1e300])
def test_huge_temperatures_sample_at_the_maximum(temperature):
    """Beyond 1e30 the distribution is uniform over the finite logits anyway; 3e38's float32 inverse would be a
    denormal and 1e39 is inf in float32, both of which make the sampler's weights NaN."""
    assert sampling_refusal({"temperature": temperature}) is None
    assert effective_temperature(temperature) == MAX_SAMPLING_TEMPERATURE


def test_a_refused_temperature_names_the_greedy_threshold():
    assert sampling_refusal({"temperature": -1e-40}) == (
        "temperature -1e-40 refused: it must be a finite number >= 0 (0, or anything below 1e-05, means greedy)"
    )
