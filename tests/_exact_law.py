"""The small random pair the exact-law tests enumerate every uniform cell over (vocabulary 8, two drafts), and the
pieces both the chain's and the tree's enumerations read from it."""

from __future__ import annotations

from pathlib import Path

import torch
from _pairs import PairVariant, make_pair

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.reference.model import GoldenModel, load_golden_model

VOCAB, K, PROMPT = 8, 2, [3, 5, 7]


def small_pair(tmp_path_factory) -> tuple[Path, GoldenModel]:
    """The converted pair (float32) and its golden model."""
    root = tmp_path_factory.mktemp("tiny")
    target_dir, draft_dir = make_pair(
        root, PairVariant(vocab=VOCAB, block_size=K + 1, init_std=0.15, taps=[1, 3], seed=3)
    )
    convert_checkpoint(target_dir, draft_dir, root / "ckpt", dtype="float32")
    return root / "ckpt", load_golden_model(root / "ckpt")


def draft_logits(model: GoldenModel, prefix: list[int]) -> torch.Tensor:
    """The drafter's `[K, V]` logits for the block after `prefix`: context = every token but the last (the anchor)."""
    n = len(prefix)
    tokens = torch.tensor([prefix])
    positions = torch.arange(n)[None]
    valid = torch.ones_like(tokens, dtype=torch.bool)
    _, taps = model.target.forward(tokens, positions, valid, model.target.new_cache(1, n + K + 1))
    cache = model.draft.new_cache(1, n + K + 1)
    model.draft.inject(taps[:, : n - 1], positions[:, : n - 1], valid[:, : n - 1], cache)
    block = torch.tensor([[prefix[-1]] + [model.draft.spec.mask_token_id] * K])
    hidden = model.draft.forward(block, torch.tensor([n - 1]), torch.ones(1, K + 1, dtype=torch.bool), cache)
    return model.draft.unary_logits(hidden[:, 1:])[0]


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.double() / temperature, dim=-1)


def cells(probs: torch.Tensor) -> list[tuple[int, float, float]]:
    """(token, probability, a uniform inside the token's inverse-CDF interval) for every token of mass > 1e-12."""
    upper = probs.cumsum(0)
    return [(t, float(probs[t]), float(upper[t] - probs[t] / 2)) for t in range(len(probs)) if probs[t] > 1e-12]
