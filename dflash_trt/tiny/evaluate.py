"""Held-out metrics of the tiny pair: target greedy accuracy and DFlash acceptance length.

Acceptance goes through the reference `dflash.model.dflash_generate`; its statistics path calls
`torch.cuda.synchronize`, so on a CPU the timer it uses is swapped for a plain one while measuring.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import dflash.model
import torch
from dflash.model import DFlashDraftModel, dflash_generate
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from dflash_trt.tiny.heldout import HeldoutPrompt, is_correct

MAX_NEW_TOKENS = 64


@contextlib.contextmanager
def cpu_timer() -> Iterator[None]:
    """Let `dflash_generate(return_stats=True)` time itself without CUDA."""
    original = dflash.model._cuda_time
    dflash.model._cuda_time = time.perf_counter
    try:
        yield
    finally:
        dflash.model._cuda_time = original


def _prompt_ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def greedy_token_ids(
    target: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[HeldoutPrompt],
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[list[int]]:
    """Target-only greedy continuations (EOS included when reached), batched by prompt length so no padding."""
    by_length: dict[int, list[int]] = {}
    encoded = [_prompt_ids(tokenizer, p.text) for p in prompts]
    for index, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(index)
    results: list[list[int]] = [[] for _ in prompts]
    eos = tokenizer.eos_token_id
    for length, indices in by_length.items():
        batch = torch.tensor([encoded[i] for i in indices])
        out = target.generate(  # type: ignore[misc]  # transformers 5 types `self` as a protocol Qwen3 misses
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        for row, index in enumerate(indices):
            tokens = out[row, length:].tolist()
            results[index] = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
    return results


def greedy_accuracy(
    target: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: list[HeldoutPrompt]
) -> float:
    completions = greedy_token_ids(target, tokenizer, prompts)
    hits = sum(
        is_correct(str(tokenizer.decode(ids, skip_special_tokens=True)), p.answer)
        for ids, p in zip(completions, prompts, strict=True)
    )
    return hits / len(prompts)


@dataclass(frozen=True)
class SpeculativeRun:
    new_token_ids: list[int]
    acceptance_lengths: list[int]


@torch.inference_mode()
def speculative_runs(
    draft: DFlashDraftModel,
    target: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[HeldoutPrompt],
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[SpeculativeRun]:
    """One reference `dflash_generate` call per prompt at T=0, stopping at EOS."""
    runs = []
    with cpu_timer():
        for prompt in prompts:
            input_ids = torch.tensor([_prompt_ids(tokenizer, prompt.text)])
            stats = dflash_generate(
                draft, target, input_ids, max_new_tokens, [tokenizer.eos_token_id], return_stats=True
            )
            runs.append(
                SpeculativeRun(
                    new_token_ids=stats.output_ids[0, input_ids.shape[1] :].tolist(),
                    acceptance_lengths=list(stats.acceptance_lengths),
                )
            )
    return runs


def per_prompt_mean_acceptance_length(runs: list[SpeculativeRun]) -> float:
    """Tokens per verification step (bonus included, at most block_size): mean over prompts of each
    prompt's mean, the convention of the reference benchmark."""
    per_prompt = [sum(r.acceptance_lengths) / len(r.acceptance_lengths) for r in runs if r.acceptance_lengths]
    return sum(per_prompt) / len(per_prompt)
