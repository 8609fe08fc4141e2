"""The engine's in-graph verification (dflash_trt/trtllm/verify.py) replayed op for op in torch on engine-shaped
inputs packed from a golden-model run: it must take the golden loop's decisions (accepted drafts, bonus token, first
token of a context request), per request greedy or sampled, in one mixed batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _pairs import PairVariant, make_pair

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import GoldenModel, load_golden_model
from dflash_trt.reference.sampling import SamplingParams, sample_by_uniform
from dflash_trt.trtllm.inverse_cdf import vocab_blocks

BLOCK = 4
K = BLOCK - 1


def first_reaching(cdf, mass, threshold):
    """verify._first_reaching: the first positive-mass entry whose cdf reaches the threshold, else the last one."""
    size = cdf.shape[1]
    candidate = (mass > 0).to(torch.int32) * (cdf >= threshold).to(torch.int32)
    first = -torch.where(candidate > 0, -torch.arange(size, dtype=torch.int32), torch.tensor(-size)).amax(1)
    last = torch.where(mass > 0, torch.arange(size, dtype=torch.int32), torch.tensor(-1, dtype=torch.int32)).amax(1)
    return torch.where(first < size, first, last).view(-1, 1)


def engine_sample_rows(rows, temperatures, uniforms, vocab_size):
    """The ops of verify.sample_rows in torch: two-level inverse CDF in fp32, argmax where the temperature is 0.
    (Block masses are summed by torch here and by a TensorRT reduce there: the same fp32 sums up to ordering.)"""
    padded = rows.shape[-1]
    if padded > vocab_size:
        rows = rows + torch.tensor([[0.0] * vocab_size + [-torch.inf] * (padded - vocab_size)])
    sampled = temperatures > 0.0
    inverse = 1.0 / torch.where(sampled, temperatures, torch.tensor([[1.0]]))
    weights = torch.exp((rows - rows.amax(1, keepdim=True)) * inverse)
    count, width = vocab_blocks(padded)
    weights = torch.cat([weights, torch.zeros(len(weights), count * width - padded)], dim=1)
    blocks = weights.view(-1, count, width)
    block_mass = blocks.sum(2)
    block_cdf = torch.cumsum(block_mass, 1)
    threshold = uniforms * block_cdf[:, count - 1 : count]
    block = first_reaching(block_cdf, block_mass, threshold)
    before = torch.gather(block_cdf - block_mass, 1, block.long())
    inside = torch.gather(blocks, 1, block.long().view(-1, 1, 1).expand(-1, 1, width)).view(-1, width)
    drawn = block * width + first_reaching(torch.cumsum(inside, 1), inside, threshold - before)
    return torch.where(sampled, drawn, rows.argmax(1, keepdim=True).to(torch.int32))


def engine_verify(logits, draft_tokens, draft_lens, temperature, rand_validation, rand_sample, vocab_size):
    """The ops of verify.verify_drafts (slot_logit_rows, then sample_rows), one for one in torch."""
    rows_per_request = draft_lens + 1
    offsets = torch.cumsum(rows_per_request, 0) - rows_per_request
    local = torch.minimum(torch.arange(K + 1)[None], draft_lens[:, None])
    rows = logits.index_select(0, (offsets[:, None] + local).reshape(-1))
    temperatures = temperature[:, None].expand(-1, K + 1).reshape(-1, 1)
    generation = (draft_lens > 0)[:, None].expand(-1, K + 1)
    uniforms = torch.where(generation, rand_validation, rand_sample[:, None].expand(-1, K + 1)).reshape(-1, 1)
    tokens = engine_sample_rows(rows, temperatures, uniforms, vocab_size).view(-1, K + 1)
    drafts = torch.cat([draft_tokens, torch.full((len(draft_lens), 1), -1, dtype=torch.int32)], dim=1)
    slots = torch.arange(K + 1)[None]
    kept = (tokens == drafts).to(torch.int32) * (slots < draft_lens[:, None]).to(torch.int32)
    negated = torch.where(kept > 0, torch.tensor([[-(K + 1)]]), -slots)
    return tokens, -negated.amax(1) + 1


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> GoldenModel:
    root: Path = tmp_path_factory.mktemp("replay")
    target_dir, draft_dir = make_pair(root, PairVariant(vocab=8, block_size=BLOCK, init_std=0.1, seed=5))
    convert_checkpoint(target_dir, draft_dir, root / "ckpt", dtype="float32")
    return load_golden_model(root / "ckpt")


def target_logits(model: GoldenModel, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens])
    positions = torch.arange(len(tokens))[None]
    cache = model.target.new_cache(1, len(tokens) + 1)
    logits, _ = model.target.forward(ids, positions, torch.ones_like(ids, dtype=torch.bool), cache)
    return logits[0]


def uniforms_of(seed: int, steps: int) -> tuple[float, list[torch.Tensor]]:
    """The golden loop's draws for one sequence: one for its first token, then BLOCK per verify step."""
    generator = torch.Generator().manual_seed(seed)
    first = float(torch.rand(1, generator=generator))
    return first, [torch.rand(BLOCK, generator=generator) for _ in range(steps)]


