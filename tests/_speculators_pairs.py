"""Tiny random targets (written by HF) with drafters written by the `speculators` package itself (0.9.0): its
`DFlashDraftModel` / `DFlash2DraftModel`, its config classes and its `save_pretrained`, so the files are exactly what
a user who trained a drafter with speculators holds. The independent side of the speculators parity tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from _pairs import PairVariant, make_target
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig, Qwen3Config


@dataclass
class SpeculatorsVariant:
    kind: str = "dflash2"  # or "dflash"
    target: PairVariant = field(default_factory=PairVariant)
    layer_config: str = "qwen3"  # the transformer_layer_config class: "qwen3" or "llama"
    draft_layers: int = 2
    draft_heads: int = 4
    draft_kv_heads: int = 2
    draft_head_dim: int = 16
    draft_intermediate: int = 80
    block_size: int = 8
    aux_ids: list[int] = field(default_factory=lambda: [1, 3])  # indices into hidden_states (0 = embeddings)
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    sliding_window_non_causal: bool | None = None
    sample_from_anchor: bool = False
    draft_vocab_size: int | None = None  # None: the target's
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 12
    selector_top_k: int = 6
    rope: dict | None = None
    init_std: float = 0.25
    seed: int = 0


def _layer_config(v: SpeculatorsVariant):
    t = v.target
    fields = dict(
        vocab_size=t.vocab,
        hidden_size=t.hidden,
        intermediate_size=v.draft_intermediate,
        num_hidden_layers=v.draft_layers,
        num_attention_heads=v.draft_heads,
        num_key_value_heads=v.draft_kv_heads,
        head_dim=v.draft_head_dim,
        max_position_embeddings=512,
    )
    if v.rope:
        fields["rope_parameters"] = v.rope
    if v.layer_types is not None:
        fields["layer_types"] = v.layer_types
    if v.layer_config == "llama":
        return LlamaConfig(**fields, sliding_window=v.sliding_window)
    if v.sliding_window is not None:
        fields.update(use_sliding_window=True, sliding_window=v.sliding_window)
    return Qwen3Config(**fields)


def _config(v: SpeculatorsVariant):
    draft_vocab = v.draft_vocab_size or v.target.vocab
    common = dict(
        transformer_layer_config=_layer_config(v),
        draft_vocab_size=draft_vocab,
        block_size=v.block_size,
        aux_hidden_state_layer_ids=v.aux_ids,
        mask_token_id=v.target.vocab - 1,
        sample_from_anchor=v.sample_from_anchor,
        speculators_config=SpeculatorsConfig(
            algorithm=v.kind,
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=v.block_size - 1 + v.sample_from_anchor)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=[]),
        ),
    )
    if v.sliding_window_non_causal is not None:
        common["sliding_window_non_causal"] = v.sliding_window_non_causal
    if v.kind == "dflash":
        return DFlashSpeculatorConfig(**common)
    return DFlash2SpeculatorConfig(
        **common,
        conv_kernel_size=v.conv_kernel_size,
        conv_group_size=v.conv_group_size,
        selector_rank=v.selector_rank,
        selector_top_k=v.selector_top_k,
    )


def _randomize(model: torch.nn.Module, std: float, seed: int) -> None:
    """Peaked logits (few near-ties): norms near 1, everything else large; convolution kernels near identity plus
    noise, so the convolutions matter without drowning the attention."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("base_kernel"):
                identity = torch.zeros_like(param)
                identity[:, 0] = 1.0
                param.copy_(identity + 0.3 * noise)
            elif "kernel_projection" in name:
                param.copy_(0.05 * noise)
            elif name.startswith(("embed_tokens", "lm_head", "verifier_")):
                continue
            else:
                param.copy_(std * noise)


def _vocabulary_maps(v: SpeculatorsVariant) -> tuple[torch.Tensor, torch.Tensor]:
    """A reduced draft vocabulary: every id the mask leaves room for, spread over the target's (mask excluded)."""
    size, vocab = v.draft_vocab_size, v.target.vocab
    assert size is not None
    ids = torch.linspace(0, vocab - 2, size).round().long().unique()
    assert len(ids) == size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return t2d, ids - torch.arange(size)


def make_speculators_draft(path: Path, v: SpeculatorsVariant, target: torch.nn.Module):
    """The drafter, written by speculators' save_pretrained; its verifier-owned modules are filled from the target
    (a reduced vocabulary's head is the target head's rows, as speculators builds it)."""
    model_class = DFlashDraftModel if v.kind == "dflash" else DFlash2DraftModel
    torch.manual_seed(v.seed + 1)
    model = model_class(_config(v)).eval()
    _randomize(model, v.init_std, v.seed + 1)
    head = target.lm_head.weight.detach()
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.verifier_norm.weight.copy_(target.model.norm.weight)
        if v.draft_vocab_size is not None:
            t2d, d2t = _vocabulary_maps(v)
            model.load_vocab_mappings(t2d, d2t)
            head = head[t2d]
        model.lm_head.weight.copy_(head)
        model.verifier_lm_head.weight.copy_(head)
    model.save_pretrained(path)
    return model


def make_speculators_pair(root: Path, v: SpeculatorsVariant) -> tuple[Path, Path]:
    target_dir, draft_dir = root / "target", root / "draft"
    target = make_target(target_dir, v.target)
    make_speculators_draft(draft_dir, v, target)
    return target_dir, draft_dir
