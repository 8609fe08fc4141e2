"""Parse and validate HF target configs and z-lab DFlash drafter configs (docs/conversion.md).

Every other module works from these specs, never from raw config dicts, so each config rule (where a key may sit,
its default, how per-layer attention kinds are derived) is decided here once. Defaults mirror what `transformers`
and the `dflash` reference do with the same config.json, because parity with them is the contract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashTrtError
from dflash_trt.jsonfile import read_json_object
from dflash_trt.rope import SUPPORTED_ROPE_TYPES, RopeConfig
from dflash_trt.speculators_config import SPECULATORS_FORMAT, is_speculators_config, translate

QWEN3 = "Qwen3ForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
TARGET_ARCHITECTURES = (QWEN3, QWEN3_MOE, "LlamaForCausalLM")
DRAFT_ARCHITECTURE = "DFlashDraftModel"
DRAFT2_ARCHITECTURE = "DFlash2DraftModel"
DRAFT_ARCHITECTURES = (DRAFT_ARCHITECTURE, DRAFT2_ARCHITECTURE)
ZLAB_FORMAT = "z-lab"
DRAFT_FORMATS = (ZLAB_FORMAT, SPECULATORS_FORMAT)
EMBEDDING_TAP = -1  # target_layer_ids entry for the embedding output (HF hidden_states[0])
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
SUPPORTED_ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class MoeSpec:
    """The sparse MLPs of a Qwen3-MoE target: which layers route, over how many experts, and how.

    A sparse layer's MLP is `num_experts` SwiGLU experts of `intermediate_size`; a float32 router picks `top_k` of
    them per token by softmax probability, renormalized over the chosen ones when `norm_topk_prob`. The other
    layers (`mlp_only_layers`, `decoder_sparse_step`) keep a dense MLP of the target's `intermediate_size`.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


@dataclass(frozen=True)
class DecoderSpec:
    """What a target and its drafter both are: a stack of pre-norm decoder layers with RoPE attention."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool
    rope: RopeConfig


@dataclass(frozen=True)
class TargetSpec(DecoderSpec):
    """A Qwen3 / Llama 3.x causal LM, as much of it as conversion and decoding need."""

    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    moe: MoeSpec | None = None

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a mixture-of-experts MLP."""
        return self.moe is not None and self.moe.is_sparse(layer)


