"""The converted checkpoint's `config.json` (docs/conversion.md): built from specs, and read back into specs.

TensorRT-LLM 1.2.x loads it as a `PretrainedConfig` (unknown keys ride along as attributes), our engine class reads
`dflash_config`, and the golden model rebuilds the exact specs from it, so the key spelling lives only here.
"""

from __future__ import annotations

import math
from typing import Any

from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import DTYPES, NONE, quantization_config
from dflash_trt.rope import SCALING_FIELDS, RopeConfig
from dflash_trt.spec import (
    DRAFT_FORMATS,
    EMBEDDING_TAP,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ZLAB_FORMAT,
    ConvSelectorSpec,
    DecoderSpec,
    DraftSpec,
    MoeSpec,
    TargetSpec,
    check_dimension,
)

ARCHITECTURE = "DFlashForCausalLM"
# TensorRT-LLM's MoeConfig.ExpertScaleNormalizationMode: NONE = softmax over all experts, then top-k (weights as
# they are); RENORMALIZE = top-k of the router logits, softmax over them (= Qwen3-MoE's norm_topk_prob).
MOE_NORMALIZATION_NONE = 0
MOE_NORMALIZATION_RENORMALIZE = 1
FORMAT_VERSION = 1
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

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
    if not _positive_finite(base):
        raise DFlashTrtError(f"checkpoint config.json: 'rotary_base' must be a finite number > 0, got {base!r:.80}")
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
    moe_ep_size: int = 1,
) -> dict[str, Any]:
    if dtype not in DTYPES:
        raise DFlashTrtError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    config: dict[str, Any] = {
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
        "max_draft_len": draft.num_drafts,
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
            **draft_extras_config(draft),
            "quantization": draft_quantization or quantization_config(NONE),
        },
    }
    if target.moe is not None:
        config.update(moe_config(target.moe))
        config["mapping"].update(moe_tp_size=tp_size // moe_ep_size, moe_ep_size=moe_ep_size)
    return config


def draft_extras_config(draft: DraftSpec) -> dict[str, Any]:
    """What DFlash2 and speculators-format drafters add to `dflash_config` (absent in checkpoints written before
    them, which read back as a z-lab DFlash drafter)."""
    conv = draft.dflash2
    return {
        "checkpoint_format": draft.checkpoint_format,
        "sample_from_anchor": draft.sample_from_anchor,
        "window_from_anchor": draft.window_from_anchor,
        "draft_vocab_size": draft.draft_vocab_size,
        "dflash2": None if conv is None else {key: getattr(conv, key) for key in DFLASH2_KEYS},
    }


def draft_extras_fields(d: dict[str, Any]) -> dict[str, Any]:
    """`draft_extras_config` read back: `DraftSpec` keyword arguments."""
    conv = d.get("dflash2")
    return {
        "checkpoint_format": d.get("checkpoint_format", ZLAB_FORMAT),
        "sample_from_anchor": d.get("sample_from_anchor", False),
        "window_from_anchor": d.get("window_from_anchor", False),
        "draft_vocab_size": d.get("draft_vocab_size"),
        "dflash2": None if conv is None else ConvSelectorSpec(**{key: conv[key] for key in DFLASH2_KEYS}),
    }


def moe_config(moe: MoeSpec) -> dict[str, Any]:
    """The keys TensorRT-LLM's QWenConfig (qwen_type qwen3_moe) reads (`moe` is a MoeConfig dict), plus the list
    of sparse layers the golden model needs when some layers keep a dense MLP."""
    normalization = MOE_NORMALIZATION_RENORMALIZE if moe.norm_topk_prob else MOE_NORMALIZATION_NONE
    return {
        "moe": {"num_experts": moe.num_experts, "top_k": moe.top_k, "normalization_mode": normalization},
        "moe_intermediate_size": moe.intermediate_size,
        "moe_sparse_layers": list(moe.sparse_layers),
    }


def moe_from_config(config: dict[str, Any]) -> MoeSpec | None:
    if "moe" not in config:
        return None
    moe = config["moe"]
    if moe["normalization_mode"] not in (MOE_NORMALIZATION_NONE, MOE_NORMALIZATION_RENORMALIZE):
        raise DFlashTrtError(
            f"checkpoint config.json: unsupported moe normalization_mode {moe['normalization_mode']!r}"
        )
    spec = MoeSpec(
        num_experts=check_dimension(moe["num_experts"], "num_experts", "checkpoint", minimum=2),
        top_k=check_dimension(moe["top_k"], "num_experts_per_tok", "checkpoint"),
        intermediate_size=check_dimension(config["moe_intermediate_size"], "moe_intermediate_size", "checkpoint"),
        norm_topk_prob=moe["normalization_mode"] == MOE_NORMALIZATION_RENORMALIZE,
        sparse_layers=tuple(config["moe_sparse_layers"]),
    )
    layers = range(config["num_hidden_layers"])
    if spec.top_k > spec.num_experts or not all(type(i) is int and i in layers for i in spec.sparse_layers):
        raise DFlashTrtError("checkpoint config.json: malformed moe top_k or moe_sparse_layers")
    return spec


def _check_dimensions(spec: DecoderSpec, what: str) -> None:
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    ):
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
            moe=moe_from_config(config),
        )
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise _malformed(exc) from None
    _check_dimensions(target, "checkpoint")
    check_dimension(target.max_position_embeddings, "max_position_embeddings", "checkpoint")
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
            **draft_extras_fields(d),
        )
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise _malformed(exc) from None
    _check_dimensions(draft, "checkpoint dflash_config")
    check_dimension(draft.block_size, "block_size", "checkpoint dflash_config", minimum=2)
    return draft


