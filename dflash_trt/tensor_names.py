"""TensorRT-LLM checkpoint tensor names: the only module that spells them.

The converter writes these names, the golden model and `verify` read them, and the engine builder loads them into
TensorRT-LLM modules, so a name changes here or nowhere. Target tensors follow TensorRT-LLM's Llama/Qwen decoder
naming (`transformer.` prefix); the drafter lives under `dflash.` with the same per-layer names.
"""

from __future__ import annotations

TARGET_PREFIX = "transformer"
DRAFT_PREFIX = "dflash"

VOCAB_EMBEDDING = "transformer.vocab_embedding.weight"
TARGET_FINAL_NORM = "transformer.ln_f.weight"
LM_HEAD = "lm_head.weight"
DRAFT_FC = "dflash.fc.weight"
DRAFT_HIDDEN_NORM = "dflash.hidden_norm.weight"
DRAFT_FINAL_NORM = "dflash.ln_f.weight"
# A drafter with its own reduced vocabulary: its head, and each draft id's target id offset (target id = draft id +
# d2t[draft id], as speculators stores it; int32 here, which every target vocabulary fits, so the engine needs no
# int64 tensor).
DRAFT_LM_HEAD = "dflash.lm_head.weight"
DRAFT_TO_TARGET = "dflash.d2t"
# DFlash2's candidate selector: codebooks indexed by token id (gathered, not multiplied: stored without `.weight`,
# as the drafters store them) and the projection of the drafter's hidden state to the selector's rank.
SELECTOR_PREDECESSOR_CODEBOOK = "dflash.selector.predecessor_codebook"  # [vocab, rank]
SELECTOR_SUCCESSOR_CODEBOOK = "dflash.selector.successor_codebook"  # [vocab, rank]
SELECTOR_HIDDEN_PROJECTION = "dflash.selector.hidden_projection.weight"  # [rank, hidden]

# Per-layer module paths, relative to a layer prefix.
INPUT_LAYERNORM = "input_layernorm"
POST_LAYERNORM = "post_layernorm"
QKV = "attention.qkv"
DENSE = "attention.dense"
Q_LAYERNORM = "attention.q_layernorm"
K_LAYERNORM = "attention.k_layernorm"
MLP_FC = "mlp.fc"  # HF gate_proj: the activated branch
MLP_GATE = "mlp.gate"  # HF up_proj: the multiplied branch
MLP_PROJ = "mlp.proj"  # HF down_proj
ATTENTION = "attention"
# A sparse (mixture-of-experts) layer's MLP, as TensorRT-LLM's MixtureOfExperts names it.
MOE_ROUTER = "mlp.router"  # float32 [experts, hidden]; never quantized
MOE_FC = MLP_FC  # stacked [experts, 2 * inter, hidden]: up_proj rows first, then gate_proj (the activated half)
MOE_PROJ = MLP_PROJ  # stacked [experts, hidden, inter]: down_proj

LINEAR_MODULES = (QKV, DENSE, MLP_FC, MLP_GATE, MLP_PROJ)
# DFlash2: a grouped dynamic causal convolution before and after each draft sublayer (per-layer module paths).
ATTENTION_CONV = "attention_conv"
MLP_CONV = "mlp_conv"
CONV_BASE_KERNEL = "base_kernel"  # leaf: [2 (before | after), kernel_size, hidden]
CONV_KERNEL_PROJECTION = "kernel_projection"  # module: weight [2 * kernel_size * groups, hidden]

# Tensors hanging off a module prefix.
WEIGHT = "weight"
BIAS = "bias"
WEIGHTS_SCALING_FACTOR = "weights_scaling_factor"
WEIGHTS_SCALING_FACTOR_2 = "weights_scaling_factor_2"
ACTIVATION_SCALING_FACTOR = "activation_scaling_factor"
KV_CACHE_SCALING_FACTOR = "kv_cache_scaling_factor"


def target_layer(index: int) -> str:
    return f"{TARGET_PREFIX}.layers.{index}"


def draft_layer(index: int) -> str:
    return f"{DRAFT_PREFIX}.layers.{index}"


def tensor(prefix: str, module: str, leaf: str = WEIGHT) -> str:
    """`tensor(target_layer(3), QKV)` -> 'transformer.layers.3.attention.qkv.weight'."""
    return f"{prefix}.{module}.{leaf}"


def kv_cache_scale(layer_prefix: str) -> str:
    return tensor(layer_prefix, ATTENTION, KV_CACHE_SCALING_FACTOR)
