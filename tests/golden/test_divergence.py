"""The one tie-aware comparison (`reference/divergence.py`): the first divergence of each sequence, with the golden
model's top-2 logit margin measured against independent oracles (the HF transformers target, the `dflash` reference
drafter inside `dflash_generate`), labelled a near-tie only inside the checkpoint precision's resolution."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from _pairs import PairVariant, make_pair
from _reference import reference_run

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.formats import quantization_config, resolution
from dflash_trt.reference.decode import SequenceResult, StepTrace, speculative_generate
from dflash_trt.reference.divergence import Divergence, compare_decodings, failures
from dflash_trt.reference.model import GoldenModel, load_golden_model

PROMPT = [3, 4, 5, 6, 7]
MAX_NEW = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path, GoldenModel, SequenceResult]:
    root = tmp_path_factory.mktemp("divergence")
    target_dir, draft_dir = make_pair(root, PairVariant(block_size=4))
    convert_checkpoint(target_dir, draft_dir, root / "ckpt", dtype="float32")
    model = load_golden_model(root / "ckpt")
    golden = speculative_generate(model, [PROMPT], MAX_NEW)[0]
    return target_dir, draft_dir, model, golden


def _top2_margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits.double(), 2).values
    return float(top[0] - top[1])


def _copy(result: SequenceResult, **changes) -> SequenceResult:
    steps = [StepTrace(list(s.draft_ids), s.accepted) for s in result.steps]
    return dataclasses.replace(result, **{"steps": steps, **changes})


def test_identical_decodings_have_no_divergence(pair):
    _, _, model, golden = pair
    assert compare_decodings(model, [golden], [_copy(golden)], MAX_NEW) == []


def test_a_token_divergence_carries_the_targets_margin(pair):
    """The margin is the HF target's at the diverging position; far above float32's resolution: a failure."""
    from transformers import AutoModelForCausalLM

    target_dir, _, model, golden = pair
    j = 6
    tokens = list(golden.output_ids)
    tokens[j] = (tokens[j] + 1) % model.target.spec.vocab_size
    (divergence,) = compare_decodings(model, [golden], [_copy(golden, output_ids=tokens)], MAX_NEW)
    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + golden.output_ids[:j]])).logits[0, -1]
    assert divergence.margin == pytest.approx(_top2_margin(logits), abs=1e-4)
    assert divergence.margin > divergence.resolution and not divergence.near_tie
    assert failures([divergence]) == [divergence] and f"token {j}" in str(divergence) and "failure" in str(divergence)


def test_selftest_compares_the_engines_tokens_and_acceptance_tie_aware(pair):
    """`dflash-trt selftest` gets tokens and acceptance lengths (no drafts) from the engine."""
    from dflash_trt.commands.selftest import compare

    _, _, model, golden = pair
    same = compare(model, [golden], [golden.output_ids], [golden.acceptance_lengths], MAX_NEW)
    assert same == []
    tokens = [*golden.output_ids[:-1], (golden.output_ids[-1] + 1) % model.target.spec.vocab_size]
    (divergence,) = compare(model, [golden], [tokens], [golden.acceptance_lengths], MAX_NEW)
    assert f"token {MAX_NEW - 1}" in str(divergence) and divergence.margin is not None


def test_a_sampled_token_divergence_is_a_failure_without_margin(pair):
    _, _, model, golden = pair
    tokens = list(golden.output_ids)
    tokens[2] = (tokens[2] + 1) % model.target.spec.vocab_size
    (divergence,) = compare_decodings(model, [golden], [_copy(golden, output_ids=tokens)], MAX_NEW, [0.8])
    assert divergence.margin is None and not divergence.near_tie


def test_a_draft_divergence_carries_the_reference_drafters_margin(pair, monkeypatch):
    """The drafter's margin at the first differing slot equals the `dflash` reference drafter's inside
    `dflash_generate` at the same step."""
    import dflash.model as reference
    from transformers import AutoModelForCausalLM

    target_dir, draft_dir, model, golden = pair
    ref_draft = reference.DFlashDraftModel.from_pretrained(draft_dir).eval()
    margins = []
    original = ref_draft.compute_logits

    def recording(hidden, head):
        logits = original(hidden, head)
        if logits.shape[1]:
            margins.append([_top2_margin(row) for row in logits[0]])
        return logits

    monkeypatch.setattr(ref_draft, "compute_logits", recording)
    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tokens, acceptance, _ = reference_run(ref_draft, hf, PROMPT, MAX_NEW, [], monkeypatch)
    assert (tokens, acceptance) == (golden.output_ids, golden.acceptance_lengths)
    step, slot = 1, 1
    other = _copy(golden)
    other.steps[step].draft_ids[slot] = (other.steps[step].draft_ids[slot] + 1) % model.target.spec.vocab_size
    (divergence,) = compare_decodings(model, [golden], [other], MAX_NEW)
    assert f"step {step} draft {slot}" in str(divergence)
    assert divergence.margin == pytest.approx(margins[step][slot], abs=1e-4)


def test_acceptance_is_compared_on_full_blocks_and_may_be_clipped_at_the_end(tmp_path):
    """The embedded trained pair (long accepted stretches): a different split of the same tokens is a failure; the
    other's last step clipped by its budget, against a golden run K tokens further, is none."""
    from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir
    from dflash_trt.tokenizer import load_tokenizer

    convert_checkpoint(target_dir(), draft_dir(), tmp_path / "ckpt", dtype="float32")
    model = load_golden_model(tmp_path / "ckpt")
    prompt = load_tokenizer(tmp_path / "ckpt").encode(load_heldout(limit=1)[0].text)
    k = model.draft.spec.block_size - 1
    budget = 30
    longer = speculative_generate(model, [prompt], budget + k)[0]
    steps = next(n for n in range(1, len(longer.steps) + 1) if 1 + sum(longer.acceptance_lengths[:n]) >= budget)
    lengths = longer.acceptance_lengths[:steps]
    clipped = budget - 1 - sum(lengths[:-1])
    assert clipped < lengths[-1] and max(lengths) > 2  # the budget really clips a long accepted stretch
    other = SequenceResult(prompt, longer.output_ids[:budget], [*lengths[:-1], clipped], longer.steps[:steps])
    assert compare_decodings(model, [longer], [other], budget) == []
    split = [lengths[0] + 1, lengths[1] - 1, *lengths[2:-1], clipped]
    (divergence,) = compare_decodings(model, [longer], [_copy(other, acceptance_lengths=split)], budget)
    assert "step 0: acceptance length" in str(divergence) and divergence.margin is None


def test_near_tie_label_and_resolution_of_each_precision():
    assert Divergence(0, "x", margin=0.01, resolution=0.02).near_tie
    assert not Divergence(0, "x", margin=0.03, resolution=0.02).near_tie
    assert not Divergence(0, "x").near_tie
    assert "near-tie" in str(Divergence(0, "x", margin=0.01, resolution=0.02))
    plain = {"dtype": "float32", "quantization": quantization_config("none")}
    assert resolution(plain) == 4 * torch.finfo(torch.float32).eps
    assert resolution({**plain, "dtype": "bfloat16"}) == 4 * torch.finfo(torch.bfloat16).eps
    assert resolution({**plain, "dtype": "float16"}) == 4 * torch.finfo(torch.float16).eps
    assert (
        resolution({**plain, "quantization": quantization_config("none", "fp8")})
        == torch.finfo(torch.float8_e4m3fn).eps
    )
    drafter_nvfp4 = {**plain, "dflash_config": {"quantization": quantization_config("nvfp4")}}
    assert resolution(drafter_nvfp4) == 2.0**-1
