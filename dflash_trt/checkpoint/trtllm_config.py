"""The converted checkpoint's `config.json` (docs/conversion.md): built from specs, and read back into specs.

TensorRT-LLM 1.2.x loads it as a `PretrainedConfig` (unknown keys ride along as attributes), our engine class reads
`dflash_config`, and the golden model rebuilds the exact specs from it, so the key spelling lives only here.
"""

from __future__ import annotations

from typing import Any

from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import DTYPES, NONE, quantization_config
from dflash_trt.rope import SCALING_FIELDS, RopeConfig
from dflash_trt.spec import DecoderSpec, DraftSpec, TargetSpec, check_dimension

ARCHITECTURE = "DFlashForCausalLM"
FORMAT_VERSION = 1

# The decoder-stack fields target and drafter share (`DecoderSpec`): spec attribute -> config.json key, in
# TensorRT-LLM's spelling. The target's sit at the top level, the drafter's in `dflash_config`.
DECODER_KEYS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_size",
    "rms_norm_eps": "norm_epsilon",
    "hidden_act": "hidden_act",
    "attention_bias": "attn_bias",
}


def rotary_scaling(rope: RopeConfig) -> dict[str, Any] | None:
    """TensorRT-LLM's `rotary_scaling` dict (`type` + the parameters that type uses), None for plain RoPE.

    Unset (None) parameters are left out: TensorRT-LLM 1.2.x reads them with `dict.get(key, default)`, which
    returns a present None instead of its default.
    """
    if rope.rope_type == "default":
        return None
    fields = {key: getattr(rope, key) for key in SCALING_FIELDS[rope.rope_type]}
    return {"type": rope.rope_type, **{key: value for key, value in fields.items() if value is not None}}


def rope_from_config(head_dim: int, base: float, scaling: dict[str, Any] | None) -> RopeConfig:
    fields = dict(scaling or {})
    rope_type = fields.pop("type", "default")
    return RopeConfig(head_dim=head_dim, theta=float(base), rope_type=rope_type, **fields)


def decoder_config(spec: DecoderSpec) -> dict[str, Any]:
    """The shared decoder fields of one spec, under their config.json keys (RoPE as base + `rotary_scaling`)."""
    fields = {key: getattr(spec, attribute) for attribute, key in DECODER_KEYS.items()}
    return {**fields, "rotary_base": spec.rope.theta, "rotary_scaling": rotary_scaling(spec.rope)}


def decoder_fields(section: dict[str, Any]) -> dict[str, Any]:
    """`decoder_config` read back: `DecoderSpec` keyword arguments (architecture and vocab size excepted)."""
    fields = {attribute: section[key] for attribute, key in DECODER_KEYS.items()}
    return {**fields, "rope": rope_from_config(section["head_size"], section["rotary_base"], section["rotary_scaling"])}


def checkpoint_config(
    target: TargetSpec,
    draft: DraftSpec,
    dtype: str,
    tp_size: int = 1,
    quantization: dict[str, Any] | None = None,
    draft_quantization: dict[str, Any] | None = None,
    vocab_size_padded: int | None = None,
) -> dict[str, Any]:
    if dtype not in DTYPES:
        raise DFlashTrtError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return {
        "architecture": ARCHITECTURE,
        "base_architecture": target.architecture,
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": target.vocab_size,
        "vocab_size_padded": vocab_size_padded or target.vocab_size,
        **decoder_config(target),
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": target.max_position_embeddings,
        "qk_layernorm": target.qk_norm,
        "mlp_bias": target.mlp_bias,
        "tie_word_embeddings": target.tie_word_embeddings,
        "eos_token_ids": list(target.eos_token_ids),
        "mapping": {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1},
        "quantization": quantization or quantization_config(NONE),
        "max_draft_len": draft.block_size - 1,
        "dflash_format_version": FORMAT_VERSION,
        "dflash_config": {
            "architecture": draft.architecture,
            **decoder_config(draft),
            "layer_types": list(draft.layer_types),
            "sliding_window": draft.sliding_window,
            "causal": list(draft.causal),
            "block_size": draft.block_size,
            "mask_token_id": draft.mask_token_id,
            "target_layer_ids": list(draft.target_layer_ids),
            "input_embedding_scale": draft.input_embedding_scale,
            "output_multiplier": draft.output_multiplier,
            "final_logit_softcapping": draft.final_logit_softcapping,
            "quantization": draft_quantization or quantization_config(NONE),
        },
    }


def _check_dimensions(spec: DecoderSpec, what: str) -> None:
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim"):
        check_dimension(getattr(spec, key), key, what)


def _malformed(exc: Exception) -> DFlashTrtError:
    return DFlashTrtError(f"checkpoint config.json is missing or has a malformed key: {exc}")


def target_spec_from_config(config: dict[str, Any]) -> TargetSpec:
    """The target's spec from a converted checkpoint's config.json (its top level)."""
    try:
        target = TargetSpec(
            architecture=config["base_architecture"],
            vocab_size=config["vocab_size"],
            **decoder_fields(config),
            mlp_bias=config["mlp_bias"],
            qk_norm=config["qk_layernorm"],
            tie_word_embeddings=config["tie_word_embeddings"],
            max_position_embeddings=config["max_position_embeddings"],
            eos_token_ids=tuple(config.get("eos_token_ids", [])),
        )
    except (KeyError, TypeError) as exc:
        raise _malformed(exc) from None
    _check_dimensions(target, "checkpoint")
    return target


def draft_spec_from_config(config: dict[str, Any]) -> DraftSpec:
    """The drafter's spec from a converted checkpoint's config.json (`dflash_config` + the shared vocabulary): the
    spec the converter parsed, for the golden model and the engine class alike."""
    try:
        d = config["dflash_config"]
        draft = DraftSpec(
            architecture=d["architecture"],
            vocab_size=config["vocab_size"],
            **decoder_fields(d),
            block_size=d["block_size"],
            mask_token_id=d["mask_token_id"],
            target_layer_ids=tuple(d["target_layer_ids"]),
            layer_types=tuple(d["layer_types"]),
            sliding_window=d["sliding_window"],
            causal=tuple(d["causal"]),
            input_embedding_scale=d["input_embedding_scale"],
            output_multiplier=d["output_multiplier"],
            final_logit_softcapping=d["final_logit_softcapping"],
        )
    except (KeyError, TypeError) as exc:
        raise _malformed(exc) from None
    _check_dimensions(draft, "checkpoint dflash_config")
    check_dimension(draft.block_size, "block_size", "checkpoint dflash_config", minimum=2)
    return draft


def specs_from_config(config: dict[str, Any]) -> tuple[TargetSpec, DraftSpec]:
    """Rebuild the exact specs the checkpoint was converted from."""
    if config.get("architecture") != ARCHITECTURE or "dflash_config" not in config:
        raise DFlashTrtError(f"not a dflash-trt checkpoint: config.json architecture is {config.get('architecture')!r}")
    return target_spec_from_config(config), draft_spec_from_config(config)
