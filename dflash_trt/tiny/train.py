"""Training loops: the target as a plain causal LM, then the drafter with the DFlash block recipe.

The drafter loss follows the DFlash recipe: random anchors in the response, block `[anchor, MASK...]`,
context = target tap features strictly before the anchor, bidirectional attention inside the block,
cross-entropy on block positions 1..B-1 weighted by exp(-(k-1)/gamma). Target embeddings and lm_head are
shared and frozen. All anchors of a batch go through ONE masked drafter forward.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from dflash.model import DFlashDraftModel, extract_context_feature
from torch.nn import functional as F
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from dflash_trt.tiny.corpus import Problem

Log = Callable[[str], None]


@dataclass(frozen=True)
class EncodedCorpus:
    """Right-padded token ids (pad = EOS) with each row's real length and prompt length."""

    ids: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor


def encode(problems: list[Problem], tokenizer: PreTrainedTokenizerFast) -> EncodedCorpus:
    """Tokenize prompt + response + EOS; the response and EOS are what the models learn to write."""
    eos = tokenizer.eos_token_id
    texts = tokenizer([p.text for p in problems], add_special_tokens=False)["input_ids"]
    prompts = tokenizer([p.prompt for p in problems], add_special_tokens=False)["input_ids"]
    width = max(len(t) for t in texts) + 1
    ids = torch.full((len(problems), width), eos, dtype=torch.long)
    for row, tokens in enumerate(texts):
        ids[row, : len(tokens)] = torch.tensor(tokens)
    lengths = torch.tensor([len(t) + 1 for t in texts])
    prompt_lengths = torch.tensor([len(p) for p in prompts])
    return EncodedCorpus(ids, lengths, prompt_lengths)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def shuffled_batches(count: int, batch_size: int, steps: int, generator: torch.Generator):
    """Epoch-wise shuffled row indices, `steps` batches in total."""
    order = torch.randperm(count, generator=generator)
    cursor = 0
    for _ in range(steps):
        if cursor + batch_size > count:
            order, cursor = torch.randperm(count, generator=generator), 0
        yield order[cursor : cursor + batch_size]
        cursor += batch_size


