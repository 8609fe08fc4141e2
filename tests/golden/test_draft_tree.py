"""Draft trees in the golden loop (reference/tree.py): the tree holds the most likely continuations (checked against
every tree a brute force can build), greedy decoding under trees is the target's own greedy decoding (HF), and the
tree rule reproduces the target's law exactly at T > 0 (enumeration over every uniform cell, as for the chain) and
statistically from `dflash-trt generate --draft_tree`.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _exact_law import PROMPT, VOCAB, K, cells, draft_logits, small_pair, tempered
from _pairs import PairVariant, make_pair
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from dflash_trt.cli import main
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.draft_schedule import DraftLenSchedule
from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import GoldenModel, load_golden_model
from dflash_trt.reference.sampling import SamplingParams, sample_by_uniform
from dflash_trt.reference.stats import per_position_acceptance, per_position_rank_rates
from dflash_trt.reference.tree import DraftTree, best_tree, budget_tree, expected_accepted, log_probs, tree_accept
from dflash_trt.sampling_rules import REFERENCE
from dflash_trt.tiny.heldout import load_heldout
from dflash_trt.tokenizer import load_tokenizer


def brute_force_best(probs: torch.Tensor, budget: int) -> float:
    """The largest sum of continuation probabilities over every prefix-closed set of at most `budget` nodes."""
    depth, vocab = probs.shape
    best = 0.0

    def grow(frontier: list[tuple[tuple[int, ...], float]], chosen: int, total: float) -> None:
        nonlocal best
        best = max(best, total)
        if chosen == budget:
            return
        for i, (prefix, p) in enumerate(frontier):
            # Add `prefix` (a child of a chosen node); later frontier entries only, so each set is built once.
            deeper = len(prefix) < depth
            children = [(prefix + (t,), p * float(probs[len(prefix), t])) for t in range(vocab)] if deeper else []
            grow(frontier[i + 1 :] + children, chosen + 1, total + p)

    grow([((t,), float(probs[0, t])) for t in range(vocab)], 0, 0.0)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_best_tree_holds_the_most_likely_continuations(seed):
    """Against every prefix-closed tree of up to 5 nodes over 3 tokens and 3 positions."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 3, generator=generator) * (1 + seed)
    logprobs = log_probs(logits)
    for budget in range(1, 6):
        tree = best_tree(logprobs, budget)
        assert tree.size == budget
        for node in range(1, tree.size + 1):  # siblings distinct, parents before children
            siblings = [tree.tokens[c - 1] for c in tree.children(tree.parents[node - 1])]
            assert len(siblings) == len(set(siblings))
        value = expected_accepted(tree, logprobs)
        assert value == pytest.approx(brute_force_best(logprobs.double().exp(), budget), rel=1e-6)


