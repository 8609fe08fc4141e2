"""A DFlash2 drafter for the tiny target, trained with the `speculators` package's own model and losses.

This is what a user who trains a drafter with speculators does, scaled to the tiny pair: `DFlash2DraftModel`
(speculators 0.9.0) with its training forward (random anchors, anchored blocks over packed sequences, the unary
KL-to-target loss plus the selector's top-k cross-entropy, exponential decay over block positions), fed the frozen
target's hidden states at `aux_hidden_state_layer_ids` and its pre-norm last layer, and saved by its own
`save_pretrained` in the speculators format. Each training row is one problem (prompt, response, EOS) followed by
`block_size` padding tokens outside the loss, so no block reaches into the next packed problem's loss. Attention
runs through PyTorch's SDPA with speculators' boolean block mask: its default flex attention needs a compiler on a
CPU, and SDPA is four times faster there than the eager path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_trt.tiny import models
from dflash_trt.tiny.train import EncodedCorpus, Log, lr_at, shuffled_batches

BLOCK_SIZE = 8  # DFlash2's published block
# hidden_states indices of the same target layers as the v1 drafter's taps (speculators counts the embeddings).
AUX_HIDDEN_STATE_LAYER_IDS = [tap + 1 for tap in models.TARGET_LAYER_IDS]
SELECTOR_RANK = 64
SELECTOR_TOP_K = 16
CONV_KERNEL_SIZE = 2
CONV_GROUP_SIZE = 16


def dflash2_config(target: Qwen3Config, mask_token_id: int) -> DFlash2SpeculatorConfig:
    """The drafter's speculators config: the v1 drafter's decoder shape, DFlash2's block, convolution and selector."""
    layers = Qwen3Config(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=models.INTERMEDIATE_SIZE,
        num_hidden_layers=models.DRAFT_LAYERS,
        **models.SHARED,
    )
    layers._attn_implementation = "sdpa"
    return DFlash2SpeculatorConfig(
        transformer_layer_config=layers,
        draft_vocab_size=target.vocab_size,
        block_size=BLOCK_SIZE,
        aux_hidden_state_layer_ids=list(AUX_HIDDEN_STATE_LAYER_IDS),
        mask_token_id=mask_token_id,
        conv_kernel_size=CONV_KERNEL_SIZE,
        conv_group_size=CONV_GROUP_SIZE,
        selector_rank=SELECTOR_RANK,
        selector_top_k=SELECTOR_TOP_K,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash2",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK_SIZE - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=list(target.architectures or [])),
        ),
    )


def new_drafter(target: Qwen3ForCausalLM, mask_token_id: int) -> DFlash2DraftModel:
    """A fresh drafter sharing the frozen target's embeddings, head and final norm (the verifier modules)."""
    draft = DFlash2DraftModel(dflash2_config(target.config, mask_token_id))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
        draft.verifier_lm_head.weight.copy_(target.lm_head.weight)
        draft.verifier_norm.weight.copy_(target.model.norm.weight)
    return draft


@dataclass(frozen=True)
class PackedBatch:
    """Rows packed into one sequence, as speculators trains: ids, targets' features, loss mask, documents."""

    input_ids: torch.Tensor  # [1, S]
    hidden_states: torch.Tensor  # [1, S, taps * H]
    verifier_last_hidden_states: torch.Tensor  # [1, S, H]
    loss_mask: torch.Tensor  # [1, S]
    document_ids: torch.Tensor  # [1, S]
    position_ids: torch.Tensor  # [1, S]


@torch.no_grad()
def pack(target: Qwen3ForCausalLM, corpus: EncodedCorpus, rows: torch.Tensor) -> PackedBatch:
    """The target's features of each row's problem plus `BLOCK_SIZE` padding tokens, rows end to end."""
    lengths, prompts = corpus.lengths[rows], corpus.prompt_lengths[rows]
    width = int(lengths.max()) + BLOCK_SIZE
    ids = torch.full((len(rows), width), models.eos_token_id(target.config), dtype=torch.long)
    stored = min(width, corpus.ids.shape[1])
    ids[:, :stored] = corpus.ids[rows, :stored]
    captured: dict[str, torch.Tensor] = {}
    hook = target.model.norm.register_forward_hook(lambda _m, args, _o: captured.update(last=args[0]))
    try:
        states = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    taps = torch.cat([states[i] for i in AUX_HIDDEN_STATE_LAYER_IDS], dim=-1)
    keep = [length + BLOCK_SIZE for length in lengths.tolist()]
    positions = torch.arange(width)
    learn = (positions[None] >= prompts[:, None]) & (positions[None] < lengths[:, None])
    parts = {
        "input_ids": [ids[r, :n] for r, n in enumerate(keep)],
        "hidden_states": [taps[r, :n] for r, n in enumerate(keep)],
        "verifier_last_hidden_states": [captured["last"][r, :n] for r, n in enumerate(keep)],
        "loss_mask": [learn[r, :n].long() for r, n in enumerate(keep)],
        "document_ids": [torch.full((n,), r) for r, n in enumerate(keep)],
        "position_ids": [positions[:n] for n in keep],
    }
    return PackedBatch(**{name: torch.cat(pieces)[None] for name, pieces in parts.items()})


def train_dflash2(
    draft: DFlash2DraftModel,
    target: Qwen3ForCausalLM,
    corpus: EncodedCorpus,
    *,
    steps: int,
    batch_size: int,
    anchors_per_row: int,
    lr: float,
    seed: int,
    log: Log,
) -> None:
    """speculators' own training forward and losses over packed batches of the corpus."""
    target.requires_grad_(False)
    target.eval()
    torch.manual_seed(seed)  # speculators draws its anchors from the global generator
    generator = torch.Generator().manual_seed(seed)
    train_kwargs, _ = DFlash2DraftModel.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager")
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    draft.train()
    start = time.perf_counter()
    for step, rows in enumerate(shuffled_batches(len(corpus.ids), batch_size, steps, generator)):
        batch = pack(target, corpus, rows)
        _, loss, metrics = draft(**vars(batch), **{**train_kwargs, "max_anchors": anchors_per_row * batch_size})
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=min(200, steps // 10))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            accepted = float(metrics["eal_sum"]) / max(1.0, float(metrics["eal_total"]))
            log(
                f"dflash2 step {step}/{steps} loss {loss.item():.4f} selector-walk acceptance {accepted:.2f} "
                f"{time.perf_counter() - start:.0f}s"
            )
    draft.eval()
