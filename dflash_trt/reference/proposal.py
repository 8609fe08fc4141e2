"""How a drafter's block hidden states become draft tokens, as the engine chooses them (the golden definition).

- DFlash v1: the argmax of each slot's logits, over the target's vocabulary (the target's lm_head, the drafter's
  output multiplier and softcap) or over a reduced draft vocabulary (the drafter's own head), mapped to target ids.
- DFlash2: the candidate selector. Per slot the `top_k` best logits are the candidates; walking the slots left to
  right, each candidate's score is its logit plus the bilinear transition
  `<predecessor_codebook[previous token] * hidden_projection(hidden), successor_codebook[candidate]>`, the previous
  token starting at the anchor; the best-scoring candidate is the slot's draft and the next slot's predecessor. The
  result is one chain, verified like v1's. The transition is computed in float32 from the projection's output in
  the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DraftChoice:
    """The drafter's scores at each slot and what they choose between: the draft is each slot's argmax."""

    scores: torch.Tensor  # float32 [b, slots, candidates]
    candidates: torch.Tensor | None  # int64 [b, slots, candidates] target ids; None: candidate c is token c

    def tokens(self) -> torch.Tensor:
        """The draft tokens `[b, slots]` (target ids)."""
        index = self.scores.argmax(dim=-1)
        if self.candidates is None:
            return index
        return self.candidates.gather(-1, index[..., None])[..., 0]

    def rank(self, row: int, slot: int, token: int) -> int | None:
        """Where `token` stands in `slot`'s scores (1 = the best; equal scores share a rank), or None when it is not
        one of the slot's candidates (a reduced vocabulary, DFlash2's top-k)."""
        scores = self.scores[row, slot]
        column = token
        if self.candidates is not None:
            matches = (self.candidates[row, slot] == token).nonzero()
            if not len(matches):
                return None
            column = int(matches[0, 0])
        return 1 + int((scores > scores[column]).sum())


@dataclass
class CandidateSelector:
    predecessor_codebook: torch.Tensor  # [vocab, rank]
    successor_codebook: torch.Tensor  # [vocab, rank]
    hidden_projection: torch.Tensor  # [rank, hidden]
    top_k: int

    def walk(self, logits: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor) -> DraftChoice:
        """The greedy walk over slots: `logits [b, slots, vocab]` (float32), `hidden [b, slots, H]`, `anchors [b]`."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)
        projected = F.linear(hidden, self.hidden_projection).float()
        previous = anchors
        scores = []
        for slot in range(logits.shape[1]):
            context = self.predecessor_codebook[previous].float() * projected[:, slot]
            successors = self.successor_codebook[candidates[:, slot]].float()
            score = unary[:, slot] + (context[:, None, :] * successors).sum(dim=-1)
            previous = candidates[:, slot].gather(-1, score.argmax(dim=-1, keepdim=True))[:, 0]
            scores.append(score)
        return DraftChoice(torch.stack(scores, dim=1), candidates)


@dataclass
class DraftHead:
    """A drafter's unary logits and, for DFlash2, its selector."""

    logits: Callable[[torch.Tensor], torch.Tensor]  # hidden [b, slots, H] -> float32 [b, slots, draft vocab]
    target_ids: torch.Tensor | None  # int64 [draft vocab]: a reduced vocabulary's target ids
    selector: CandidateSelector | None

    def choose(self, hidden: torch.Tensor, anchors: torch.Tensor) -> DraftChoice:
        """The engine's drafts of the slots of `hidden`, whose first slot follows `anchors`."""
        logits = self.logits(hidden)
        if self.selector is not None:
            return self.selector.walk(logits, hidden, anchors)
        if self.target_ids is None:
            return DraftChoice(logits, None)
        return DraftChoice(logits, self.target_ids.expand(*logits.shape))

    def target_probs(self, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-vocabulary probabilities `[..., draft vocab]` placed at their target ids `[..., vocab_size]`."""
        if self.target_ids is None:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], vocab_size)
        return full.index_copy_(-1, self.target_ids, probs)
