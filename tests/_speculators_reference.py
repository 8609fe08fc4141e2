"""What the `speculators` package's own modules compute for a drafter it wrote: the independent oracle of the
speculators parity tests.

speculators 0.9.0 ships its drafters as training modules: `_backbone_forward` runs anchored blocks over a whole
sequence (each block sees the target's hidden states strictly before its anchor, within the sliding window on
sliding layers) and gives every block slot's hidden state and logits. DFlash2's `CandidateSelector.select` scores
the unary top-k of one slot given its predecessor token; the serving walk (the previous slot's choice is the next
slot's predecessor, starting at the anchor) is driven here, one `select` per slot. Attention runs in eager mode
(speculators' float-mask path) since flex attention needs a compiler on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import speculators.models.dflash.core as dflash_core
import torch
from speculators.model import SpeculatorModel
from speculators.models.attention import create_float_mask


@dataclass
class AnchoredBlocks:
    hidden: torch.Tensor  # [anchors, B, H]: the drafter's final-norm output of every block slot
    logits: torch.Tensor  # [anchors, B, draft vocab]
    chains: list[list[int]]  # per anchor: the drafts (target ids) of its draft slots


def load_reference(draft_dir, hf_target) -> SpeculatorModel:
    """The drafter loaded by speculators itself, its verifier-owned modules filled from the HF target, in eager
    attention."""
    model = SpeculatorModel.from_pretrained(str(draft_dir)).eval()
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl = "eager"
    model._create_mask_fn = create_float_mask
    with torch.no_grad():
        model.embed_tokens.weight.copy_(hf_target.get_input_embeddings().weight)
        model.verifier_norm.weight.copy_(hf_target.model.norm.weight)
        if not model.use_draft_vocab:
            model.lm_head.weight.copy_(hf_target.lm_head.weight)
        model.verifier_lm_head.weight.copy_(model.lm_head.weight)
    return model


def _walk(model, logits: torch.Tensor, hidden: torch.Tensor, anchor: int) -> list[int]:
    """The selector's left-to-right walk over draft slots, each step scored by speculators' `select`."""
    chain, previous = [], torch.tensor([anchor])
    for slot in range(logits.shape[0]):
        candidates, scores = model.candidate_selector.select(logits[slot : slot + 1], hidden[slot : slot + 1], previous)
        previous = candidates[0, scores[0].argmax()].view(1)
        chain.append(int(previous))
    return chain


def anchored_blocks(model, hf_target, tokens: list[int], anchors: list[int], monkeypatch) -> AnchoredBlocks:
    """speculators' drafter over `tokens` with one block at each anchor, and each block's chain of drafts."""
    block = model.block_size
    spec_cfg = model.config
    padded = tokens + [spec_cfg.mask_token_id] * block  # block slots past the end must still index the sequence
    ids = torch.tensor([padded])
    with torch.no_grad():
        states = hf_target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    taps = torch.cat([states[i] for i in spec_cfg.aux_hidden_state_layer_ids], dim=-1)
    taps = torch.cat([taps, taps.new_zeros(1, block, taps.shape[-1])], dim=1)
    picked = torch.tensor(anchors)
    monkeypatch.setattr(dflash_core, "select_anchors", lambda *_: (picked, torch.ones(len(anchors), dtype=torch.bool)))
    with torch.no_grad():
        hidden, logits, *_ = model._backbone_forward(
            taps,
            ids,
            torch.ones_like(ids),
            torch.zeros(1, ids.shape[1], taps.shape[-1] // len(spec_cfg.aux_hidden_state_layer_ids)),
            torch.zeros_like(ids),
            max_anchors=len(anchors),
        )
    hidden, logits = hidden.view(len(anchors), block, -1), logits.view(len(anchors), block, -1)
    first = 0 if spec_cfg.sample_from_anchor else 1
    chains = []
    with torch.no_grad():
        for row, anchor in enumerate(anchors):
            if hasattr(model, "candidate_selector"):
                chains.append(_walk(model, logits[row, first:], hidden[row, first:], tokens[anchor]))
                continue
            drafts = logits[row, first:].argmax(dim=-1)
            if model.use_draft_vocab:
                drafts = drafts + model.d2t[drafts]
            chains.append(drafts.tolist())
    return AnchoredBlocks(hidden, logits, chains)
