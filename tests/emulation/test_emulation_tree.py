"""Draft trees through the engine network under the emulated TensorRT-LLM 1.2.x and EAGLE runtime (docs/engine.md
§6.1): the network drafts each request's tree and emits it in the EAGLE layout, the runtime derives the next step's
generation length, position offsets and packed mask from the emitted paths and rewinds the K/V along the accepted
row, and the result equals the golden tree loop (`speculative_generate(..., draft_tree=N)`) token for token, tree for
tree (nodes and parents) and in acceptance lengths.

The golden loop is the independent side: it builds its trees with `reference/tree.py`, verifies them with its own
tree attention and moves its own caches. The trained tiny pair accepts long paths, so its accepted paths leave the
chain (a node deeper than its index) and the rewind has something to move: the tests check it did, and that a
runtime without the rewind, or a network that does not write the moved nodes' drafter context where the rewind
takes it from, is caught. On B200 / B300 the target verifies the tree on DFlashAttention's stand-in, which reads the
runtime's packed tree mask and position offsets as the kernel does: the same equalities hold there (greedy, sampled,
TP 2, the CLI, random pairs, NVFP4 weights with an FP8 KV cache), and a plugin ignoring the mask or the offsets is
caught.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from _emulation import PROMPTS, STOP, convert, divergences
from _pairs import PairVariant

import dflash_trt.executors.emulated as emulated_executor
from dflash_trt import cli
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.paths import path_geometry, rewind_moves
from dflash_trt.emulation.plugins import AttentionPlugin
from dflash_trt.emulation.stand_ins import load_engine_module
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.emulated import decode_batch
from dflash_trt.gpu_targets import ASSUMED_GPU
from dflash_trt.reference.decode import SequenceResult, speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.reference.sampling import SamplingParams
from dflash_trt.sampling_rules import Sampling
from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir
from dflash_trt.tokenizer import load_tokenizer

NEW_TOKENS = 24
SEEDS = [40, 41, 42]


@pytest.fixture(scope="module")
def heldout(tiny: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny)
    return [tokenizer.encode(p.text) for p in load_heldout(limit=len(SEEDS))]


def _golden(tiny: Path, prompts: list[list[int]], nodes: int, temperatures: list[float]) -> list[SequenceResult]:
    """The golden tree loop with K more tokens, so that it verifies a full tree wherever the engine does."""
    model = load_golden_model(tiny)
    sampling = [SamplingParams(t) for t in temperatures]
    budget = NEW_TOKENS + model.draft.spec.num_drafts
    seeds = SEEDS[: len(prompts)]
    return speculative_generate(model, prompts, budget, sampling=sampling, seeds=seeds, draft_tree=nodes)


def _emulated(
    ckpt: Path, prompts: list[list[int]], nodes: int, temperatures: list[float], gpu: str = ASSUMED_GPU
) -> list[SequenceResult]:
    """Two batch slots for three requests: the third joins a slot the first left, with its stale uniforms."""
    engine = EmulatedEngine(ckpt, max_batch_size=2, draft_tree=nodes, gpu=gpu)
    sampling = [Sampling(temperature=t, seed=s) for t, s in zip(temperatures, SEEDS, strict=False)]
    return decode_batch(engine, prompts, NEW_TOKENS, sampling=sampling)


def _count_rewinds(monkeypatch) -> list[bool]:
    """Records, per verified step, whether the runtime's rewind moved anything (an accepted node off the chain)."""
    moved: list[bool] = []
    original = emulated_executor.rewind_moves

    def spy(paths, best_row, accepted):
        sources, targets = original(paths, best_row, accepted)
        moved.append(sources != targets)
        return sources, targets

    monkeypatch.setattr(emulated_executor, "rewind_moves", spy)
    return moved


def test_the_runtime_geometry_of_a_tree_and_of_a_shortened_chain():
    """Hand-derived: nodes 1 and 2 are the anchor's children, 3 is 1's child and 4 is 3's; node i's row is its path.
    A node sees itself and its ancestors at offsets equal to its depth; the rewind after accepting 3 tokens along
    row 4 (nodes 1, 3) moves slot 3 to 2 (slot 1 stays). A chain whose paths hold 4 drafts but that drafts 2 verifies
    3 nodes."""
    tree = [[0, -1, -1, -1], [0, 1, -1, -1], [0, 2, -1, -1], [0, 1, 3, -1], [0, 1, 3, 4]]
    depth, sees = path_geometry(tree, 5)
    assert depth == [0, 1, 1, 2, 3]
    visible = [[j for j, seen in enumerate(row) if seen] for row in sees]
    assert visible == [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 3, 4]]
    assert rewind_moves(tree, 4, 3) == ([1, 3], [1, 2])
    chain = [[0, 1, 2, 3, 4], *[[-1] * 5] * 4]
    depth, sees = path_geometry(chain, 3)
    assert depth == [0, 1, 2] and sees == [[True, False, False], [True, True, False], [True, True, True]]


