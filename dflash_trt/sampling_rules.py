"""What a DFlash engine honours of a request's sampling parameters, and the one message that refuses the rest.

The engine samples each request with its temperature and the runtime's random numbers, which TensorRT-LLM 1.2.x
seeds from the request's seed (docs/engine.md §6); temperature 0 is greedy, and so is every temperature too small for
float32 to invert (`effective_temperature`, the one rule every path applies). Its EAGLE runtime hands the engine
nothing else of the request's sampling config, so top-k, top-p, penalties and beams would be silently ignored, and
its EAGLE decoding mode applies no banned words, guided decoding, logits post-processor or embedding bias: every
entry point (`generate`, the engine runners, the Triton models, `bench`) refuses them here instead, with one message.

Standard library only: the Triton repository copies this file next to its Python models.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# What the engine honours per request; `dflash_trt.json` records it.
HONOURED = ("temperature", "seed")
# Temperatures below MIN_SAMPLING_TEMPERATURE decode greedily (vLLM's precedent: below 1e-5 is greedy), and those above
# MAX_SAMPLING_TEMPERATURE sample as at it (uniformly over the finite logits, for any model): in float32 (what the
# runtime carries a temperature in, and the engine divides by) the inverse of 1e-40 is inf and that of 3e38
# underflows, both of which turn the sampler's weights into NaN. Compared in float32, so the engine network and
# the Python paths split every value the same way (docs/engine.md §6).
MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_SAMPLING_TEMPERATURE = 1e30
# torch.Generator seeds are 64-bit; the largest positive one keeps the value meaningful on every platform.
MAX_SEED = 2**63 - 1
# What TensorRT-LLM's runtime (and so the tensorrtllm backend) samples a request at when it sends no temperature, and
# OpenAI's default too; this toolkit's own commands and load generator default to greedy (0) instead.
DEFAULT_TEMPERATURE = 1.0
# What a temperature must be (the engine samples softmax(logits / T)).
TEMPERATURE_RULE = f"a finite number >= 0 (0, or anything below {MIN_SAMPLING_TEMPERATURE:g}, means greedy)"
# The runtime's seed for a request that sends none (executor SamplingConfig, the tensorrtllm backend's `random_seed`).
DEFAULT_SEED = 0
# How the engine verifies drafts at temperature > 0: argmax drafts, one target sample per position, accepted while
# it equals the draft (the first mismatching sample is the bonus token). Exactly the target's distribution.
ENGINE_SAMPLING = "exact_match"
# The golden loop's two lossless acceptance rules at temperature > 0 (`generate --sampling`): the engine's above,
# and `dflash_generate`'s rejection sampling of sampled drafts (dflash_trt.reference.sampling runs both).
ENGINE = "engine"
REFERENCE = "reference"
METHODS = (ENGINE, REFERENCE)

# Every other parameter a TensorRT-LLM or Triton user may send, with the values that switch it off.
NEUTRAL: dict[str, tuple[float, ...]] = {
    "top_k": (0,),
    "top_p": (1.0,),
    "min_p": (0.0,),
    "repetition_penalty": (1.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "length_penalty": (0.0, 1.0),
    "no_repeat_ngram_size": (0,),
    "min_tokens": (0, 1),
    "beam_width": (1,),
    "num_return_sequences": (1,),
}
# Request features the EAGLE decoding mode never applies (1.2.x `executor/types.h` `DecodingMode::Eagle()` sets
# neither ban-words nor penalties; the engine's in-graph verification sees raw logits), with what they do. Any
# non-empty value is refused.
FEATURES = {
    "bad_words": "bans words",
    "guided_decoding": "constrains tokens to a grammar, JSON schema or regex",
    "logits_post_processor": "edits the logits",
    "embedding_bias": "adds a bias to the logits",
}
# Other spellings of the same parameters (TensorRT-LLM's executor and Triton backend, Hugging Face).
ALIASES = {
    "runtime_top_k": "top_k",
    "runtime_top_p": "top_p",
    "num_beams": "beam_width",
    "n": "num_return_sequences",
    "min_length": "min_tokens",
    "random_seed": "seed",
    "bad_words_list": "bad_words",
    "guided_decoding_params": "guided_decoding",
    "guided_decoding_guide_type": "guided_decoding",
    "guided_decoding_guide": "guided_decoding",
    "logits_post_processor_name": "logits_post_processor",
    "embedding_bias_words": "embedding_bias",
    "embedding_bias_weights": "embedding_bias",
}


def _show(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _sent(value: object) -> bool:
    """Whether a feature was really asked for: None, an empty string and an empty (nested) sequence are not."""
    if isinstance(value, str):
        return value != ""
    if isinstance(value, Sequence) or hasattr(value, "tolist"):
        items = value.tolist() if hasattr(value, "tolist") else value
        return any(_sent(item) for item in items) if isinstance(items, list | tuple) else _sent(items)
    return value is not None


def temperature_refusal(temperature: object) -> str | None:
    """Why the engine cannot sample at `temperature`, or None."""
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        return f"temperature {temperature!r} refused: it must be {TEMPERATURE_RULE}"
    return None


def seed_refusal(seed: object) -> str | None:
    """Why `seed` cannot seed a request, or None."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        return f"seed must lie in [0, {MAX_SEED}], got {seed!r}"
    return None


