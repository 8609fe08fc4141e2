"""Both sampling methods of the golden loop reproduce the target's law exactly (enumeration on a tiny vocabulary),
and `dflash-trt generate` at T > 0 does so statistically, per sequence temperature and reproducibly per seed.

The enumerations drive the loop's own rules (`sample_by_uniform` / `exact_match_accept` for the engine method,
`sampling_probs` / `residual_distribution` for the reference method) on the golden model's real logits; the target
law is the product of the target's own conditionals, computed independently in float64.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from _exact_law import PROMPT, VOCAB, K, cells, draft_logits, small_pair, tempered
from scipy.stats import chisquare

from dflash_trt.cli import main
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import GoldenModel
from dflash_trt.reference.sampling import (
    SamplingParams,
    exact_match_accept,
    residual_distribution,
    sample_by_uniform,
    sampling_probs,
)
from dflash_trt.sampling_rules import REFERENCE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, GoldenModel]:
    return small_pair(tmp_path_factory)


def target_rows(model: GoldenModel, sequences: list[list[int]]) -> torch.Tensor:
    """Target logits after every token of each (equal-length) sequence, fresh cache: `[n, len, V]`."""
    tokens = torch.tensor(sequences)
    positions = torch.arange(tokens.shape[1]).expand(len(sequences), -1)
    cache = model.target.new_cache(len(sequences), tokens.shape[1] + 1)
    logits, _ = model.target.forward(tokens, positions, torch.ones_like(tokens, dtype=torch.bool), cache)
    return logits


def target_law(model: GoldenModel, length: int, temperature: float) -> dict[tuple[int, ...], float]:
    """P(continuation) = product of the target's tempered conditionals, for every continuation of `length`."""
    continuations = list(itertools.product(range(VOCAB), repeat=length))
    rows = target_rows(model, [PROMPT + list(c[:-1]) for c in continuations])[:, len(PROMPT) - 1 :]
    probs = tempered(rows, temperature)
    chosen = probs.gather(-1, torch.tensor(continuations)[:, :, None])[:, :, 0]
    return dict(zip(continuations, chosen.prod(dim=1).tolist(), strict=True))


def engine_law(model: GoldenModel, length: int, temperature: float, drafts_verified: int = K) -> dict:
    """Enumerate every uniform cell the engine rule can meet: argmax drafts, the first `drafts_verified` of them
    verified (a draft-length schedule's shorter draft), one sample per verified position."""
    k = drafts_verified
    law: dict[tuple[int, ...], float] = defaultdict(float)

    def step(prefix: list[int], weight: float) -> None:
        emitted = prefix[len(PROMPT) :]
        if len(emitted) == length:
            law[tuple(emitted)] += weight
            return
        drafts = draft_logits(model, prefix).argmax(dim=-1)[:k]
        rows = target_rows(model, [prefix + drafts.tolist()])[0, len(prefix) - 1 :]

        def walk(uniforms: list[float], weight: float) -> None:
            j = len(uniforms)
            for token, p, u in cells(tempered(rows[j], temperature)):
                if j < k and token == int(drafts[j]):
                    walk(uniforms + [u], weight * p)
                    continue
                padded = torch.tensor(uniforms + [u] + [0.5] * (k - j))
                accepted, bonus = exact_match_accept(drafts, rows, temperature, padded)
                assert (accepted, bonus) == (j, token)
                new = (drafts[:accepted].tolist() + [bonus])[: length - len(emitted)]
                step(prefix + new, weight * p)

        walk([], weight)

    first = target_rows(model, [PROMPT])[0, -1]
    for token, p, u in cells(tempered(first, temperature)):
        assert int(sample_by_uniform(first, temperature, torch.tensor(u))) == token
        step(PROMPT + [token], p)
    return law