def test_best_tree_breaks_ties_toward_parents_and_lower_ids():
    """Equal scores (a certain draft, equal logits) keep the tree prefix-closed and follow the stated order."""
    logits = torch.tensor([[0.0, 0.0, -50.0], [80.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    tree = best_tree(log_probs(logits), 4)
    # depth 1 ties between tokens 0 and 1 (lower id first); depth 2 is certain: token 0 under each, equal scores.
    assert tree.tokens == (0, 1, 0, 0) and tree.parents == (0, 0, 1, 2)
    assert tree.depths() == [0, 1, 1, 2, 2]


def test_best_tree_maps_a_reduced_vocabulary_to_target_ids():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    ids = torch.tensor([[40, 7, 19], [40, 7, 19]])
    tree = best_tree(log_probs(logits), 3, ids)
    plain = best_tree(log_probs(logits), 3)
    assert tree.parents == plain.parents
    assert tree.tokens == tuple(int(ids[0, t]) for t in plain.tokens)
    assert expected_accepted(tree, log_probs(logits), ids) == pytest.approx(expected_accepted(plain, log_probs(logits)))


def test_tree_accept_walks_to_the_child_holding_the_target_token():
    tree = DraftTree(tokens=(4, 2, 6, 1, 3), parents=(0, 0, 1, 1, 2))  # 4 -> {6, 1}, 2 -> {3}
    logits = torch.full((6, 8), -10.0)
    for node, token in enumerate([2, 6, 3, 5, 0, 7]):  # the target's argmax at nodes 0..5
        logits[node, token] = 10.0
    path, bonus = tree_accept(tree, logits, 0.0, torch.full((6,), 0.5))
    assert (path, bonus) == ([0, 2, 5], 7)
    logits[0] = -10.0
    logits[0, 0] = 10.0  # no child of the anchor holds 0: nothing accepted, 0 is the bonus
    assert tree_accept(tree, logits, 0.0, torch.full((6,), 0.5)) == ([0], 0)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, GoldenModel]:
    return small_pair(tmp_path_factory)


def last_target_row(model: GoldenModel, tokens: list[int]) -> torch.Tensor:
    """The target's logits after `tokens` (fresh cache)."""
    ids = torch.tensor([tokens])
    positions = torch.arange(len(tokens))[None]
    cache = model.target.new_cache(1, len(tokens) + 1)
    logits, _ = model.target.forward(ids, positions, torch.ones_like(ids, dtype=torch.bool), cache)
    return logits[0, -1]


def target_law(model: GoldenModel, length: int, temperature: float) -> dict[tuple[int, ...], float]:
    """P(continuation) = product of the target's tempered conditionals, in float64."""
    law = {}
    for continuation in itertools.product(range(VOCAB), repeat=length):
        p = 1.0
        for i, token in enumerate(continuation):
            p *= float(tempered(last_target_row(model, PROMPT + list(continuation[:i])), temperature)[token])
        law[continuation] = p
    return law


def tree_law(
    model: GoldenModel, length: int, temperature: float, budget: Callable[[int], int]
) -> dict[tuple[int, ...], float]:
    """Enumerate every uniform cell the tree rule can meet: the draft of `budget(emitted)` nodes a tree engine
    verifies after `emitted` tokens (`budget_tree`: the best tree past the block's K drafts, else the chain), one
    draw per visited node, descent to the child holding it."""
    law: dict[tuple[int, ...], float] = defaultdict(float)

    def step(prefix: list[int], weight: float) -> None:
        emitted = prefix[len(PROMPT) :]
        if len(emitted) == length:
            law[tuple(emitted)] += weight
            return
        tree = budget_tree(log_probs(draft_logits(model, prefix)), budget(len(emitted)), positions=K)
        rows = torch.stack([last_target_row(model, prefix + [tree.tokens[n - 1] for n in tree.path(node)[1:]])
                            for node in range(tree.size + 1)])  # fmt: skip

        def walk(node: int, uniforms: dict[int, float], weight: float) -> None:
            for token, p, u in cells(tempered(rows[node], temperature)):
                child = next((c for c in tree.children(node) if tree.tokens[c - 1] == token), None)
                drawn = {**uniforms, node: u}
                if child is not None:
                    walk(child, drawn, weight * p)
                    continue
                vector = torch.tensor([drawn.get(i, 0.5) for i in range(tree.size + 1)])
                path, bonus = tree_accept(tree, rows, temperature, vector)
                assert (path, bonus) == (tree.path(node), token)
                new = ([tree.tokens[n - 1] for n in path[1:]] + [bonus])[: length - len(emitted)]
                step(prefix + new, weight * p)

        walk(0, {}, weight)

    first = last_target_row(model, PROMPT)
    for token, p, u in cells(tempered(first, temperature)):
        assert int(sample_by_uniform(first, temperature, torch.tensor(u))) == token
        step(PROMPT + [token], p)
    return law


@pytest.mark.parametrize(
    "temperature, budget",
    [(0.6, lambda emitted: 4), (1.3, lambda emitted: 7), (0.9, lambda emitted: (5, 1, 2)[emitted % 3])],
    ids=["4-nodes", "7-nodes", "budget-moving-tree-chain"],
)
def test_tree_rule_reproduces_the_target_law_exactly(small, temperature, budget):
    """Also when the budget moves from step to step (a schedule under a moving load): a tree of 5 nodes, the
    chain of 1 draft, the chain of K = 2, depending on how many tokens came before."""
    _, model = small
    law = tree_law(model, 3, temperature, budget)
    expected = target_law(model, 3, temperature)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-7)
    assert set(law) <= set(expected)
    assert max(abs(law.get(seq, 0.0) - p) for seq, p in expected.items()) < 1e-6


RAGGED = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15], [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26], [27, 28]]


