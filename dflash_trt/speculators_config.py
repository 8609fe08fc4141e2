"""A speculators-format DFlash / DFlash2 drafter config (vLLM's `speculators` library, 0.9.x) read as what it means.

`speculators` stores a drafter as `speculators_model_type` (`dflash`, `dflash2`) plus pydantic fields at the top
level, and the draft decoder's own fields in `transformer_layer_config` (a Qwen3 or Llama config dict). This module
turns that into the keys the z-lab drafter parser of `spec.py` reads, plus what only speculators drafters have, so
every decoder rule (defaults, layer kinds, RoPE, limits) is still decided in one place. The translation mirrors what
the speculators model classes do with the same config.json:

- taps: `aux_hidden_state_layer_ids` index HF `hidden_states` (0 = the embeddings), so tap = id - 1 in the z-lab
  numbering (output of decoder layer id - 1; -1 = the embeddings);
- attention: full-attention layers are non-causal in the block; sliding layers are causal unless
  `sliding_window_non_causal` (the DFlash2 default), and their window counts back from the block's anchor;
- DFlash2: `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k` with the pydantic defaults;
- nested per-layer-type `rope_parameters` use the `sliding_attention` entry (speculators' `flatten_rope_parameters`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_trt.errors import DFlashTrtError

SPECULATORS_FORMAT = "speculators"
MODEL_TYPE_KEY = "speculators_model_type"
# speculators_model_type -> the drafter architecture it implements.
DRAFT_MODEL_TYPES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
# Model types speculators 0.9 also stores that are not DFlash drafters, named in the refusal.
OTHER_MODEL_TYPES = ("dspark", "eagle3", "mtp", "peagle", "xpress")
# transformer_layer_config model types whose config classes we mirror (speculators' default is qwen3).
LAYER_CONFIG_TYPES = ("qwen3", "llama")
# Pydantic defaults of DFlashSpeculatorConfig / DFlash2SpeculatorConfig when a key is absent.
BLOCK_SIZE_DEFAULT = 8
DRAFT_VOCAB_SIZE_DEFAULT = 32000
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
# transformer_layer_config keys that describe the verifier or the trainer, not the draft decoder, and z-lab drafter
# keys the speculators model classes never read there.
_NOT_DECODER_KEYS = (
    "architectures",
    "auto_map",
    "dflash_config",
    "is_causal",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "num_target_layers",
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
    *DFLASH2_DEFAULTS,
)


@dataclass(frozen=True)
class SpeculatorsFields:
    """What a speculators drafter adds to the decoder fields: read here, checked against the target in `spec.py`."""

    draft_vocab_size: int
    sample_from_anchor: bool
    target_hidden_size: int | None


def is_speculators_config(cfg: dict[str, Any]) -> bool:
    return MODEL_TYPE_KEY in cfg


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _flag(cfg: dict[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise DFlashTrtError(f"speculators drafter config: '{key}' must be true or false, got {_brief(value)}")
    return value


def _integer(cfg: dict[str, Any], key: str, default: int | None) -> Any:
    """Integers are range-checked by `spec.py`; here only a wrong JSON type is refused, before it is passed on."""
    value = cfg.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise DFlashTrtError(f"speculators drafter config: '{key}' must be an integer, got {_brief(value)}")
    return value


def _model_type(cfg: dict[str, Any]) -> str:
    kind = cfg[MODEL_TYPE_KEY]
    if not isinstance(kind, str):
        raise DFlashTrtError(f"speculators drafter config: 'speculators_model_type' must be a name, got {_brief(kind)}")
    if kind in DRAFT_MODEL_TYPES:
        return kind
    if kind in OTHER_MODEL_TYPES:
        raise DFlashTrtError(
            f"speculators drafter model type {kind!r} is not a DFlash drafter "
            f"(supported: {', '.join(DRAFT_MODEL_TYPES)})"
        )
    raise DFlashTrtError(
        f"speculators drafter config: unknown speculators_model_type {_brief(kind)} "
        f"(supported: {', '.join(DRAFT_MODEL_TYPES)})"
    )


def _layer_config(cfg: dict[str, Any]) -> dict[str, Any]:
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DFlashTrtError("speculators drafter config: 'transformer_layer_config' must be an object")
    layer_type = layer.get("model_type", "qwen3")
    if layer_type not in LAYER_CONFIG_TYPES:
        raise DFlashTrtError(
            f"speculators drafter config: transformer_layer_config model_type {_brief(layer_type)} is not supported "
            f"(supported: {', '.join(LAYER_CONFIG_TYPES)})"
        )
    decoder = {key: value for key, value in layer.items() if key not in _NOT_DECODER_KEYS}
    rope = decoder.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("sliding_attention"), dict):
        decoder["rope_parameters"] = rope["sliding_attention"]
    if layer_type == "llama":
        # LlamaConfig has no sliding-window gate and no derived layer kinds (the values are taken as they are), and
        # its head_dim defaults to hidden_size // num_attention_heads.
        # Without layer_types every layer is full attention, whatever sliding_window says.
        decoder["use_sliding_window"] = "layer_types" in decoder and decoder.get("sliding_window") is not None
        hidden, heads = _integer(decoder, "hidden_size", None), _integer(decoder, "num_attention_heads", None)
        if "head_dim" not in decoder and hidden and heads and heads > 0:
            decoder["head_dim"] = hidden // heads
    return decoder


def _taps(cfg: dict[str, Any]) -> list[int]:
    ids = cfg.get("aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DFlashTrtError(
            "speculators drafter config: 'aux_hidden_state_layer_ids' must be a non-empty list of integers, "
            f"got {_brief(ids)}"
        )
    if any(i < 0 for i in ids):
        raise DFlashTrtError(
            f"speculators drafter config: aux_hidden_state_layer_ids index hidden_states (0 = the embeddings) and "
            f"cannot be negative, got {_brief(ids)}"
        )
    return [i - 1 for i in ids]


def translate(cfg: dict[str, Any]) -> tuple[dict[str, Any], SpeculatorsFields]:
    """The z-lab-style drafter config (decoder fields at the top level, DFlash keys in `dflash_config`) a
    speculators config stands for, and the fields only speculators drafters have."""
    kind = _model_type(cfg)
    decoder = _layer_config(cfg)
    mask = cfg.get("mask_token_id")
    if mask is None:
        raise DFlashTrtError("speculators drafter config: 'mask_token_id' is not set (it is required to draft)")
    non_causal = _flag(cfg, "sliding_window_non_causal", kind == "dflash2")
    dflash_config: dict[str, Any] = {
        "mask_token_id": mask,
        "target_layer_ids": _taps(cfg),
        "block_size": _integer(cfg, "block_size", BLOCK_SIZE_DEFAULT),
    }
    if kind == "dflash2":
        dflash_config.update({key: _integer(cfg, key, default) for key, default in DFLASH2_DEFAULTS.items()})
    translated = {
        **decoder,
        "architectures": [DRAFT_MODEL_TYPES[kind]],
        # Full-attention layers are always non-causal; sliding ones are causal unless the flag says otherwise.
        "is_causal": False if non_causal else None,
        "dflash_config": dflash_config,
    }
    dtype = cfg.get("dtype", cfg.get("torch_dtype"))
    if dtype is not None:
        translated["dtype"] = dtype
    fields = SpeculatorsFields(
        draft_vocab_size=_integer(cfg, "draft_vocab_size", DRAFT_VOCAB_SIZE_DEFAULT),
        sample_from_anchor=_flag(cfg, "sample_from_anchor", False),
        target_hidden_size=_integer(cfg, "target_hidden_size", None),
    )
    return translated, fields
