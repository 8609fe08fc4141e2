"""The converted checkpoint's `config.json` (DESIGN §4.2): built from specs, and read back into specs.

TensorRT-LLM 1.2.x loads it as a `PretrainedConfig` (unknown keys ride along as attributes), our engine class reads
`dflash_config`, and the golden model rebuilds the exact specs from it, so the key spelling lives only here.
"""

from __future__ import annotations

from typing import Any

from dflash_trt.errors import DFlashTrtError
from dflash_trt.quant.formats import NONE, quantization_config
from dflash_trt.reference.rope import RopeConfig
from dflash_trt.spec import DraftSpec, MoeSpec, TargetSpec, check_dimension

ARCHITECTURE = "DFlashForCausalLM"
# TensorRT-LLM's MoeConfig.ExpertScaleNormalizationMode: NONE = softmax over all experts, then top-k (weights as
# they are); RENORMALIZE = top-k of the router logits, softmax over them (= Qwen3-MoE's norm_topk_prob).
MOE_NORMALIZATION_NONE = 0
MOE_NORMALIZATION_RENORMALIZE = 1
DTYPES = ("float32", "float16", "bfloat16")
FORMAT_VERSION = 1


def rotary_scaling(rope: RopeConfig) -> dict[str, Any] | None:
    """TensorRT-LLM's `rotary_scaling` dict (`type` + parameters), None for plain RoPE."""
    if rope.rope_type == "default":
        return None
    fields = rope.to_dict()
    for key in ("head_dim", "theta", "rope_type"):
        fields.pop(key)
    return {"type": rope.rope_type, **fields}


def rope_from_config(head_dim: int, base: float, scaling: dict[str, Any] | None) -> RopeConfig:
    fields = dict(scaling or {})
    rope_type = fields.pop("type", "default")
    return RopeConfig(head_dim=head_dim, theta=float(base), rope_type=rope_type, **fields)


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
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": target.num_hidden_layers,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_size": target.head_dim,
        "hidden_act": target.hidden_act,
        "norm_epsilon": target.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": target.rope.theta,
        "rotary_scaling": rotary_scaling(target.rope),
        "max_position_embeddings": target.max_position_embeddings,
        "qk_layernorm": target.qk_norm,
        "attn_bias": target.attention_bias,
        "mlp_bias": target.mlp_bias,
        "tie_word_embeddings": target.tie_word_embeddings,
        "eos_token_ids": list(target.eos_token_ids),
        "mapping": {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1},
        "quantization": quantization or quantization_config(NONE),
        "max_draft_len": draft.block_size - 1,
        "dflash_format_version": FORMAT_VERSION,
        "dflash_config": {
            "architecture": draft.architecture,
            "num_hidden_layers": draft.num_hidden_layers,
            "hidden_size": draft.hidden_size,
            "intermediate_size": draft.intermediate_size,
            "num_attention_heads": draft.num_attention_heads,
            "num_key_value_heads": draft.num_key_value_heads,
            "head_size": draft.head_dim,
            "norm_epsilon": draft.rms_norm_eps,
            "hidden_act": draft.hidden_act,
            "attn_bias": draft.attention_bias,
            "rotary_base": draft.rope.theta,
            "rotary_scaling": rotary_scaling(draft.rope),
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
    if target.moe is not None:
        config.update(moe_config(target.moe))
        config["mapping"].update(moe_tp_size=tp_size // moe_ep_size, moe_ep_size=moe_ep_size)
    return config


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
        raise DFlashTrtError(f"checkpoint config.json: unsupported moe normalization_mode "
                             f"{moe['normalization_mode']!r}")
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


def specs_from_config(config: dict[str, Any]) -> tuple[TargetSpec, DraftSpec]:
    """Rebuild the exact specs the checkpoint was converted from."""
    if config.get("architecture") != ARCHITECTURE or "dflash_config" not in config:
        raise DFlashTrtError(f"not a dflash-trt checkpoint: config.json architecture is {config.get('architecture')!r}")
    try:
        d = config["dflash_config"]
        target = TargetSpec(
            architecture=config["base_architecture"],
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config["head_size"],
            rms_norm_eps=config["norm_epsilon"],
            hidden_act=config["hidden_act"],
            attention_bias=config["attn_bias"],
            mlp_bias=config["mlp_bias"],
            qk_norm=config["qk_layernorm"],
            tie_word_embeddings=config["tie_word_embeddings"],
            max_position_embeddings=config["max_position_embeddings"],
            rope=rope_from_config(config["head_size"], config["rotary_base"], config["rotary_scaling"]),
            eos_token_ids=tuple(config.get("eos_token_ids", [])),
            moe=moe_from_config(config),
        )
        draft = DraftSpec(
            architecture=d["architecture"],
            vocab_size=config["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d["num_key_value_heads"],
            head_dim=d["head_size"],
            rms_norm_eps=d["norm_epsilon"],
            hidden_act=d["hidden_act"],
            attention_bias=d["attn_bias"],
            rope=rope_from_config(d["head_size"], d["rotary_base"], d["rotary_scaling"]),
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
        raise DFlashTrtError(f"checkpoint config.json is missing or has a malformed key: {exc}") from None
    for what, spec in (("checkpoint", target), ("checkpoint dflash_config", draft)):
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim"):
            check_dimension(getattr(spec, key), key, what)
    check_dimension(draft.block_size, "block_size", "checkpoint dflash_config", minimum=2)
    return target, draft