@dataclass(frozen=True)
class ConvSelectorSpec:
    """What DFlash2 adds to every drafter: a grouped dynamic causal convolution of `conv_kernel_size` taps around
    each sublayer (one dynamic kernel per `conv_group_size` hidden channels), and a candidate selector that
    re-ranks the `selector_top_k` best drafter logits per block position with a rank-`selector_rank` bilinear
    predecessor / hidden / successor score, walked left to right into one chain."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int

    def conv_groups(self, hidden_size: int) -> int:
        return hidden_size // self.conv_group_size


@dataclass(frozen=True)
class DraftSpec(DecoderSpec):
    """A DFlash drafter (v1, or DFlash2 with `dflash2` set): a Qwen3-style stack fed by fused target taps (KV
    injection). `target_layer_ids` are z-lab tap numbers: tap t is the output of target layer t (HF
    `hidden_states[t + 1]`), -1 the embeddings."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]
    sliding_window: int | None
    causal: tuple[bool, ...]
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    torch_dtype: str | None = None
    checkpoint_format: str = ZLAB_FORMAT
    dflash2: ConvSelectorSpec | None = None
    draft_vocab_size: int | None = None  # a reduced draft vocabulary (own lm_head + d2t map); None = the target's
    sample_from_anchor: bool = False  # the anchor's slot drafts too: block_size drafts instead of block_size - 1
    window_from_anchor: bool = False  # a sliding layer sees the `sliding_window` context positions before the anchor

    def layer_window(self, layer: int) -> int | None:
        """Attention window of one draft layer (None = unbounded), as the reference applies it."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    @property
    def num_drafts(self) -> int:
        """Draft tokens per block (the engine's max_draft_len)."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def verify_width(self) -> int:
        """Tokens verified per step: the anchor and the drafts."""
        return self.num_drafts + 1

    @property
    def first_draft_slot(self) -> int:
        """Block slot whose hidden state drafts the first token: the anchor's own with `sample_from_anchor`."""
        return 0 if self.sample_from_anchor else 1


def read_config_json(model_dir: str | Path, what: str) -> dict[str, Any]:
    return read_json_object(Path(model_dir) / "config.json", f"{what} directory {model_dir} has no config.json")


# Far above any real model; a config beyond them is corrupt or hostile, and would make us allocate or loop forever.
DIMENSION_LIMITS = {
    "vocab_size": 1 << 24,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 1 << 10,
    "num_attention_heads": 1 << 10,
    "num_key_value_heads": 1 << 10,
    "head_dim": 1 << 12,
    "block_size": 1 << 10,
    "num_experts": 1 << 12,
    "num_experts_per_tok": 1 << 10,
    "moe_intermediate_size": 1 << 20,
    "decoder_sparse_step": 1 << 10,
    "conv_kernel_size": 1 << 10,
    "conv_group_size": 1 << 17,
    "selector_rank": 1 << 16,
    "selector_top_k": 1 << 16,
    "draft_vocab_size": 1 << 24,
}


def check_dimension(value: Any, key: str, what: str, minimum: int = 1) -> int:
    limit = DIMENSION_LIMITS.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (limit and value > limit):
        bound = f" and <= {limit}" if limit else ""
        raise DFlashTrtError(f"{what} config: '{key}' must be an integer >= {minimum}{bound}, got {_brief(value)}")
    return value


def _require_int(cfg: dict, key: str, what: str, minimum: int = 1) -> int:
    return check_dimension(cfg.get(key), key, what, minimum)


def _optional_number(value: Any, key: str, what: str, default: float, positive: bool = False) -> float:
    """A finite number (> 0 with `positive`); JSON's NaN / Infinity and numbers written as strings are refused."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DFlashTrtError(f"{what} config: '{key}' must be a number, got {_brief(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or (positive and number <= 0):
        kind = "a finite number > 0" if positive else "a finite number"
        raise DFlashTrtError(f"{what} config: '{key}' must be {kind}, got {_brief(value)}")
    return number


def _maybe_number(value: Any, key: str, what: str, positive: bool = False) -> float | None:
    return None if value is None else _optional_number(value, key, what, 0.0, positive)


def _optional_bool(cfg: dict, key: str, what: str, default: bool) -> bool:
    """JSON true / false only: the string "false" is truthy in Python and would silently flip the model."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise DFlashTrtError(f"{what} config: '{key}' must be true or false, got {_brief(value)}")
    return value


def _optional_str(cfg: dict, key: str, what: str) -> str | None:
    value = cfg.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise DFlashTrtError(f"{what} config: '{key}' must be a non-empty string, got {_brief(value)}")
    return value


def _brief(value: Any) -> str:
    """A config value quoted for an error message, cut short (hostile configs hold huge values)."""
    try:
        text = repr(value)
    except ValueError:  # an integer with more digits than Python converts to text
        return "a huge integer"
    return text if len(text) <= 80 else text[:77] + "..."


def _architecture(cfg: dict, what: str) -> str | None:
    architectures = cfg.get("architectures")
    if architectures is None:
        return None
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise DFlashTrtError(f"{what} config: 'architectures' must be a list of names, got {_brief(architectures)}")
    return architectures[0] if architectures else None


def parse_rope(cfg: dict, head_dim: int, what: str) -> RopeConfig:
    """Read rope fields from either `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise DFlashTrtError(f"{what} config: rope_parameters / rope_scaling must be objects")
    merged = {**scaling, **params}
    _maybe_number(cfg.get("rope_theta"), "rope_theta", what, positive=True)  # checked even where rope_parameters wins
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
        raise DFlashTrtError(
            f"{what} config: rope type {_brief(rope_type)} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = merged.get("partial_rotary_factor", 1.0)
    if isinstance(partial, bool) or partial != 1.0:
        raise DFlashTrtError(f"{what} config: partial_rotary_factor != 1 is not supported, got {_brief(partial)}")
    original = merged.get("original_max_position_embeddings")
    if original is not None:
        original = check_dimension(original, "original_max_position_embeddings", what)
    factor = _maybe_number(merged.get("factor"), "factor", what, positive=True)
    if rope_type == "yarn" and factor is None and original:
        factor = max_position_embeddings(cfg, what) / original
    if rope_type in ("llama3", "yarn") and not original:
        if rope_type == "llama3" or factor is None:
            raise DFlashTrtError(f"{what} config: {rope_type} rope scaling needs original_max_position_embeddings")
    if rope_type != "default" and factor is None:
        raise DFlashTrtError(f"{what} config: {rope_type} rope scaling needs a 'factor'")
    low = _optional_number(merged.get("low_freq_factor"), "low_freq_factor", what, 1.0, positive=True)
    high = _optional_number(merged.get("high_freq_factor"), "high_freq_factor", what, 4.0, positive=True)
    if rope_type == "llama3" and high <= low:
        raise DFlashTrtError(f"{what} config: llama3 rope needs high_freq_factor ({high}) > low_freq_factor ({low})")
    truncate = merged.get("truncate", True)
    if not isinstance(truncate, bool):
        raise DFlashTrtError(f"{what} config: 'truncate' must be true or false, got {_brief(truncate)}")
    return RopeConfig(
        head_dim=head_dim,
        theta=_optional_number(theta, "rope_theta", what, 10000.0, positive=True),
        rope_type=rope_type,
        factor=1.0 if factor is None else factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
        beta_fast=_optional_number(merged.get("beta_fast") or None, "beta_fast", what, 32.0),
        beta_slow=_optional_number(merged.get("beta_slow") or None, "beta_slow", what, 1.0),
        attention_factor=_maybe_number(merged.get("attention_factor"), "attention_factor", what, positive=True),
        mscale=_maybe_number(merged.get("mscale"), "mscale", what),
        mscale_all_dim=_maybe_number(merged.get("mscale_all_dim"), "mscale_all_dim", what),
        truncate=truncate,
    )


def max_position_embeddings(cfg: dict, what: str) -> int:
    value = cfg.get("max_position_embeddings")
    return 32768 if value is None else check_dimension(value, "max_position_embeddings", what)


def _eos_ids(cfg: dict, model_dir: Path | None) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [cfg]
    generation_config = None if model_dir is None else model_dir / "generation_config.json"
    if generation_config is not None and generation_config.is_file():
        sources.append(read_json_object(generation_config, f"{generation_config} cannot be read"))
    for source in sources:
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [] if value is None else [value]:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise DFlashTrtError(
                    f"eos_token_id must be a token id or a list of them, got {_brief(value)} in {model_dir}"
                )
            if token not in ids:
                ids.append(token)
    return tuple(ids)


def _attention_dims(cfg: dict, what: str, default_head_dim: int | None) -> tuple[int, int, int, int]:
    hidden = _require_int(cfg, "hidden_size", what)
    heads = _require_int(cfg, "num_attention_heads", what)
    kv_heads = cfg.get("num_key_value_heads")
    kv_heads = check_dimension(heads if kv_heads is None else kv_heads, "num_key_value_heads", what)
    if heads % kv_heads:
        raise DFlashTrtError(
            f"{what} config: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    head_dim = cfg.get("head_dim")
    head_dim = check_dimension(
        default_head_dim or hidden // heads if head_dim is None else head_dim, "head_dim", what, minimum=2
    )
    if head_dim % 2:
        raise DFlashTrtError(f"{what} config: 'head_dim' must be even for rotary embeddings, got {head_dim}")
    return hidden, heads, kv_heads, head_dim


def _activation(cfg: dict, what: str) -> str:
    act = cfg.get("hidden_act", "silu")
    if not isinstance(act, str) or act not in SUPPORTED_ACTIVATIONS:
        raise DFlashTrtError(f"{what} config: hidden_act {_brief(act)} is not supported (supported: silu)")
    return act


def _parse_moe(cfg: dict, num_layers: int) -> MoeSpec:
    """Qwen3-MoE keys with transformers' defaults and its rule for which layers are sparse."""
    what = "target"
    count = cfg.get("num_experts", cfg.get("num_local_experts", 128))
    if "num_local_experts" in cfg and cfg["num_local_experts"] != count:
        raise DFlashTrtError(
            f"{what} config: num_experts ({count}) and num_local_experts ({cfg['num_local_experts']}) disagree"
        )
    num_experts = check_dimension(count, "num_experts", what, minimum=2)
    top_k = check_dimension(cfg.get("num_experts_per_tok", 8), "num_experts_per_tok", what)
    if top_k > num_experts:
        raise DFlashTrtError(f"{what} config: num_experts_per_tok ({top_k}) exceeds num_experts ({num_experts})")
    inter = check_dimension(cfg.get("moe_intermediate_size", 768), "moe_intermediate_size", what)
    step = check_dimension(cfg.get("decoder_sparse_step", 1), "decoder_sparse_step", what)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense
    ):
        raise DFlashTrtError(
            f"{what} config: 'mlp_only_layers' must list layer indices below {num_layers}, got {dense!r}"
        )
    norm = cfg.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise DFlashTrtError(f"{what} config: 'norm_topk_prob' must be true or false, got {norm!r}")
    if cfg.get("shared_expert_intermediate_size"):
        raise DFlashTrtError(f"{what} config: shared experts are not supported (Qwen3-MoE has none)")
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    if not sparse:
        raise DFlashTrtError(
            f"{what} config: no layer is sparse (decoder_sparse_step / mlp_only_layers); "
            "convert it as a dense Qwen3ForCausalLM"
        )
    return MoeSpec(num_experts, top_k, inter, norm, sparse)


