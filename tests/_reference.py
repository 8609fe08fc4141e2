"""The `dflash` reference run of one prompt, and the check that the golden model decodes exactly like it: the
independent oracle of the parity tests for dense and mixture-of-experts targets alike."""

from __future__ import annotations

import time

import dflash.model as reference
import torch

from dflash_trt.reference.decode import speculative_generate


def reference_run(ref_draft, hf_target, prompt, max_new, stop_ids, monkeypatch):
    """dflash_generate with its CUDA timer swapped for a CPU clock, recording the drafted tokens of each step."""
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    drafts = []
    # A DFlash2 drafter's drafts are its selector's chain (`propose`), a v1 drafter's the argmax of its logits.
    chooser = "propose" if isinstance(ref_draft, reference.DFlash2DraftModel) else "compute_logits"
    original = getattr(ref_draft, chooser)

    def recording(*args):
        chosen = original(*args)
        drafts.append((chosen[0] if chooser == "propose" else chosen.argmax(-1))[0].tolist())
        return chosen

    monkeypatch.setattr(ref_draft, chooser, recording)
    stats = reference.dflash_generate(
        ref_draft, hf_target, torch.tensor([prompt]), max_new, stop_ids, return_stats=True
    )
    monkeypatch.setattr(ref_draft, chooser, original)
    return stats.output_ids[0, len(prompt) :].tolist(), stats.acceptance_lengths, drafts


def assert_matches_dflash_generate(golden, hf_target, ref_draft, prompts, max_new, stops, monkeypatch) -> None:
    """Tokens, acceptance lengths and per-step drafts of our batched loop equal `dflash_generate`'s, prompt by
    prompt."""
    ours = speculative_generate(golden, prompts, max_new, stops)
    for prompt, result in zip(prompts, ours, strict=True):
        tokens, acceptance, drafts = reference_run(ref_draft, hf_target, prompt, max_new, stops, monkeypatch)
        assert result.output_ids == tokens
        assert result.acceptance_lengths == acceptance
        assert [step.draft_ids for step in result.steps] == [d for d in drafts if d]