@pytest.fixture(scope="module", params=["qwen3", "llama-block6"])
def hf_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    variant = (
        PairVariant()
        if request.param == "qwen3"
        else PairVariant(arch="llama", tie=True, draft_layers=2, block_size=6, init_std=0.4)
    )
    target_dir, draft_dir = make_pair(root, variant)
    convert_checkpoint(target_dir, draft_dir, root / "ckpt", dtype="float32")
    return load_golden_model(root / "ckpt"), AutoModelForCausalLM.from_pretrained(target_dir).eval()


def _hf_greedy(model, prompt, max_new):
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("budget", [12, 31])
def test_greedy_trees_equal_the_target_alone(hf_pair, budget):
    model, hf = hf_pair
    max_new = [30, 17, 1, 25, 9]
    batched = speculative_generate(model, RAGGED, max_new, draft_tree=budget)
    for prompt, n, result in zip(RAGGED, max_new, batched, strict=True):
        assert result.output_ids == _hf_greedy(hf, prompt, n)
        (alone,) = speculative_generate(model, [prompt], n, draft_tree=budget)
        assert (alone.output_ids, alone.acceptance_lengths) == (result.output_ids, result.acceptance_lengths)
        for step in result.steps:
            assert step.parents is not None and len(step.draft_ids) <= budget
            tree = DraftTree(tuple(step.draft_ids), tuple(step.parents))
            assert tree.depth <= model.draft.spec.num_drafts


def test_trees_accept_at_least_the_chain_on_a_trained_pair(tiny):
    """The embedded trained pair, greedy: the same tokens in no more verify steps."""
    model = load_golden_model(tiny)
    tokenizer = load_tokenizer(tiny)
    prompts = [tokenizer.encode(p.text) for p in load_heldout(limit=4)]
    chain = speculative_generate(model, prompts, 40)
    tree = speculative_generate(model, prompts, 40, draft_tree=48)
    assert [r.output_ids for r in tree] == [r.output_ids for r in chain]
    steps = lambda results: sum(len(r.acceptance_lengths) for r in results)  # noqa: E731
    assert steps(tree) <= steps(chain)
    rates = per_position_acceptance(tree, model.draft.spec.num_drafts)
    assert rates[0] is not None and 0 < rates[0] <= 1


def test_mixed_temperatures_under_trees_equal_each_sequence_alone(small):
    _, model = small
    prompts = [PROMPT, [4, 4, 2, 6], [1, 2], [7, 6, 6, 6, 0]]
    params = [SamplingParams(t) for t in [0.0, 0.9, 0.0, 1.4]]
    seeds = [21, 22, 23, 24]
    batched = speculative_generate(model, prompts, 9, sampling=params, seeds=seeds, draft_tree=6)
    for prompt, p, seed, result in zip(prompts, params, seeds, batched, strict=True):
        (alone,) = speculative_generate(model, [prompt], 9, sampling=p, seeds=[seed], draft_tree=6)
        assert (alone.output_ids, alone.acceptance_lengths) == (result.output_ids, result.acceptance_lengths)


def test_tree_budgets_the_loop_refuses(small):
    _, model = small
    with pytest.raises(DFlashTrtError, match="at least the chain"):
        speculative_generate(model, [PROMPT], 4, draft_tree=K - 1)
    with pytest.raises(DFlashTrtError, match="engine's sampling method"):
        speculative_generate(model, [PROMPT], 4, sampling=SamplingParams(0.8, method=REFERENCE), draft_tree=K + 3)
    chain = speculative_generate(model, [PROMPT], 6)
    same = speculative_generate(model, [PROMPT], 6, draft_tree=K)
    assert [s.parents for s in same[0].steps] == [None] * len(same[0].steps)
    assert same[0].output_ids == chain[0].output_ids