def parse_target_config(cfg: dict, model_dir: str | Path | None = None) -> TargetSpec:
    """`model_dir` (where generation_config.json may add end-of-sequence ids) is None for a config alone."""
    what = "target"
    architecture = _architecture(cfg, what)
    if architecture not in TARGET_ARCHITECTURES:
        raise DFlashTrtError(
            f"target architecture {architecture!r} is not supported (supported: {', '.join(TARGET_ARCHITECTURES)})"
        )
    is_qwen3 = architecture in (QWEN3, QWEN3_MOE)
    hidden, heads, kv_heads, head_dim = _attention_dims(cfg, what, 128 if is_qwen3 else None)
    num_layers = _require_int(cfg, "num_hidden_layers", what)
    if is_qwen3 and _optional_bool(cfg, "use_sliding_window", what, False):
        raise DFlashTrtError("target config: sliding-window attention in the target is not supported yet")
    return TargetSpec(
        architecture=architecture,
        vocab_size=_require_int(cfg, "vocab_size", what),
        hidden_size=hidden,
        intermediate_size=_require_int(cfg, "intermediate_size", what),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_optional_number(cfg.get("rms_norm_eps"), "rms_norm_eps", what, 1e-6, positive=True),
        hidden_act=_activation(cfg, what),
        attention_bias=_optional_bool(cfg, "attention_bias", what, False),
        mlp_bias=_optional_bool(cfg, "mlp_bias", what, False) and not is_qwen3,
        qk_norm=is_qwen3,
        tie_word_embeddings=_optional_bool(cfg, "tie_word_embeddings", what, False),
        max_position_embeddings=max_position_embeddings(cfg, what),
        rope=parse_rope(cfg, head_dim, what),
        eos_token_ids=_eos_ids(cfg, None if model_dir is None else Path(model_dir)),
        torch_dtype=_optional_str(cfg, "dtype", what) or _optional_str(cfg, "torch_dtype", what),
        moe=_parse_moe(cfg, num_layers) if architecture == QWEN3_MOE else None,
    )


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default taps when a checkpoint names none: spread over the target, as the reference chooses them."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _draft_value(cfg: dict, key: str, default: Any = None) -> Any:
    """A drafter key may sit in `dflash_config` or at the top level; `dflash_config` wins (as in the reference)."""
    nested = cfg.get("dflash_config") or {}
    if not isinstance(nested, dict):
        raise DFlashTrtError("drafter config: 'dflash_config' must be an object")
    return nested[key] if key in nested else cfg.get(key, default)


