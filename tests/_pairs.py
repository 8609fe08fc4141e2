"""Tiny random target + DFlash drafter checkpoints written with `transformers` and the `dflash` reference package.

They are the independent side of every parity test: HF writes the target, `dflash.DFlashDraftModel` writes the
drafter, and our converter + golden model must reproduce what those libraries compute from the same files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from dflash.model import DFlash2DraftModel, DFlashDraftModel
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)


@dataclass
class PairVariant:
    arch: str = "qwen3"  # or "llama", "qwen3_moe"
    vocab: int = 96
    hidden: int = 64
    intermediate: int = 96
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    tie: bool = False
    target_bias: bool = False
    rope: dict | None = None
    draft_rope: dict | None = None  # the drafter's own RoPE parameters (default: the target's `rope`)
    draft_layers: int = 2
    draft_heads: int = 4
    draft_kv_heads: int = 2
    draft_head_dim: int = 16
    draft_intermediate: int = 80
    block_size: int = 8
    taps: list[int] | None = field(default_factory=lambda: [0, 2])
    draft_bias: bool = False
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None
    dflash_extra: dict = field(default_factory=dict)
    top_level: dict = field(default_factory=dict)
    init_std: float = 0.25
    seed: int = 0
    # Hidden dimension 0 holds +10 in every embedding and no layer writes to it, while every lm_head row reads it with
    # weight -2: every logit is negative, so an argmax that strays onto zero lm_head padding rows picks them.
    negative_logits: bool = False
    # A DFlash2 drafter: its dflash_config keys (conv_kernel_size, conv_group_size, selector_rank, selector_top_k),
    # and whether its codebooks are stored as published (no `.weight`) or as the dflash package saves them.
    dflash2: dict | None = None
    published_codebooks: bool = True
    # qwen3_moe only: Qwen3MoeConfig keys (num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
    # mlp_only_layers, decoder_sparse_step)
    moe: dict = field(
        default_factory=lambda: {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        }
    )


def _randomize(model: torch.nn.Module, std: float, seed: int) -> None:
    """Larger-than-default weights so logits are peaked: near-ties would make greedy tests flaky."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("base_kernel"):  # DFlash2 convolutions: near identity, so they shape, not drown
                identity = torch.zeros_like(param)
                identity[:, 0] = 1.0
                param.copy_(identity + 0.3 * torch.randn(param.shape, generator=generator))
            elif "kernel_projection" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(std * torch.randn(param.shape, generator=generator))


def make_target(path: Path, v: PairVariant) -> torch.nn.Module:
    common = dict(
        vocab_size=v.vocab,
        hidden_size=v.hidden,
        intermediate_size=v.intermediate,
        num_hidden_layers=v.layers,
        num_attention_heads=v.heads,
        num_key_value_heads=v.kv_heads,
        head_dim=v.head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=v.tie,
        attention_bias=v.target_bias,
        eos_token_id=1,
        bos_token_id=0,
    )
    if v.rope:
        common["rope_parameters"] = v.rope
    if v.arch == "qwen3":
        cfg, cls = Qwen3Config(**common), Qwen3ForCausalLM
    elif v.arch == "qwen3_moe":
        cfg, cls = Qwen3MoeConfig(**common, **v.moe), Qwen3MoeForCausalLM
    else:
        cfg, cls = LlamaConfig(mlp_bias=v.target_bias, **common), LlamaForCausalLM
    cfg.architectures = [cls.__name__]
    torch.manual_seed(v.seed)
    model = cls(cfg).eval()
    _randomize(model, v.init_std / 2, v.seed)
    if v.tie:
        model.tie_weights()
    if v.negative_logits:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = 10.0
            _silence_dimension_zero(model.model.layers)
            model.lm_head.weight[:, 0] = -2.0
    model.save_pretrained(path)
    return model


def _silence_dimension_zero(layers) -> None:
    """No layer output (attention or MLP, bias included) adds to hidden dimension 0 of the residual stream."""
    for layer in layers:
        for out in (layer.self_attn.o_proj, layer.mlp.down_proj):
            out.weight[0, :] = 0.0
            if out.bias is not None:
                out.bias[0] = 0.0


def _publish_codebooks(path: Path) -> None:
    """Rename the selector codebooks the way published DFlash2 checkpoints store them (no `.weight`)."""
    weights = load_file(path / "model.safetensors")
    renamed = {name.removesuffix(".weight") if "codebook" in name else name: t for name, t in weights.items()}
    save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})


def make_draft(path: Path, v: PairVariant) -> DFlashDraftModel:
    kwargs = dict(
        vocab_size=v.vocab,
        hidden_size=v.hidden,
        intermediate_size=v.draft_intermediate,
        num_hidden_layers=v.draft_layers,
        num_attention_heads=v.draft_heads,
        num_key_value_heads=v.draft_kv_heads,
        head_dim=v.draft_head_dim,
        max_position_embeddings=512,
        attention_bias=v.draft_bias,
    )
    if v.draft_rope or v.rope:
        kwargs["rope_parameters"] = v.draft_rope or v.rope
    if v.sliding_window is not None:
        kwargs.update(use_sliding_window=True, sliding_window=v.sliding_window)
    if v.layer_types is not None:
        kwargs["layer_types"] = v.layer_types
    cfg = Qwen3Config(**kwargs)
    cfg.architectures = ["DFlash2DraftModel" if v.dflash2 else "DFlashDraftModel"]
    cfg.num_target_layers = v.layers
    cfg.block_size = v.block_size
    dflash_config = {"mask_token_id": v.vocab - 1, **(v.dflash2 or {}), **v.dflash_extra}
    if v.taps is not None:
        dflash_config["target_layer_ids"] = v.taps
    cfg.dflash_config = dflash_config
    if v.is_causal is not None:
        cfg.is_causal = v.is_causal
    for key, value in v.top_level.items():
        setattr(cfg, key, value)
    torch.manual_seed(v.seed + 1)
    model = (DFlash2DraftModel if v.dflash2 else DFlashDraftModel)(cfg).eval()
    _randomize(model, v.init_std, v.seed + 1)
    if v.negative_logits:
        with torch.no_grad():
            _silence_dimension_zero(model.layers)
    model.save_pretrained(path)
    if v.dflash2 and v.published_codebooks:
        _publish_codebooks(path)
    return model


def make_pair(root: Path, v: PairVariant | None = None) -> tuple[Path, Path]:
    v = v or PairVariant()
    target_dir, draft_dir = root / "target", root / "draft"
    make_target(target_dir, v)
    make_draft(draft_dir, v)
    return target_dir, draft_dir
