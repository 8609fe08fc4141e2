"""Sampling semantics vs the reference, exactness of the accept/resample rule, and an end-to-end chi-square test."""

from __future__ import annotations

import dflash.model as reference
import pytest
import torch
from _pairs import PairVariant, make_pair
from scipy.stats import chisquare

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.reference.sampling import SamplingParams, count_accepted, residual_distribution, sampling_probs


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.5, 0.8, 7)])
def test_sampling_probs_match_reference(temperature, top_p, top_k):
    logits = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(1)) * 3
    ours = sampling_probs(logits, SamplingParams(temperature, top_p, top_k))
    torch.testing.assert_close(ours, reference._sampling_probs(logits, temperature, top_p, top_k))


def test_bad_sampling_parameters_are_refused():
    for args in ((-1.0, 1.0, 0), (1.0, 0.0, 0), (1.0, 1.5, 0), (1.0, 1.0, -2)):
        with pytest.raises(DFlashTrtError):
            SamplingParams(*args)


def test_acceptance_threshold_is_p_over_q():
    p, q = torch.tensor([0.3]), torch.tensor([0.6])
    assert count_accepted(p, q, torch.tensor([0.4999])) == 1
    assert count_accepted(p, q, torch.tensor([0.5001])) == 0
    assert count_accepted(torch.tensor([0.9]), torch.tensor([0.2]), torch.tensor([0.9999])) == 1
    chain = count_accepted(torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0.4, 0.9, 0.1]), torch.tensor([0.1, 0.9, 0.0]))
    assert chain == 1  # the second draft fails, so the third is not counted even though it would pass


@pytest.mark.parametrize("seed", range(6))
def test_accept_then_resample_reproduces_target_exactly(seed):
    """Enumerate the draft token: P(out = x) = q(x)·min(1, p/q) + (1 - Σ_d q(d)·min(1, p(d)/q(d)))·residual(x)."""
    g = torch.Generator().manual_seed(seed)
    vocab = 7
    p = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 2, -1)
    if seed == 0:
        q = p.clone()  # identical distributions: always accept, residual empty
    # count_accepted keeps draft d exactly when u < p(d)/q(d): probability min(1, p/q) for u ~ U[0, 1).
    for d in range(vocab):
        ratio = float(p[d] / q[d])
        if ratio < 1:
            assert count_accepted(p[d : d + 1], q[d : d + 1], torch.tensor([ratio * (1 - 1e-9)], dtype=p.dtype)) == 1
            assert count_accepted(p[d : d + 1], q[d : d + 1], torch.tensor([ratio * (1 + 1e-9)], dtype=p.dtype)) == 0
    accept_prob = torch.minimum(torch.ones_like(p), p / q)
    output = q * accept_prob + (1 - (q * accept_prob).sum()) * residual_distribution(p, q)
    torch.testing.assert_close(output, p, rtol=0, atol=1e-12)


def test_end_to_end_sampling_matches_target_distribution(tmp_path):
    """Two speculative tokens sampled at T=1 many times: their joint law equals the target's, by chi-square."""
    variant = PairVariant(vocab=12, block_size=4, init_std=0.15, taps=[1, 3], seed=3)
    target_dir, draft_dir = make_pair(tmp_path, variant)
    convert_checkpoint(target_dir, draft_dir, tmp_path / "ckpt", dtype="float32")
    model = load_golden_model(tmp_path / "ckpt")
    prompt, samples = [3, 5, 7], 3000
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
    results = speculative_generate(model, [prompt] * samples, 3, None, params, seed=11)
    assert {len(r.output_ids) for r in results} == {3}
    assert any(r.steps[0].accepted > 0 for r in results) and any(r.steps[0].accepted == 0 for r in results)
    vocab = variant.vocab
    # Token 1 comes from the prefill; tokens 2 and 3 pass through draft, accept and resample. Condition on token 1.
    expected = torch.zeros(vocab, vocab)
    first = torch.tensor([r.output_ids[0] for r in results])
    for t1 in first.unique().tolist():
        weight = int((first == t1).sum())
        cache = model.target.new_cache(vocab, 8)
        seqs = torch.tensor([prompt + [t1, t2] for t2 in range(vocab)])
        positions = torch.arange(seqs.shape[1]).expand(vocab, -1)
        logits, _ = model.target.forward(seqs, positions, torch.ones_like(seqs, dtype=torch.bool), cache)
        p2 = torch.softmax(logits[0, -2], -1)
        p3 = torch.softmax(logits[:, -1], -1)
        expected += weight * p2[:, None] * p3
    counts = torch.zeros(vocab, vocab)
    for r in results:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    counts = torch.zeros(vocab, vocab)
    for r in results:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    big = expected.flatten() >= 5
    observed = torch.cat([counts.flatten()[big], counts.flatten()[~big].sum()[None]])
    wanted = torch.cat([expected.flatten()[big], expected.flatten()[~big].sum()[None]])
    assert chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue > 1e-3


def test_inverse_cdf_sampling_boundaries_by_hand():
    """Probabilities 0.2 / 0.5 / 0.3: token 0 below u = 0.2, token 1 up to 0.7, token 2 above; T = 0 is argmax."""
    from dflash_trt.reference.sampling import sample_by_uniform

    logits = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    picks = [int(sample_by_uniform(logits, 1.0, torch.tensor(u))) for u in (0.01, 0.19, 0.21, 0.69, 0.71, 1.0)]
    assert picks == [0, 0, 1, 1, 2, 2]
    assert int(sample_by_uniform(logits, 0.0, torch.tensor(0.01))) == 1
    # T = 2 flattens to softmax(log p / 2) ∝ sqrt(p): 0.4472 / 0.7071 / 0.5477 -> cumulative 0.2626, 0.6780.
    picks = [int(sample_by_uniform(logits, 2.0, torch.tensor(u))) for u in (0.26, 0.27, 0.67, 0.68)]
    assert picks == [0, 1, 1, 2]


def test_exact_match_accept_stops_at_the_first_mismatching_sample():
    from dflash_trt.reference.sampling import exact_match_accept

    logits = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]))
    drafts = torch.tensor([1, 0])
    # u < 0.5 samples token 0, u >= 0.5 token 1.
    assert exact_match_accept(drafts, logits, 1.0, torch.tensor([0.9, 0.1, 0.7])) == (2, 1)
    assert exact_match_accept(drafts, logits, 1.0, torch.tensor([0.9, 0.6, 0.1])) == (1, 1)
    assert exact_match_accept(drafts, logits, 1.0, torch.tensor([0.2, 0.1, 0.1])) == (0, 0)
