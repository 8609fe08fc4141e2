"""The speculative decoding loop of docs/engine.md, batched over ragged prompts; it defines what the engine must do.

Per step and per sequence: draft a block `[anchor, MASK…]` from the accepted context, verify it with the target,
accept the longest matching prefix plus one target token, inject the accepted tokens' tap features into the
drafter's context cache, and rewind (a shorter length) everything else. Block size 1 is plain autoregressive
decoding with the same target, the baseline every speedup is measured against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.model import GoldenModel
from dflash_trt.reference.sampling import (
    SamplingParams,
    exact_match_accept,
    pick_tokens,
    rejection_accept,
    sample_by_uniform,
    sampling_probs,
)
from dflash_trt.sampling_rules import REFERENCE, sampling_refusal


@dataclass
class StepTrace:
    draft_ids: list[int]
    accepted: int


@dataclass
class SequenceResult:
    input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    steps: list[StepTrace] = field(default_factory=list)


@dataclass
class _Sequence:
    result: SequenceResult
    tokens: list[int]
    max_length: int
    stopped: bool = False

    @property
    def start(self) -> int:
        """Index of the current anchor: the last token produced, not yet in the target's KV cache."""
        return len(self.tokens) - 1

    @property
    def active(self) -> bool:
        return not self.stopped and self.start + 1 < self.max_length


def _check_prompts(prompts: list[list[int]], vocab_size: int, max_new_tokens: list[int]) -> None:
    if not prompts:
        raise DFlashTrtError("no prompts given")
    for i, (prompt, new) in enumerate(zip(prompts, max_new_tokens, strict=True)):
        if not prompt:
            raise DFlashTrtError(f"prompt {i} is empty")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise DFlashTrtError(f"prompt {i} has token ids outside the vocabulary (0..{vocab_size - 1})")
        if new < 1:
            raise DFlashTrtError(f"max_new_tokens must be >= 1, got {new} for prompt {i}")