def reference_law(model: GoldenModel, length: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Enumerate sampled drafts (independent per-position marginals), accept-with-min(1, p/q), residual resample."""
    law: dict[tuple[int, ...], float] = defaultdict(float)
    frontier = defaultdict(float)
    first = sampling_probs(target_rows(model, [PROMPT])[0, -1], params).double()
    for token in range(VOCAB):
        frontier[(token,)] += float(first[token])
    while frontier:
        emitted, weight = frontier.popitem()
        if len(emitted) == length:
            law[emitted] += weight
            continue
        prefix = PROMPT + list(emitted)
        q = sampling_probs(draft_logits(model, prefix), params).double()
        combos = list(itertools.product(range(VOCAB), repeat=K))
        p = sampling_probs(target_rows(model, [prefix + list(c) for c in combos])[:, len(prefix) - 1 :], params)
        p = p.double()
        for c, drafts in enumerate(combos):
            reach = weight * float(torch.prod(q[torch.arange(K), torch.tensor(drafts)]))
            for j in range(K + 1):
                if j == K:
                    outcome = p[c, K]
                else:
                    ratio = float(p[c, j, drafts[j]] / q[j, drafts[j]])
                    outcome = (1 - min(1.0, ratio)) * residual_distribution(p[c, j], q[j])
                for token in range(VOCAB):
                    new = (list(drafts[:j]) + [token])[: length - len(emitted)]
                    frontier[emitted + tuple(new)] += reach * float(outcome[token])
                if j < K:
                    reach *= min(1.0, float(p[c, j, drafts[j]] / q[j, drafts[j]]))
    return law


def assert_same_law(law: dict, expected: dict) -> None:
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-7)
    worst = max(abs(law.get(seq, 0.0) - p) for seq, p in expected.items())
    assert worst < 1e-6 and set(law) <= set(expected)


@pytest.mark.parametrize("temperature, drafts", [(0.6, K), (1.3, K), (0.6, 1), (1.3, 1)])
def test_engine_rule_reproduces_the_target_law_exactly(tiny, temperature, drafts):
    """At any draft length a schedule picks (here the full K and 1), exactly the target's law."""
    _, model = tiny
    law = engine_law(model, 3, temperature, drafts)
    assert_same_law(law, target_law(model, 3, temperature))


def test_reference_rule_reproduces_the_target_law_exactly(tiny):
    _, model = tiny
    params = SamplingParams(temperature=0.8, method=REFERENCE)
    law = reference_law(model, 3, params)
    expected = target_law(model, 3, 0.8)
    assert_same_law(law, expected)


def _generate(ckpt: Path, tmp_path: Path, capsys, prompts: list[list[int]], *flags: str) -> list[list[int]]:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    assert (
        main(["generate", "--checkpoint_dir", str(ckpt), "--input_file", str(path), "--ignore_eos", "--json", *flags])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {
        "sequences",
        "mean_acceptance_length",
        "per_position_acceptance",
        "per_position_rank_rates",
        "generated_tokens",
        "tokens_per_second",
    }
    return [s["output_ids"] for s in report["sequences"]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, temperature, schedule", [("engine", 0.7, "none"), ("reference", 1.0, "none"), ("engine", 0.7, "1:1")]
)
def test_generate_cli_samples_the_target_law(tiny, tmp_path, capsys, method, temperature, schedule):
    """Thousands of 2-token continuations of one prompt from `dflash-trt generate`, against the exact law (also
    with a draft-length schedule that verifies one draft per step)."""
    ckpt, model = tiny
    samples = 3000
    outputs = _generate(
        ckpt,
        tmp_path,
        capsys,
        [PROMPT] * samples,
        "--max_new_tokens",
        "2",
        "--temperature",
        str(temperature),
        "--seed",
        "11",
        "--sampling",
        method,
        "--draft_len_schedule",
        schedule,
    )
    counts = torch.zeros(VOCAB * VOCAB)
    for out in outputs:
        counts[out[0] * VOCAB + out[1]] += 1
    law = target_law(model, 2, temperature)
    expected = torch.tensor([law[(a, b)] for a in range(VOCAB) for b in range(VOCAB)]) * samples
    big = expected >= 5
    observed, wanted = counts[big], expected[big]
    if not big.all():  # cells too rare for the chi-square approximation are pooled
        observed = torch.cat([observed, counts[~big].sum()[None]])
        wanted = torch.cat([wanted, expected[~big].sum()[None]])
    assert chisquare(observed.numpy(), wanted.numpy() * samples / float(wanted.sum())).pvalue > 1e-3


def test_generate_is_reproducible_for_a_seed(tiny, tmp_path, capsys):
    ckpt, _ = tiny
    prompts = [PROMPT, [4, 4, 2, 6], PROMPT]
    args = ("--max_new_tokens", "10", "--temperature", "1.0")
    first = _generate(ckpt, tmp_path, capsys, prompts, *args, "--seed", "5")
    again = _generate(ckpt, tmp_path, capsys, prompts, *args, "--seed", "5")
    other = _generate(ckpt, tmp_path, capsys, prompts, *args, "--seed", "6")
    assert first == again and first != other
    assert first[0] != first[2]  # the same prompt twice in one batch draws from its own random stream


def test_mixed_temperatures_in_one_batch_equal_each_sequence_alone(tiny):
    _, model = tiny
    prompts = [PROMPT, [4, 4, 2, 6], [1, 2], [7, 6, 6, 6, 0]]
    temperatures = [0.0, 0.9, 0.0, 1.4]
    params = [SamplingParams(t) for t in temperatures]
    seeds = [21, 22, 23, 24]
    batched = speculative_generate(model, prompts, 9, sampling=params, seeds=seeds)
    for prompt, p, seed, result in zip(prompts, params, seeds, batched, strict=True):
        (alone,) = speculative_generate(model, [prompt], 9, sampling=p, seeds=[seed])
        assert (alone.output_ids, alone.acceptance_lengths) == (result.output_ids, result.acceptance_lengths)
    greedy = speculative_generate(model, [prompts[0], prompts[2]], 9)
    assert [batched[0].output_ids, batched[2].output_ids] == [g.output_ids for g in greedy]


def test_engine_method_refuses_what_the_engine_cannot_honour(tiny, tmp_path, capsys):
    ckpt, _ = tiny
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"input_ids": PROMPT}) + "\n")
    base = ["generate", "--checkpoint_dir", str(ckpt), "--input_file", str(path), "--temperature", "0.8"]
    assert main([*base, "--top_p", "0.9"]) == 2
    err = capsys.readouterr().err
    assert "top_p 0.9 refused" in err and "--sampling reference" in err
    assert main([*base, "--top_k", "5", "--sampling", "reference", "--max_new_tokens", "2"]) == 0
    capsys.readouterr()
    missing = ["generate", "--checkpoint_dir", str(tmp_path / "missing"), "--input_file", str(path)]
    assert main([*missing, "--temperature", "0.5", "--top_k", "3"]) == 2  # refused before anything is loaded
    assert "top_k 3 refused" in capsys.readouterr().err