def _canonical(params: Mapping[str, Any]) -> dict[str, Any]:
    return {ALIASES.get(name, name): value for name, value in params.items() if value is not None}


def first_refusal(params: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first parameter or request feature the engine cannot honour, as (its name, the refusal message), or None.

    `params` maps parameter names (any spelling in ALIASES) to scalars, and FEATURES to their values (a word list,
    a guide, a name); None means "not sent". Names outside HONOURED, NEUTRAL and FEATURES are left to the caller.
    """
    values = _canonical(params)
    for name, effect in FEATURES.items():
        if _sent(values.get(name)):
            return name, (
                f"{name} refused: it {effect}, which TensorRT-LLM's EAGLE decoding mode never applies to a DFlash "
                "engine, so it would be silently ignored; omit it"
            )
    temperature = values.get("temperature", 0.0)
    refused = temperature_refusal(temperature)
    if refused is not None:
        return "temperature", refused
    for name, neutral in NEUTRAL.items():
        value = values.get(name)
        if value is None or value in neutral or (name == "top_k" and value == 1 and is_greedy(temperature)):
            continue
        allowed = " or ".join(_show(v) for v in neutral)
        return name, (
            f"{name} {_show(value)} refused: a DFlash engine samples with temperature and seed only "
            f"(TensorRT-LLM's EAGLE runtime never passes {name} to the engine, so it would be silently ignored); "
            f"omit it or send {allowed}"
        )
    return None


def sampling_refusal(params: Mapping[str, Any]) -> str | None:
    """`first_refusal`'s message alone."""
    refused = first_refusal(params)
    return None if refused is None else refused[1]


def as_float32(value: float) -> float:
    """`value` rounded to float32, as the runtime stores a temperature (inf beyond float32's range)."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def is_greedy(temperature: float) -> bool:
    """Whether a (finite, >= 0) temperature decodes greedily: 0, or below MIN_SAMPLING_TEMPERATURE in float32."""
    return as_float32(temperature) < as_float32(MIN_SAMPLING_TEMPERATURE)


def effective_temperature(temperature: float) -> float:
    """The temperature a request samples at: 0.0 (greedy) below MIN_SAMPLING_TEMPERATURE, at most
    MAX_SAMPLING_TEMPERATURE, else as given. The engine network applies the same rule in-graph (trtllm/verify.py)."""
    if is_greedy(temperature):
        return 0.0
    return min(float(temperature), MAX_SAMPLING_TEMPERATURE)


class SamplingRefused(ValueError):
    """A request asked for sampling the engine cannot honour; the message says which parameter (`param`) and why."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How one request samples, normalised once at the edge it arrived through (an HTTP body, a command's flags, a
    Triton request's tensors) and carried unchanged to the engine. `temperature` is the one it samples at
    (`effective_temperature`: 0, greedy, below MIN_SAMPLING_TEMPERATURE; capped at MAX_SAMPLING_TEMPERATURE); `seed`
    None leaves the seed to the runtime (`DEFAULT_SEED`). A value the engine cannot honour is refused here, at
    construction."""

    temperature: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        refused = temperature_refusal(self.temperature)
        if refused is not None:
            raise SamplingRefused(refused, "temperature")
        refused = None if self.seed is None else seed_refusal(self.seed)
        if refused is not None:
            raise SamplingRefused(refused, "seed")
        object.__setattr__(self, "temperature", effective_temperature(self.temperature))

    @property
    def runtime_seed(self) -> int:
        """The seed the runtime draws this request's random numbers from."""
        return DEFAULT_SEED if self.seed is None else self.seed


GREEDY = Sampling()


def request_sampling(params: Mapping[str, Any], default_temperature: float = 0.0) -> Sampling:
    """A request's `Sampling` from the parameters it sent (any spelling in ALIASES; None means "not sent"), after
    refusing (SamplingRefused, naming the parameter) anything the engine cannot honour. An unsent temperature is
    `default_temperature`: greedy for this toolkit's own commands, `DEFAULT_TEMPERATURE` where the edge promises the
    runtime's or OpenAI's default."""
    values = {"temperature": default_temperature, **_canonical(params)}
    refused = first_refusal(values)
    if refused is not None:
        raise SamplingRefused(refused[1], refused[0])
    return Sampling(temperature=values["temperature"], seed=values.get("seed"))