@pytest.mark.parametrize(
    ("nodes", "temperatures"),
    [(24, [0.0, 0.0]), (40, [0.8, 0.0, 1.0])],
    ids=["greedy-24-nodes", "mixed-temperatures-40-nodes"],
)
def test_tree_engine_equals_the_golden_tree_loop(tiny, heldout, monkeypatch, nodes, temperatures):
    prompts = heldout[: len(temperatures)]
    moved = _count_rewinds(monkeypatch)
    emulated = _emulated(tiny, prompts, nodes, temperatures)
    golden = _golden(tiny, prompts, nodes, temperatures)
    assert divergences(tiny, golden, emulated, NEW_TOKENS, temperatures) == []
    assert any(moved), "no accepted path left the chain: the rewind was never exercised"
    for result in emulated:
        step = result.steps[0]
        assert step.parents is not None and len(step.draft_ids) == nodes  # a full tree, in the golden layout
        assert step.parents != list(range(nodes))  # a tree, not the chain


def test_tree_engine_at_tensor_parallel_2_equals_the_tp1_golden_loop(tiny, heldout, tmp_path, monkeypatch):
    """Each rank's network drafts the same tree from the all-gathered logits, and the rewind moves every rank's pool:
    no divergence at all, not even a near-tie."""
    ckpt = tmp_path / "tp2"
    convert_checkpoint(target_dir(), draft_dir(), ckpt, dtype="float32", tp_size=2)
    moved = _count_rewinds(monkeypatch)
    emulated = _emulated(ckpt, heldout, 32, [0.0, 0.7, 0.0])
    golden = _golden(tiny, heldout, 32, [0.0, 0.7, 0.0])
    assert [r.output_ids for r in emulated] == [r.output_ids[:NEW_TOKENS] for r in golden]
    assert divergences(tiny, golden, emulated, NEW_TOKENS, [0.0, 0.7, 0.0]) == []
    assert any(moved)


RANDOM_TREES = {
    # One draft position over a 96-token vocabulary: a tree of 120 holds only 96 nodes, so the engine emits fewer
    # nodes than its max_draft_len and the runtime verifies a shorter generation length.
    "qwen3-b2-wider-than-vocab": (PairVariant(block_size=2), 120),
    "llama-mqa-tied-b6": (PairVariant(arch="llama", block_size=6, kv_heads=1, draft_kv_heads=1, tie=True, seed=2), 33),
}


@pytest.mark.parametrize("gpu", ["h200", "b200"])
@pytest.mark.parametrize("name", list(RANDOM_TREES))
def test_tree_engine_on_random_pairs_equals_the_golden_tree_loop(tmp_path, name, gpu):
    """Also on B200, where DFlashAttention verifies: fewer nodes than max_draft_len (shorter mask rows than its
    words hold) and an MQA target."""
    variant, nodes = RANDOM_TREES[name]
    ckpt = convert(tmp_path, variant)
    model = load_golden_model(ckpt)
    golden = speculative_generate(model, PROMPTS, 16 + model.draft.spec.num_drafts, STOP, draft_tree=nodes)
    engine = EmulatedEngine(ckpt, gpu=gpu, max_batch_size=3, tokens_per_block=16, draft_tree=nodes)
    emulated = decode_batch(engine, PROMPTS, 16, STOP)
    assert divergences(ckpt, golden, emulated, 16) == []
    assert {len(step.draft_ids) for r in emulated for step in r.steps} == {min(nodes, variant.vocab)}