def specs_from_config(config: dict[str, Any]) -> tuple[TargetSpec, DraftSpec]:
    """Rebuild the exact specs the checkpoint was converted from."""
    if config.get("architecture") != ARCHITECTURE or "dflash_config" not in config:
        raise DFlashTrtError(
            f"not a dflash-trt checkpoint: config.json architecture is {config.get('architecture')!r:.80}"
        )
    target, draft = target_spec_from_config(config), draft_spec_from_config(config)
    _check_values(target, draft)
    return target, draft


def _positive_finite(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return 0 < float(value) < math.inf
    except OverflowError:  # an integer beyond any float
        return False


def _check_values(target: TargetSpec, draft: DraftSpec) -> None:
    """The values the golden model and the engine compute with, by type and meaning: a config edited by hand (a
    string "false", a NaN epsilon, a tap past the last layer) must not decode into silently wrong text."""
    flags: dict[str, object] = {
        "attn_bias": target.attention_bias,
        "mlp_bias": target.mlp_bias,
        "qk_layernorm": target.qk_norm,
        "tie_word_embeddings": target.tie_word_embeddings,
        "dflash_config.attn_bias": draft.attention_bias,
    }
    flags.update({f"dflash_config.causal[{i}]": causal for i, causal in enumerate(draft.causal)})
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise DFlashTrtError(f"checkpoint config.json: '{key}' must be true or false, got {value!r:.80}")
    positive = {
        "norm_epsilon": target.rms_norm_eps,
        "rotary_base": target.rope.theta,
        "dflash_config.norm_epsilon": draft.rms_norm_eps,
        "dflash_config.rotary_base": draft.rope.theta,
        "dflash_config.input_embedding_scale": draft.input_embedding_scale,
        "dflash_config.output_multiplier": draft.output_multiplier,
        "dflash_config.final_logit_softcapping": draft.final_logit_softcapping,
    }
    for key, number in positive.items():
        if key.endswith("softcapping") and number is None:
            continue
        if not _positive_finite(number):
            raise DFlashTrtError(f"checkpoint config.json: '{key}' must be a finite number > 0, got {number!r:.80}")
    ids = {"dflash_config.mask_token_id": [draft.mask_token_id], "eos_token_ids": list(target.eos_token_ids)}
    ids["dflash_config.target_layer_ids"] = list(draft.target_layer_ids)
    bounds = {"dflash_config.target_layer_ids": (EMBEDDING_TAP, target.num_hidden_layers)}
    for key, values in ids.items():
        low, bound = bounds.get(key, (0, target.vocab_size))
        if (
            not values
            and key != "eos_token_ids"
            or any(isinstance(v, bool) or not isinstance(v, int) or not low <= v < bound for v in values)
        ):
            raise DFlashTrtError(
                f"checkpoint config.json: '{key}' must hold integers in [{low}, {bound}), got {values!r:.80}"
            )
    kinds = draft.layer_types
    if (
        len(kinds) != draft.num_hidden_layers
        or len(draft.causal) != len(kinds)
        or not all(kind in (FULL_ATTENTION, SLIDING_ATTENTION) for kind in kinds)
    ):
        raise DFlashTrtError(
            "checkpoint config.json: dflash_config.layer_types / causal must name one known "
            "attention kind per draft layer"
        )
    if draft.sliding_window is not None:
        check_dimension(draft.sliding_window, "sliding_window", "checkpoint dflash_config")
    _check_draft_extras(target, draft)


def _check_draft_extras(target: TargetSpec, draft: DraftSpec) -> None:
    """The DFlash2 and speculators-format fields of `dflash_config`, by type and meaning."""
    what = "checkpoint dflash_config"
    for key in ("sample_from_anchor", "window_from_anchor"):
        if not isinstance(getattr(draft, key), bool):
            raise DFlashTrtError(f"checkpoint config.json: 'dflash_config.{key}' must be true or false")
    if draft.checkpoint_format not in DRAFT_FORMATS:
        raise DFlashTrtError(
            f"checkpoint config.json: 'dflash_config.checkpoint_format' must be one of {', '.join(DRAFT_FORMATS)}"
        )
    if draft.draft_vocab_size is not None:
        check_dimension(draft.draft_vocab_size, "draft_vocab_size", what)
        if draft.draft_vocab_size >= target.vocab_size or draft.dflash2 is not None:
            raise DFlashTrtError(
                "checkpoint config.json: 'dflash_config.draft_vocab_size' must be below the target vocabulary, and "
                "DFlash2 drafts over the full vocabulary"
            )
    conv = draft.dflash2
    if conv is None:
        return
    for key in DFLASH2_KEYS:
        check_dimension(getattr(conv, key), key, what)
    if (
        draft.hidden_size % conv.conv_group_size
        or conv.conv_kernel_size > draft.block_size
        or conv.selector_top_k > target.vocab_size
    ):
        raise DFlashTrtError(
            "checkpoint config.json: 'dflash_config.dflash2' needs conv_group_size dividing hidden_size, "
            "conv_kernel_size <= block_size and selector_top_k <= vocab_size"
        )