def _generate(ckpt: Path, tmp_path: Path, capsys, prompts: list[list[int]], *flags: str) -> dict:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    argv = ["generate", "--checkpoint_dir", str(ckpt), "--input_file", str(path), "--ignore_eos", "--json", *flags]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_generate_cli_samples_the_target_law_under_trees(small, tmp_path, capsys):
    """Thousands of 2-token continuations from `dflash-trt generate --draft_tree`, against the exact law."""
    ckpt, model = small
    samples, temperature = 3000, 0.7
    flags = ("--max_new_tokens", "2", "--temperature", str(temperature), "--seed", "17", "--draft_tree", "9")
    report = _generate(ckpt, tmp_path, capsys, [PROMPT] * samples, *flags)
    counts = torch.zeros(VOCAB * VOCAB)
    for sequence in report["sequences"]:
        counts[sequence["output_ids"][0] * VOCAB + sequence["output_ids"][1]] += 1
    law = target_law(model, 2, temperature)
    expected = torch.tensor([law[(a, b)] for a in range(VOCAB) for b in range(VOCAB)]) * samples
    big = expected >= 5
    observed, wanted = counts[big], expected[big]
    if not big.all():
        observed = torch.cat([observed, counts[~big].sum()[None]])
        wanted = torch.cat([wanted, expected[~big].sum()[None]])
    assert chisquare(observed.numpy(), wanted.numpy() * samples / float(wanted.sum())).pvalue > 1e-3


def test_rank_rates_extend_the_chain_acceptance(tiny):
    """Greedy chain runs of the trained pair: the target's token is the drafter's best at a position exactly as
    often as the chain's verification accepted the draft there, and the other ranks share what is left."""
    model = load_golden_model(tiny)
    tokenizer = load_tokenizer(tiny)
    results = speculative_generate(model, [tokenizer.encode(p.text) for p in load_heldout(limit=6)], 48)
    k = model.draft.spec.num_drafts
    rates = per_position_rank_rates(results, k, 4)
    steps = [s for r in results for s in r.steps]
    for position, row in enumerate(rates):
        reached = [s for s in steps if s.accepted >= position and len(s.draft_ids) > position]
        if not reached:
            break
        accepted = sum(s.accepted > position for s in reached) / len(reached)
        assert row[0] == pytest.approx(accepted, abs=1e-9), position
        assert sum(row) <= 1.0 + 1e-9
    assert any(row[1] > 0 for row in rates)  # the drafter's second choice is the target's token at times


def test_a_block_of_one_drafts_nothing_and_ranks_nothing(tiny):
    """Plain autoregressive decoding (block 1) goes through the same loop: no draft position, no rank recorded, the
    chain's tokens."""
    model = load_golden_model(tiny)
    tokenizer = load_tokenizer(tiny)
    prompts = [tokenizer.encode(p.text) for p in load_heldout(limit=2)]
    alone = speculative_generate(model, prompts, 12, block_size=1)
    assert all(step.ranks == [] and step.draft_ids == [] for r in alone for step in r.steps)
    assert [r.output_ids for r in alone] == [r.output_ids for r in speculative_generate(model, prompts, 12)]


def test_greedy_trees_under_a_schedule_equal_the_target_alone(hf_pair):
    """Five ragged requests finishing one after another: the load falls from 5 to 1 and the node budget rises from
    a chain of 1 draft through the chain of K to trees; every sequence is still the target's own greedy decoding."""
    model, hf = hf_pair
    k = model.draft.spec.num_drafts
    schedule = DraftLenSchedule(((1, k + 9), (3, k), (5, 1)))
    max_new = [30, 17, 1, 25, 9]
    batched = speculative_generate(model, RAGGED, max_new, draft_tree=k + 9, draft_len_schedule=schedule)
    for prompt, n, result in zip(RAGGED, max_new, batched, strict=True):
        assert result.output_ids == _hf_greedy(hf, prompt, n)
    steps = [step for r in batched for step in r.steps]
    assert {len(s.draft_ids) for s in steps if s.parents == list(range(len(s.draft_ids)))} >= {1, k}
    assert any(s.parents != list(range(len(s.draft_ids))) and len(s.draft_ids) == k + 9 for s in steps)


def test_a_trees_schedule_counts_nodes(tiny):
    """The schedule's values on a tree engine are node budgets, bounded by its nodes (not by the block)."""
    model = load_golden_model(tiny)
    (tree,) = speculative_generate(
        model, [[3, 4, 5]], 4, draft_tree=24, draft_len_schedule=DraftLenSchedule(((1, 20),))
    )
    assert tree.steps[0].parents != list(range(20)) and len(tree.steps[0].draft_ids) == 20
    with pytest.raises(DFlashTrtError, match="verifies 25 drafts per request but the engine verifies at most 24"):
        speculative_generate(model, [[3, 4, 5]], 4, draft_tree=24, draft_len_schedule=DraftLenSchedule(((2, 25),)))