@pytest.mark.parametrize("padding", [0, 5])
def test_in_graph_verification_takes_the_golden_decisions(golden: GoldenModel, padding: int):
    prompts = [[3, 4, 5, 6, 7], [6, 0], [1, 2, 3, 4, 5, 6], [2, 7, 1]]
    temperatures = [0.8, 0.0, 1.1, 0.7]
    seeds = [101, 102, 103, 104]
    params = [SamplingParams(t) for t in temperatures]
    results = speculative_generate(golden, prompts, 24, sampling=params, seeds=seeds)
    vocab = golden.target.spec.vocab_size
    checked = accepted_seen = 0
    for step in range(1, 7):
        # Request 0 enters as a context request; the others are generation requests at `step`.
        rows, drafts, lens, temps, rand_validation, rand_sample, expect = [], [], [], [], [], [], []
        first_uniform, _ = uniforms_of(seeds[0], 0)
        rows.append(target_logits(golden, prompts[0])[-1:])
        drafts.append([-1] * K)  # the runtime fills a context request's draft tokens with -1
        lens.append(0)
        temps.append(temperatures[0])
        rand_validation.append([0.999] * (K + 1))  # stale: never read for a context request
        rand_sample.append(first_uniform)
        expect.append((0, results[0].output_ids[0]))
        for b in range(1, len(prompts)):
            res = results[b]
            if step >= len(res.steps) or len(res.steps[step].draft_ids) != K:
                continue  # finished, or a short last block
            trace = res.steps[step]
            tokens = res.input_ids + res.output_ids
            start = len(res.input_ids) + sum(res.acceptance_lengths[:step])
            rows.append(target_logits(golden, tokens[: start + 1] + trace.draft_ids)[start:])
            drafts.append(trace.draft_ids)
            lens.append(K)
            temps.append(temperatures[b])
            _, draws = uniforms_of(seeds[b], step + 1)
            rand_validation.append(draws[step].tolist())
            rand_sample.append(0.5)
            expect.append((trace.accepted, tokens[start + trace.accepted + 1]))
        logits = torch.cat(rows)
        if padding:  # tensor-parallel lm_head padding: large logits the engine must never pick
            logits = torch.cat([logits, torch.full((len(logits), padding), 50.0)], dim=1)
        tokens, num_accepted = engine_verify(
            logits,
            torch.tensor(drafts, dtype=torch.int32),
            torch.tensor(lens),
            torch.tensor(temps),
            torch.tensor(rand_validation),
            torch.tensor(rand_sample),
            vocab,
        )
        for b, (accepted, token) in enumerate(expect):
            assert int(num_accepted[b]) == accepted + 1, (step, b)
            assert int(tokens[b, accepted]) == token, (step, b)
            checked += 1
            accepted_seen += accepted
    assert checked >= 10 and accepted_seen > 0


def test_two_level_fp32_inverse_cdf_matches_the_float64_rule_on_a_real_vocabulary():
    """Qwen3's 151936 tokens, peaked and flat rows: the engine's fp32 sampler picks the golden float64 rule's token."""
    generator = torch.Generator().manual_seed(0)
    vocab, rows = 151936, 48
    logits = torch.randn(rows, vocab, generator=generator) * torch.linspace(0.5, 8.0, rows)[:, None]
    temperatures = torch.tensor([0.3, 0.7, 1.0, 1.6] * (rows // 4))[:, None]
    uniforms = torch.rand(rows, 1, generator=generator)
    engine = engine_sample_rows(logits, temperatures, uniforms, vocab)[:, 0]
    golden = torch.stack([sample_by_uniform(logits[i], float(temperatures[i]), uniforms[i, 0]) for i in range(rows)])
    assert engine.tolist() == golden.tolist()