def train_target(
    model: Qwen3ForCausalLM,
    corpus: EncodedCorpus,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    log: Log,
) -> None:
    """Next-token cross-entropy on response tokens (prompts are random operands, nothing to learn there)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    positions = torch.arange(corpus.ids.shape[1])
    model.train()
    start = time.perf_counter()
    for step, rows in enumerate(shuffled_batches(len(corpus.ids), batch_size, steps, generator)):
        ids = corpus.ids[rows]
        label_pos = positions[1:]
        learn = (label_pos >= corpus.prompt_lengths[rows, None]) & (label_pos < corpus.lengths[rows, None])
        logits = model(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits[learn], ids[:, 1:][learn])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=min(200, steps // 10))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"target step {step}/{steps} loss {loss.item():.4f} {time.perf_counter() - start:.0f}s")
    model.eval()


@dataclass(frozen=True)
class DraftBatch:
    """Inputs of one masked drafter forward: Q = all blocks, KV = [context | all blocks]."""

    block_ids: torch.Tensor  # [b, A*B]
    position_ids: torch.Tensor  # [b, S + A*B]
    attention_mask: torch.Tensor  # [b, 1, A*B, S + A*B] bool, True = may attend
    labels: torch.Tensor  # [b, A*B]
    weights: torch.Tensor  # [b, A*B], 0 where there is no label


def draft_batch(
    ids: torch.Tensor,
    anchors: torch.Tensor,
    lengths: torch.Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> DraftBatch:
    """Blocks `[ids[a], MASK...]` at positions a..a+B-1; each sees context < a and only its own block."""
    batch, seq = ids.shape
    num_anchors = anchors.shape[1]
    offsets = torch.arange(block_size)
    block_pos = anchors[:, :, None] + offsets  # [b, A, B]
    block_ids = torch.full((batch, num_anchors, block_size), mask_token_id, dtype=torch.long)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    labels = ids.gather(1, block_pos.clamp(max=seq - 1).view(batch, -1)).view(batch, num_anchors, block_size)
    valid = (block_pos < lengths[:, None, None]) & (offsets > 0)
    decay = torch.exp(-(offsets.clamp(min=1) - 1).float() / gamma)
    weights = valid.float() * decay

    sees_context = torch.arange(seq)[None, None, :] < anchors[:, :, None]  # [b, A, S]
    same_block = torch.eye(num_anchors, dtype=torch.bool)  # [A, A]
    context_part = sees_context[:, :, None, :].expand(batch, num_anchors, block_size, seq)
    block_part = same_block[None, :, None, :, None].expand(batch, num_anchors, block_size, num_anchors, block_size)
    mask = torch.cat(
        [
            context_part.reshape(batch, num_anchors * block_size, seq),
            block_part.reshape(batch, num_anchors * block_size, num_anchors * block_size),
        ],
        dim=-1,
    )
    position_ids = torch.cat([torch.arange(seq).expand(batch, seq), block_pos.view(batch, -1)], dim=1)
    return DraftBatch(
        block_ids=block_ids.view(batch, -1),
        position_ids=position_ids,
        attention_mask=mask[:, None],
        labels=labels.view(batch, -1),
        weights=weights.view(batch, -1),
    )


def sample_anchors(
    prompt_lengths: torch.Tensor, lengths: torch.Tensor, seq: int, num_anchors: int, generator: torch.Generator
) -> torch.Tensor:
    """Distinct random anchors among response positions that still have at least one token after them."""
    positions = torch.arange(seq)
    allowed = (positions >= prompt_lengths[:, None]) & (positions <= lengths[:, None] - 2)
    scores = torch.rand(allowed.shape, generator=generator).masked_fill(~allowed, -1.0)
    return scores.topk(num_anchors, dim=1).indices


def draft_logits(
    draft: DFlashDraftModel, target: Qwen3ForCausalLM, ids: torch.Tensor, batch: DraftBatch
) -> torch.Tensor:
    """Drafter logits for every block position, through the frozen target's taps, embeddings and lm_head."""
    with torch.no_grad():
        hidden_states = target.model(input_ids=ids, output_hidden_states=True).hidden_states
        context = extract_context_feature(hidden_states, draft.target_layer_ids)
        noise = target.get_input_embeddings()(batch.block_ids)
    hidden = draft(
        position_ids=batch.position_ids,
        attention_mask=batch.attention_mask,
        noise_embedding=noise,
        target_hidden=context,
    )
    return draft.compute_logits(hidden, target.lm_head)


def train_draft(
    draft: DFlashDraftModel,
    target: Qwen3ForCausalLM,
    corpus: EncodedCorpus,
    *,
    steps: int,
    batch_size: int,
    num_anchors: int,
    gamma: float,
    lr: float,
    seed: int,
    log: Log,
) -> None:
    target.requires_grad_(False)
    target.eval()
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    draft.train()
    start = time.perf_counter()
    for step, rows in enumerate(shuffled_batches(len(corpus.ids), batch_size, steps, generator)):
        ids, lengths = corpus.ids[rows], corpus.lengths[rows]
        anchors = sample_anchors(corpus.prompt_lengths[rows], lengths, ids.shape[1], num_anchors, generator)
        batch = draft_batch(
            ids, anchors, lengths, block_size=draft.block_size, mask_token_id=draft.mask_token_id, gamma=gamma
        )
        logits = draft_logits(draft, target, ids, batch)
        per_token = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
        loss = (per_token * batch.weights.flatten()).sum() / batch.weights.sum()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=min(200, steps // 10))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            with torch.no_grad():
                hit = (logits.argmax(-1) == batch.labels) & (batch.weights > 0)
                acc = hit.sum().item() / (batch.weights > 0).sum().item()
            log(f"draft step {step}/{steps} loss {loss.item():.4f} acc {acc:.3f} {time.perf_counter() - start:.0f}s")
    draft.eval()