def _draft_layer_kinds(cfg: dict, num_layers: int) -> tuple[tuple[str, ...], int | None, tuple[bool, ...]]:
    what = "drafter"
    # transformers' Qwen3Config keeps sliding_window only when use_sliding_window is set; the reference inherits that.
    # Keys that only matter in some combinations are still type-checked: a wrong type is a damaged config.
    window = cfg.get("sliding_window")
    if window is not None:
        window = check_dimension(window, "sliding_window", what)
    window = window if _optional_bool(cfg, "use_sliding_window", what, False) else None
    first_window_layer = cfg.get("max_window_layers")
    if first_window_layer is not None:
        first_window_layer = check_dimension(first_window_layer, "max_window_layers", what, minimum=0)
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first_window_layer = 28 if first_window_layer is None else first_window_layer
        layer_types = [
            SLIDING_ATTENTION if window is not None and i >= first_window_layer else FULL_ATTENTION
            for i in range(num_layers)
        ]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise DFlashTrtError(
            f"{what} config: 'layer_types' must list one kind per draft layer ({num_layers}), got {_brief(layer_types)}"
        )
    for kind in layer_types:
        if not isinstance(kind, str) or kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
            raise DFlashTrtError(f"{what} config: unknown layer type {_brief(kind)} in 'layer_types'")
    is_causal = cfg.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise DFlashTrtError(f"{what} config: 'is_causal' must be true or false, got {_brief(is_causal)}")
    causal = tuple(kind == SLIDING_ATTENTION if is_causal is None else is_causal for kind in layer_types)
    return tuple(layer_types), window, causal


