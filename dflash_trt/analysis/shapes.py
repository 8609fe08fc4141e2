"""Model shapes for the performance model, taken from the same specs conversion uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_trt.analysis.model import DFlashShape, Eagle3Shape, StackShape, TargetShape
from dflash_trt.spec import SLIDING_ATTENTION, DecoderSpec, DraftSpec, TargetSpec, load_draft_spec, load_target_spec

EAGLE3_TAPS = 3  # EAGLE-3 fuses low, middle and high target layers


def stack_from_spec(spec: DecoderSpec, **extra: Any) -> StackShape:
    """The decoder stack's shape, from the fields every spec shares (`extra` adds or overrides fields)."""
    fields: dict[str, Any] = {
        "num_layers": spec.num_hidden_layers,
        "hidden": spec.hidden_size,
        "intermediate": spec.intermediate_size,
        "num_heads": spec.num_attention_heads,
        "num_kv_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
    }
    return StackShape(**{**fields, **extra})


def target_from_spec(spec: TargetSpec) -> TargetShape:
    """A Qwen3-MoE target is costed as all-sparse (its experts' size, top-k of them per token): the layers that keep
    a dense MLP, if any, are counted as sparse too."""
    moe = spec.moe
    experts = (
        {}
        if moe is None
        else {
            "intermediate": moe.intermediate_size,
            "num_experts": moe.num_experts,
            "experts_per_token": moe.top_k,
        }
    )
    return TargetShape(
        stack=stack_from_spec(spec, **experts), vocab=spec.vocab_size, tied_embeddings=spec.tie_word_embeddings
    )


def dflash_from_spec(spec: DraftSpec) -> DFlashShape:
    sliding = sum(kind == SLIDING_ATTENTION for kind in spec.layer_types) if spec.sliding_window else 0
    stack = stack_from_spec(spec, sliding_window=spec.sliding_window, num_sliding_layers=sliding)
    return DFlashShape(stack=stack, num_taps=len(spec.target_layer_ids), block_size=spec.block_size)


def eagle3_like(target: TargetShape, steps: int, draft_vocab: int | None = None) -> Eagle3Shape:
    """An EAGLE-3 drafter for `target`: one target-sized layer on concat(embedding, fused taps)."""
    t = target.stack
    stack = StackShape(
        num_layers=1,
        hidden=t.hidden,
        intermediate=t.intermediate if not t.num_experts else 4 * t.hidden,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        attn_input=2 * t.hidden,
    )
    return Eagle3Shape(stack=stack, num_taps=EAGLE3_TAPS, draft_vocab=draft_vocab or target.vocab, steps=steps)


def load_models(model_dir: str | Path, dflash_model_dir: str | Path | None) -> tuple[TargetShape, DFlashShape | None]:
    """Target (and drafter) shapes from HF checkpoint folders; only config.json is read."""
    target_spec = load_target_spec(model_dir)
    drafter = dflash_from_spec(load_draft_spec(dflash_model_dir, target_spec)) if dflash_model_dir else None
    return target_from_spec(target_spec), drafter