def per_sequence_sampling(sampling: SamplingParams | list[SamplingParams] | None, batch: int) -> list[SamplingParams]:
    """One SamplingParams per sequence; refuses what the engine method cannot honour (top-k / top-p)."""
    if sampling is None or isinstance(sampling, SamplingParams):
        params = [sampling or SamplingParams()] * batch
    else:
        params = list(sampling)
        if len(params) != batch:
            raise DFlashTrtError(f"got {len(params)} sampling settings for {batch} prompts")
    if any(p.method == REFERENCE and not p.greedy for p in params) and len(set(params)) > 1:
        raise DFlashTrtError("the reference sampling method takes one setting for the whole batch")
    for p in params:
        if p.method != REFERENCE:
            refusal = sampling_refusal({"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k})
            if refusal is not None:
                raise DFlashTrtError(f"{refusal} (the reference method honours it: --sampling reference)")
    return params


def speculative_generate(
    model: GoldenModel,
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    stop_token_ids: list[int] | None = None,
    sampling: SamplingParams | list[SamplingParams] | None = None,
    seed: int = 0,
    block_size: int | None = None,
    seeds: list[int] | None = None,
    progress: Callable[[int], object] | None = None,
) -> list[SequenceResult]:
    """Generate for every prompt at once; results are identical to running each prompt alone (greedy, or with the
    engine's sampling when each sequence gets the same seed). `sampling` may be one SamplingParams per prompt (engine
    method only); `seeds` overrides the per-sequence seeds `seed + i` of the engine method. `progress` hears how many
    tokens each step produced."""
    per_sequence = per_sequence_sampling(sampling, len(prompts))
    sampling = per_sequence[0]
    reference = any(p.method == REFERENCE and not p.greedy for p in per_sequence)
    target, draft = model.target, model.draft
    block = draft.spec.block_size if block_size is None else block_size
    if not 1 <= block <= draft.spec.block_size:
        raise DFlashTrtError(f"block size must be in 1..{draft.spec.block_size}, got {block}")
    news = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    _check_prompts(prompts, target.spec.vocab_size, news)
    stops = torch.tensor(sorted(set(stop_token_ids or [])), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    sequence_seeds = list(seeds) if seeds is not None else [seed + i for i in range(len(prompts))]
    if len(sequence_seeds) != len(prompts):
        raise DFlashTrtError(f"got {len(sequence_seeds)} seeds for {len(prompts)} prompts")
    generators = [torch.Generator().manual_seed(s) for s in sequence_seeds]
    temperatures = [p.temperature for p in per_sequence]
    seqs = [_Sequence(SequenceResult(list(p)), list(p), len(p) + n) for p, n in zip(prompts, news, strict=True)]
    batch = len(seqs)
    capacity = max(s.max_length for s in seqs) + block + 1
    target_cache, draft_cache = target.new_cache(batch, capacity), draft.new_cache(batch, capacity)

    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    tokens = torch.zeros(batch, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    positions = torch.arange(width).expand(batch, -1)
    valid = positions < lengths[:, None]
    logits, taps = target.forward(tokens, positions, valid, target_cache)
    if block > 1:
        draft.inject(taps, positions, valid, draft_cache)
    last_logits = logits[torch.arange(batch), lengths - 1]
    if reference:
        first = pick_tokens(last_logits, sampling, generator)
    else:
        # The runtime's first uniform of a request (rand_data_sample, drawn when the request is set up).
        first = torch.cat(
            [
                sample_by_uniform(last_logits[b : b + 1], temperatures[b], torch.rand(1, generator=g))
                for b, g in enumerate(generators)
            ]
        )
    for seq, token in zip(seqs, first.tolist(), strict=True):
        seq.tokens.append(token)
        seq.stopped = bool(torch.isin(torch.tensor(token), stops))
    if progress is not None:
        progress(batch)

    offsets = torch.arange(block)
    while any(s.active for s in seqs):
        start = torch.tensor([s.start for s in seqs])
        # Finished sequences ride along verifying only their anchor; nothing of theirs is kept.
        verify = torch.tensor([min(block, s.max_length - s.start) if s.active else 1 for s in seqs])
        block_valid = offsets < verify[:, None]
        block_ids = torch.full((batch, block), draft.spec.mask_token_id, dtype=torch.long)
        block_ids[:, 0] = torch.tensor([s.tokens[-1] for s in seqs])
        draft_probs = None
        if block > 1:
            draft_logits = draft.logits(draft.forward(block_ids, start, block_valid, draft_cache)[:, 1:])
            if not reference:
                block_ids[:, 1:] = draft_logits.argmax(dim=-1)
            else:
                draft_probs = sampling_probs(draft_logits, sampling)
                block_ids[:, 1:] = torch.multinomial(
                    draft_probs.reshape(-1, draft_probs.shape[-1]), 1, generator=generator
                ).view(batch, block - 1)
        block_positions = start[:, None] + offsets
        logits, taps = target.forward(block_ids, block_positions, block_valid, target_cache)

        produced_mask = torch.zeros(batch, block, dtype=torch.bool)
        for b, seq in enumerate(seqs):
            if not seq.active:
                continue
            v = int(verify[b])
            drafts = block_ids[b, 1:v]
            if not reference:
                # The runtime hands the engine one uniform per verified position (rand_data_validation).
                uniforms = torch.rand(block, generator=generators[b])[:v]
                accepted, bonus = exact_match_accept(drafts, logits[b, :v], temperatures[b], uniforms)
            elif v > 1:
                assert draft_probs is not None  # v > 1 means block > 1, so the drafts were sampled above
                accepted, bonus = rejection_accept(
                    drafts, draft_probs[b, : v - 1], sampling_probs(logits[b, :v], sampling), generator
                )
            else:
                accepted, bonus = 0, int(pick_tokens(logits[b, 0], sampling, generator))
            new_tokens = drafts[:accepted].tolist() + [bonus]
            produced = min(accepted + 1, seq.max_length - seq.start - 1)
            for i, token in enumerate(new_tokens[:produced]):
                if token in stops:
                    produced, seq.stopped = i + 1, True
                    break
            produced_mask[b, :produced] = True
            seq.tokens.extend(new_tokens[:produced])
            seq.result.acceptance_lengths.append(produced)
            seq.result.steps.append(StepTrace(drafts.tolist(), accepted))
        if block > 1:
            draft.inject(taps, block_positions, produced_mask, draft_cache)
        if progress is not None:
            progress(int(produced_mask.sum()))

    for seq in seqs:
        seq.result.output_ids = seq.tokens[len(seq.result.input_ids) :]
    return [s.result for s in seqs]
