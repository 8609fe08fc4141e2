"""Model shapes for the performance model, taken from the same specs conversion uses."""

from __future__ import annotations

from pathlib import Path

from dflash_trt.perf.model import DFlashDrafter, Eagle3Drafter, StackShape, TargetModel
from dflash_trt.spec import SLIDING_ATTENTION, DraftSpec, TargetSpec, load_draft_spec, load_target_spec

EAGLE3_TAPS = 3  # EAGLE-3 fuses low, middle and high target layers


def target_from_spec(spec: TargetSpec) -> TargetModel:
    """A Qwen3-MoE target is costed as all-sparse (its experts' size, top-k of them per token): the layers that keep
    a dense MLP, if any, are counted as sparse too."""
    moe = spec.moe
    stack = StackShape(
        num_layers=spec.num_hidden_layers,
        hidden=spec.hidden_size,
        intermediate=moe.intermediate_size if moe else spec.intermediate_size,
        num_heads=spec.num_attention_heads,
        num_kv_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        num_experts=moe.num_experts if moe else 0,
        experts_per_token=moe.top_k if moe else 0,
    )
    return TargetModel(stack=stack, vocab=spec.vocab_size)


def dflash_from_spec(spec: DraftSpec) -> DFlashDrafter:
    sliding = sum(kind == SLIDING_ATTENTION for kind in spec.layer_types) if spec.sliding_window else 0
    stack = StackShape(
        num_layers=spec.num_hidden_layers,
        hidden=spec.hidden_size,
        intermediate=spec.intermediate_size,
        num_heads=spec.num_attention_heads,
        num_kv_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        sliding_window=spec.sliding_window,
        num_sliding_layers=sliding,
    )
    return DFlashDrafter(stack=stack, num_taps=len(spec.target_layer_ids), block_size=spec.block_size)


def eagle3_like(target: TargetModel, steps: int, draft_vocab: int | None = None) -> Eagle3Drafter:
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
    return Eagle3Drafter(stack=stack, num_taps=EAGLE3_TAPS, draft_vocab=draft_vocab or target.vocab, steps=steps)


def load_models(model_dir: str | Path, dflash_model_dir: str | Path | None) -> tuple[TargetModel, DFlashDrafter | None]:
    """Target (and drafter) shapes from HF checkpoint folders; only config.json is read."""
    target_spec = load_target_spec(model_dir)
    drafter = dflash_from_spec(load_draft_spec(dflash_model_dir, target_spec)) if dflash_model_dir else None
    return target_from_spec(target_spec), drafter