def test_emulate_cli_decodes_trees_as_generate_does(tiny, heldout, tmp_path, capsys):
    """`emulate --draft_tree N` prints the tokens `generate --draft_tree N` gives with K more tokens."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": heldout[0]}) + "\n")
    common = ["--checkpoint_dir", str(tiny), "--input_file", str(prompts), "--draft_tree", "20", "--json"]
    assert cli.main(["emulate", *common, "--max_new_tokens", "12", "--ignore_eos"]) == 0
    emulated = json.loads(capsys.readouterr().out)
    assert cli.main(["generate", *common, "--max_new_tokens", "27", "--ignore_eos"]) == 0
    generated = json.loads(capsys.readouterr().out)
    assert emulated["sequences"][0]["output_ids"] == generated["sequences"][0]["output_ids"][:12]
    assert emulated["mean_acceptance_length"] > 1
    assert len(emulated["per_position_acceptance"]) == 15  # the tree's draft positions, not its nodes
    budget = ["--draft_len_schedule", "1:18"]  # a node budget: trees of 18 on the 20-node engine
    assert cli.main(["emulate", *common, *budget, "--max_new_tokens", "12", "--ignore_eos"]) == 0
    scheduled = json.loads(capsys.readouterr().out)
    assert cli.main(["generate", *common, *budget, "--max_new_tokens", "27", "--ignore_eos"]) == 0
    assert (
        scheduled["sequences"][0]["output_ids"]
        == json.loads(capsys.readouterr().out)["sequences"][0]["output_ids"][:12]
    )


def test_a_runtime_without_the_path_rewind_is_caught(tiny, heldout, monkeypatch):
    golden = _golden(tiny, heldout[:2], 24, [0.0, 0.0])
    monkeypatch.setattr(emulated_executor, "rewind_moves", lambda paths, best_row, accepted: ([], []))
    assert divergences(tiny, golden, _emulated(tiny, heldout[:2], 24, [0.0, 0.0]), NEW_TOKENS) != []


def test_moved_nodes_missing_from_the_drafter_context_are_caught(tiny, heldout, monkeypatch):
    """The network writes each moved node's drafter K/V at the slot the rewind moves it from; without that write
    the rewind moves stale K/V into the drafter's context."""
    engine = load_engine_module()
    original = engine.DFlashForCausalLM.bookkeeping

    def nothing_moved(self, *args):
        book = original(self, *args)
        return book if book.moved is None else dataclasses.replace(book, moved=book.moved * 0)

    monkeypatch.setattr(engine.DFlashForCausalLM, "bookkeeping", nothing_moved)
    golden = _golden(tiny, heldout[:2], 24, [0.0, 0.0])
    assert divergences(tiny, golden, _emulated(tiny, heldout[:2], 24, [0.0, 0.0]), NEW_TOKENS) != []


@pytest.mark.parametrize(
    ("nodes", "message"),
    [(14, "at least the chain's 15 drafts"), (257, "at most 256 drafts"), (0, "draft_tree must be")],
)
def test_the_emulated_engine_refuses_what_a_build_refuses(tiny, nodes, message):
    with pytest.raises(DFlashTrtError, match=message):
        EmulatedEngine(tiny, draft_tree=nodes)


def test_the_chain_node_count_builds_the_chain_engine(tiny):
    engine = EmulatedEngine(tiny, draft_tree=15)
    assert (engine.tree, engine.k, engine.depth) == (False, 15, 15)


def _count_tree_calls(monkeypatch) -> list[int]:
    """Records the rows of every DFlashAttention call that read the runtime's packed tree mask."""
    calls: list[int] = []
    original = AttentionPlugin._tree_inputs

    def spy(self, inputs, requests, tokens):
        calls.append(tokens)
        return original(self, inputs, requests, tokens)

    monkeypatch.setattr(AttentionPlugin, "_tree_inputs", spy)
    return calls


@pytest.mark.parametrize(
    ("gpu", "nodes", "temperatures"),
    [("b200", 24, [0.0, 0.0]), ("b300", 40, [0.8, 0.0, 1.0])],
    ids=["b200-greedy-24-nodes", "b300-mixed-temperatures-40-nodes"],
)
def test_on_blackwell_dflash_attention_verifies_trees_as_the_golden_loop(
    tiny, heldout, monkeypatch, gpu, nodes, temperatures
):
    """On B200 / B300 the target's verification runs on DFlashAttention with the runtime's packed tree mask and
    position offsets (the stock stand-in refuses multi-token generation there, as 1.2.x does): the engine equals the
    golden tree loop token for token and tree for tree, with accepted paths off the chain."""
    prompts = heldout[: len(temperatures)]
    moved, calls = _count_rewinds(monkeypatch), _count_tree_calls(monkeypatch)
    emulated = _emulated(tiny, prompts, nodes, temperatures, gpu)
    golden = _golden(tiny, prompts, nodes, temperatures)
    assert divergences(tiny, golden, emulated, NEW_TOKENS, temperatures) == []
    assert any(moved) and max(calls) > nodes  # verified full trees of two requests on our plugin
    assert all(r.steps[0].parents != list(range(nodes)) for r in emulated)


def test_on_blackwell_trees_at_tensor_parallel_2_equal_the_tp1_golden_loop(tiny, heldout, tmp_path, monkeypatch):
    ckpt = tmp_path / "tp2"
    convert_checkpoint(target_dir(), draft_dir(), ckpt, dtype="float32", tp_size=2)
    calls = _count_tree_calls(monkeypatch)
    emulated = _emulated(ckpt, heldout, 32, [0.0, 0.7, 0.0], "b300")
    golden = _golden(tiny, heldout, 32, [0.0, 0.7, 0.0])
    assert divergences(tiny, golden, emulated, NEW_TOKENS, [0.0, 0.7, 0.0]) == [] and calls