def _draft_taps(cfg: dict, target: TargetSpec, num_layers: int) -> tuple[int, ...]:
    what = "drafter"
    num_target_layers = cfg.get("num_target_layers")
    num_target_layers = (
        target.num_hidden_layers
        if num_target_layers is None
        else check_dimension(num_target_layers, "num_target_layers", what)
    )
    taps = _draft_value(cfg, "target_layer_ids")
    if taps is None:
        taps = build_target_layer_ids(num_target_layers, num_layers)
    if not isinstance(taps, list) or not taps or not all(isinstance(t, int) and not isinstance(t, bool) for t in taps):
        raise DFlashTrtError(
            f"{what} config: 'target_layer_ids' must be a non-empty list of integers, got {_brief(taps)}"
        )
    for tap in taps:
        if not EMBEDDING_TAP <= tap < target.num_hidden_layers:
            raise DFlashTrtError(
                f"{what} config: target layer id {tap} is outside the target's {target.num_hidden_layers} layers "
                "(-1 = the embeddings)"
            )
    return tuple(taps)


def _mask_token_id(cfg: dict, target: TargetSpec) -> int:
    mask = _draft_value(cfg, "mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int) or mask < 0:
        raise DFlashTrtError(f"drafter config: 'mask_token_id' must be a non-negative integer, got {_brief(mask)}")
    if mask >= target.vocab_size:
        raise DFlashTrtError(
            f"mask_token_id {_brief(mask)} is outside the target vocabulary ({target.vocab_size} tokens)"
        )
    return mask


def _conv_selector(cfg: dict, hidden: int, block: int, vocab: int) -> ConvSelectorSpec:
    """DFlash2's convolution and selector sizes, with the rules both reference implementations enforce."""
    what = "DFlash2 drafter"
    fields = {
        key: check_dimension(_draft_value(cfg, key), key, what)
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    }
    spec = ConvSelectorSpec(**fields)
    if hidden % spec.conv_group_size:
        raise DFlashTrtError(
            f"{what} config: hidden_size ({hidden}) must be a multiple of conv_group_size ({spec.conv_group_size})"
        )
    if spec.conv_kernel_size > block:
        raise DFlashTrtError(
            f"{what} config: conv_kernel_size ({spec.conv_kernel_size}) cannot exceed block_size ({block})"
        )
    if spec.selector_top_k > vocab:
        raise DFlashTrtError(
            f"{what} config: selector_top_k ({spec.selector_top_k}) cannot exceed the vocabulary ({vocab} tokens)"
        )
    return spec


def _final_softcap(cfg: dict) -> float | None:
    softcap = _draft_value(cfg, "final_logit_softcapping")
    softcap = _optional_number(softcap, "final_logit_softcapping", "drafter", 0.0) or None
    if softcap is not None and softcap < 0:
        raise DFlashTrtError(f"drafter config: 'final_logit_softcapping' must be >= 0, got {softcap}")
    return softcap


def _zlab_draft_spec(cfg: dict, target: TargetSpec) -> DraftSpec:
    """A drafter in the z-lab format (`DFlashDraftModel` / `DFlash2DraftModel`); also what a speculators config
    is translated into."""
    what = "drafter"
    architecture = _architecture(cfg, what)
    if architecture not in DRAFT_ARCHITECTURES:
        raise DFlashTrtError(
            f"drafter architecture {architecture!r} is not a DFlash drafter ({', '.join(DRAFT_ARCHITECTURES)})"
        )
    hidden, heads, kv_heads, head_dim = _attention_dims(cfg, what, 128)
    if hidden != target.hidden_size:
        raise DFlashTrtError(
            f"hidden sizes differ: drafter hidden_size {hidden} != target hidden_size {target.hidden_size}"
        )
    vocab = cfg.get("vocab_size")
    vocab = target.vocab_size if vocab is None else check_dimension(vocab, "vocab_size", what)
    if vocab != target.vocab_size:
        raise DFlashTrtError(f"vocab mismatch: drafter vocab_size {vocab} != target vocab_size {target.vocab_size}")
    num_layers = _require_int(cfg, "num_hidden_layers", what)
    block = check_dimension(_draft_value(cfg, "block_size", 16), "block_size", what, minimum=2)
    layer_types, window, causal = _draft_layer_kinds(cfg, num_layers)
    return DraftSpec(
        architecture=architecture,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_require_int(cfg, "intermediate_size", what),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_optional_number(cfg.get("rms_norm_eps"), "rms_norm_eps", what, 1e-6, positive=True),
        hidden_act=_activation(cfg, what),
        attention_bias=_optional_bool(cfg, "attention_bias", what, False),
        rope=parse_rope(cfg, head_dim, what),
        block_size=block,
        mask_token_id=_mask_token_id(cfg, target),
        target_layer_ids=_draft_taps(cfg, target, num_layers),
        layer_types=layer_types,
        sliding_window=window,
        causal=causal,
        input_embedding_scale=_optional_number(
            _draft_value(cfg, "input_embedding_scale"), "input_embedding_scale", what, 1.0, positive=True
        ),
        output_multiplier=_optional_number(
            _draft_value(cfg, "output_multiplier"), "output_multiplier", what, 1.0, positive=True
        ),
        final_logit_softcapping=_final_softcap(cfg),
        torch_dtype=_optional_str(cfg, "dtype", what) or _optional_str(cfg, "torch_dtype", what),
        dflash2=_conv_selector(cfg, hidden, block, vocab) if architecture == DRAFT2_ARCHITECTURE else None,
    )


def _speculators_draft_spec(cfg: dict, target: TargetSpec) -> DraftSpec:
    """A speculators-format drafter: its translation parsed as a z-lab config, plus its own fields."""
    translated, fields = translate(cfg)
    spec = _zlab_draft_spec(translated, target)
    what = "speculators drafter"
    if fields.target_hidden_size is not None and fields.target_hidden_size != target.hidden_size:
        raise DFlashTrtError(
            f"{what} config: target_hidden_size {fields.target_hidden_size} != the target's hidden_size "
            f"{target.hidden_size}"
        )
    draft_vocab = check_dimension(fields.draft_vocab_size, "draft_vocab_size", what)
    if draft_vocab > target.vocab_size:
        raise DFlashTrtError(
            f"{what} config: draft_vocab_size {draft_vocab} exceeds the target vocabulary ({target.vocab_size})"
        )
    if SLIDING_ATTENTION in spec.layer_types and spec.sliding_window is None:
        raise DFlashTrtError(
            f"{what} config: sliding_attention layers need a sliding_window (and, for a Qwen3 layer config, "
            "use_sliding_window); the speculators model cannot run them without one"
        )
    reduced = draft_vocab < target.vocab_size
    if reduced and spec.dflash2 is not None:
        raise DFlashTrtError(
            f"{what} config: DFlash2 drafts over the full target vocabulary, got draft_vocab_size {draft_vocab}"
        )
    return replace(
        spec,
        checkpoint_format=SPECULATORS_FORMAT,
        draft_vocab_size=draft_vocab if reduced else None,
        sample_from_anchor=fields.sample_from_anchor,
        window_from_anchor=True,
    )


def parse_draft_config(cfg: dict, target: TargetSpec) -> DraftSpec:
    """A z-lab or speculators-format drafter config, told apart by `speculators_model_type`."""
    if is_speculators_config(cfg):
        return _speculators_draft_spec(cfg, target)
    return _zlab_draft_spec(cfg, target)


def load_target_spec(model_dir: str | Path) -> TargetSpec:
    return parse_target_config(read_config_json(model_dir, "target model"), model_dir)


def load_draft_spec(dflash_model_dir: str | Path, target: TargetSpec) -> DraftSpec:
    return parse_draft_config(read_config_json(dflash_model_dir, "DFlash drafter"), target)


def target_tensor_shapes(spec: TargetSpec) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes a target checkpoint must hold (lm_head only when untied)."""
    h, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(_decoder_layer_shapes(p, h, q, kv, spec.intermediate_size, spec.attention_bias))
        if spec.moe is not None and spec.moe.is_sparse(i):
            for leaf in ("gate_proj", "up_proj", "down_proj"):
                del shapes[f"{p}mlp.{leaf}.weight"]
            shapes.update(expert_tensor_shapes(p, h, spec.moe))
        if spec.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if spec.mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (spec.intermediate_size,)
            shapes[p + "mlp.up_proj.bias"] = (spec.intermediate_size,)
            shapes[p + "mlp.down_proj.bias"] = (h,)
    return shapes


def hf_expert(layer_prefix: str, expert: int, leaf: str) -> str:
    """HF name of one expert's weight: `hf_expert("model.layers.3.", 7, "up_proj")`."""
    return f"{layer_prefix}mlp.experts.{expert}.{leaf}.weight"


def hf_router(layer_prefix: str) -> str:
    return f"{layer_prefix}mlp.gate.weight"


def expert_tensor_shapes(p: str, hidden: int, moe: MoeSpec) -> dict[str, tuple[int, ...]]:
    """A sparse layer's router and per-expert gate/up/down weights, as HF stores them."""
    shapes: dict[str, tuple[int, ...]] = {hf_router(p): (moe.num_experts, hidden)}
    for e in range(moe.num_experts):
        shapes[hf_expert(p, e, "gate_proj")] = (moe.intermediate_size, hidden)
        shapes[hf_expert(p, e, "up_proj")] = (moe.intermediate_size, hidden)
        shapes[hf_expert(p, e, "down_proj")] = (hidden, moe.intermediate_size)
    return shapes


# Drafter source tensors beyond the decoder stack (unprefixed, as both formats store them).
CONV_SUBLAYERS = ("attention_conv", "mlp_conv")  # DFlash2: around attention, around the MLP
CONV_BASE_KERNEL = "base_kernel"  # [2 (before | after the sublayer), kernel_size, hidden]
CONV_KERNEL_PROJECTION = "kernel_projection.weight"  # [2 * kernel_size * groups, hidden]
SELECTOR_PREDECESSOR = "candidate_selector.predecessor_codebook"  # [vocab, rank], stored without `.weight`
SELECTOR_SUCCESSOR = "candidate_selector.successor_codebook"  # [vocab, rank]
SELECTOR_HIDDEN_PROJECTION = "candidate_selector.hidden_projection.weight"  # [rank, hidden]
# The dflash package's own save_pretrained writes the codebooks as embeddings (`.weight`); published checkpoints
# do not. Both spellings are read, as that package's loader maps them.
DRAFT_SOURCE_ALIASES = {f"{name}.weight": name for name in (SELECTOR_PREDECESSOR, SELECTOR_SUCCESSOR)}
DRAFT_LM_HEAD = "lm_head.weight"  # a speculators drafter's own head over its reduced vocabulary
DRAFT_TO_TARGET = "d2t"  # int64 [draft vocab]: target id - draft id
TARGET_TO_DRAFT = "t2d"  # bool [target vocab]: which target ids the draft vocabulary holds


def conv_tensor(layer: int, sublayer: str, leaf: str) -> str:
    """`conv_tensor(0, "mlp_conv", CONV_BASE_KERNEL)` -> 'layers.0.mlp_conv.base_kernel'."""
    return f"layers.{layer}.{sublayer}.{leaf}"


def draft_tensor_shapes(spec: DraftSpec) -> dict[str, tuple[int, ...]]:
    """Drafter tensor names (unprefixed) and shapes: the decoder stack, DFlash2's convolutions and selector, and a
    speculators drafter's reduced-vocabulary head and map."""
    h, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(spec.target_layer_ids) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(spec.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update(_decoder_layer_shapes(p, h, q, kv, spec.intermediate_size, spec.attention_bias))
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        shapes[p + "self_attn.k_norm.weight"] = (hd,)
    if spec.dflash2 is not None:
        shapes.update(_dflash2_shapes(spec, spec.dflash2))
    if spec.draft_vocab_size is not None:
        shapes[DRAFT_LM_HEAD] = (spec.draft_vocab_size, h)
        shapes[DRAFT_TO_TARGET] = (spec.draft_vocab_size,)
    return shapes


def _dflash2_shapes(spec: DraftSpec, dflash2: ConvSelectorSpec) -> dict[str, tuple[int, ...]]:
    h, k = spec.hidden_size, dflash2.conv_kernel_size
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(spec.num_hidden_layers):
        for sublayer in CONV_SUBLAYERS:
            shapes[conv_tensor(i, sublayer, CONV_BASE_KERNEL)] = (2, k, h)
            shapes[conv_tensor(i, sublayer, CONV_KERNEL_PROJECTION)] = (2 * k * dflash2.conv_groups(h), h)
    shapes[SELECTOR_PREDECESSOR] = (spec.vocab_size, dflash2.selector_rank)
    shapes[SELECTOR_SUCCESSOR] = (spec.vocab_size, dflash2.selector_rank)
    shapes[SELECTOR_HIDDEN_PROJECTION] = (dflash2.selector_rank, h)
    return shapes


def draft_optional_tensors(spec: DraftSpec) -> dict[str, tuple[int, ...]]:
    """Tensors a drafter checkpoint may hold that are not converted (checked for shape, never read as weights): a
    speculators drafter may carry copies of the target's embeddings, final norm and head (its `lm_head` too, with
    the full vocabulary), which the drafter shares with the target, and the target-to-draft vocabulary mask."""
    if spec.checkpoint_format != SPECULATORS_FORMAT:
        return {}
    h, vocab = spec.hidden_size, spec.vocab_size
    optional = {"embed_tokens.weight": (vocab, h), "verifier_norm.weight": (h,)}
    optional["verifier_lm_head.weight"] = (spec.draft_vocab_size or vocab, h)
    if spec.draft_vocab_size is None:
        optional[DRAFT_LM_HEAD] = (vocab, h)
    else:
        optional[TARGET_TO_DRAFT] = (vocab,)
    return optional


def _decoder_layer_shapes(p: str, h: int, q: int, kv: int, inter: int, bias: bool) -> dict[str, tuple[int, ...]]:
    shapes = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
    }
    if bias:
        shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,)})
        shapes.update({p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)})
    return shapes


def check_tensor_shapes(
    expected: dict[str, tuple[int, ...]],
    actual: dict[str, tuple[int, ...]],
    what: str,
    allowed_extra: tuple[str, ...] = (),
) -> None:
    """One clear error naming the first missing, extra or mis-shaped tensor of a checkpoint."""
    missing = sorted(set(expected) - set(actual))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DFlashTrtError(f"{what} checkpoint is missing tensor '{missing[0]}'{more}")
    extra = sorted(set(actual) - set(expected) - set(allowed_extra))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise DFlashTrtError(f"{what} checkpoint has unexpected tensor {extra[0]!r}{more}")
    for name, shape in expected.items():
        if tuple(actual[name]) != tuple(shape):
            raise DFlashTrtError(
                f"{what} tensor '{name}' has shape {tuple(actual[name])}, expected {tuple(shape)} from config.json"
            )