@pytest.mark.parametrize(("gpu", "temperature"), [("b200", "0.9"), ("b300", "0")])
def test_emulate_on_blackwell_decodes_trees_as_generate_does(tiny, heldout, tmp_path, capsys, gpu, temperature):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": heldout[1]}) + "\n")
    common = ["--checkpoint_dir", str(tiny), "--input_file", str(prompts), "--draft_tree", "20", "--json"]
    sampling = ["--ignore_eos", "--temperature", temperature, "--seed", "5"]
    assert cli.main(["emulate", *common, "--gpu", gpu, "--max_new_tokens", "12", *sampling]) == 0
    emulated = json.loads(capsys.readouterr().out)
    assert cli.main(["generate", *common, "--max_new_tokens", "27", *sampling]) == 0
    generated = json.loads(capsys.readouterr().out)
    assert emulated["sequences"][0]["output_ids"] == generated["sequences"][0]["output_ids"][:12]


def _chain_mask(depths: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A plugin that ignores the tree's mask: the chain's causal rows (the offsets still read)."""
    return depths, torch.ones_like(rows).tril()


def _offsets_ignored(depths: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A plugin that rotates each node at its cache slot, not at the anchor plus its depth."""
    return torch.arange(depths.shape[0]), rows


@pytest.mark.parametrize("mutation", [_chain_mask, _offsets_ignored], ids=["chain-mask", "offsets-ignored"])
def test_a_blackwell_plugin_misreading_the_tree_is_caught(tiny, heldout, monkeypatch, mutation):
    original = AttentionPlugin._request

    def misread(self, x, past, end, table, pages, inputs, node):
        return original(self, x, past, end, table, pages, inputs, None if node is None else mutation(*node))

    monkeypatch.setattr(AttentionPlugin, "_request", misread)
    golden = _golden(tiny, heldout[:2], 24, [0.0, 0.0])
    assert divergences(tiny, golden, _emulated(tiny, heldout[:2], 24, [0.0, 0.0], "b200"), NEW_TOKENS) != []


def test_the_tree_limit_is_stated_where_dflash_attention_verifies():
    """One rule: Hopper's stock verification takes any tree the engine builds; DFlashAttention's up to the node count
    its tree mask was checked for."""
    from dflash_trt.trtllm.attention_route import OURS_TREE_NODES, AttentionRoute

    AttentionRoute(90).check_tree("h100", OURS_TREE_NODES + 1)
    for sm in (100, 103):
        AttentionRoute(sm).check_tree("b300", OURS_TREE_NODES)
        with pytest.raises(DFlashTrtError, match=rf"--draft_tree {OURS_TREE_NODES + 1}: on b300 .*checked up to"):
            AttentionRoute(sm).check_tree("b300", OURS_TREE_NODES + 1)


@pytest.mark.slow
def test_on_b300_an_nvfp4_checkpoint_with_an_fp8_kv_cache_verifies_trees_as_the_golden_loop(tmp_path, monkeypatch):
    """B300 with NVFP4 weights and an FP8 KV cache, the main deployment: the target's verification reads the tree's
    inputs ahead of the layer's KV scales (12 inputs), writes and reads FP8 pages, and equals the golden tree loop."""
    pytest.importorskip("modelopt.torch.quantization")
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    variant = PairVariant(intermediate=128, draft_intermediate=64)
    ckpt = convert(tmp_path, variant, qformat="nvfp4", kv_cache_dtype="fp8", calib_dataset=calib, calib_size=4)
    calls = []
    original = AttentionPlugin._execute

    def spy(self, inputs):
        calls.append((self.block_mask, self.cache_fp8, len(inputs)))
        return original(self, inputs)

    monkeypatch.setattr(AttentionPlugin, "_execute", spy)
    model = load_golden_model(ckpt)
    golden = speculative_generate(model, PROMPTS, 10 + model.draft.spec.num_drafts, STOP, draft_tree=20)
    engine = EmulatedEngine(ckpt, gpu="b300", max_batch_size=2, tokens_per_block=16, draft_tree=20)
    assert engine.cache_dtype == torch.float8_e4m3fn
    assert divergences(ckpt, golden, decode_batch(engine, PROMPTS, 10, STOP, arrivals=[0, 0, 1, 2]), 10) == []
    assert (2, 1, 12) in calls and (1, 1, 10) in calls  # the tree's verification and the drafter's full block
