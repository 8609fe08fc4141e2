"""Tensor- and expert-parallel checkpoints through the emulated engine: one unmodified network per rank, each loading
only its own `rank{N}.safetensors`, run in lockstep with the 1.2.x collectives (`dflash_trt/emulation/ranks.py`).
Tokens, drafts and acceptance must equal the golden model's on the TP 1 checkpoint of the same pair, exactly (no
divergence at all, not even a labelled near-tie), in float32; a broken all-reduce or all-gather must show."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _emulation import PROMPTS, SAMPLED_TOKENS, STOP, per_request, sampled_runs
from _pairs import PairVariant, make_pair

from dflash_trt import cli
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.emulation import layers, moe, ranks
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.functional import EmulationError
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.emulated import decode_batch
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.divergence import compare_decodings
from dflash_trt.reference.model import load_golden_model

MAX_NEW = 12
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
PAIRS = {
    "qwen3-gqa": PairVariant(),  # 4 q / 2 KV heads: tp 4 replicates each KV head on two ranks
    "llama-mqa-tied": PairVariant(arch="llama", kv_heads=1, draft_kv_heads=1, tie=True, seed=2),
    "qwen3-moe": PairVariant(arch="qwen3_moe", seed=3, moe=MOE),
}
# (pair, tp_size, moe_ep_size)
SPLITS = [
    ("qwen3-gqa", 2, 1),
    ("qwen3-gqa", 4, 1),
    ("llama-mqa-tied", 4, 1),
    ("qwen3-moe", 2, 2),  # each rank holds two whole experts
    ("qwen3-moe", 4, 2),  # two experts per rank, each split in two
]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[Path, Path, list]]:
    """Each pair's source folders and its TP 1 checkpoint's golden decoding, K tokens further (so that it verifies a
    full block wherever the engine does: `reference/divergence.py`)."""
    out = {}
    for name, variant in PAIRS.items():
        root = tmp_path_factory.mktemp(name)
        target_dir, draft_dir = make_pair(root, variant)
        convert_checkpoint(target_dir, draft_dir, root / "tp1", dtype="float32")
        model = load_golden_model(root / "tp1")
        k = model.draft.spec.block_size - 1
        out[name] = (root, root / "tp1", speculative_generate(model, PROMPTS, MAX_NEW + k, STOP))
    return out


def _sharded(pairs, name: str, tp: int, ep: int) -> tuple[Path, Path, list]:
    root, tp1, golden = pairs[name]
    out = root / f"tp{tp}ep{ep}"
    if not out.exists():
        convert_checkpoint(root / "target", root / "draft", out, dtype="float32", tp_size=tp, moe_ep_size=ep)
    return out, tp1, golden


def _emulate(ckpt: Path) -> tuple[EmulatedEngine, list]:
    runtime = EmulatedEngine(ckpt, max_batch_size=2, tokens_per_block=16)
    return runtime, decode_batch(runtime, PROMPTS, MAX_NEW, STOP)


@pytest.mark.slow
@pytest.mark.parametrize("name, tp, ep", SPLITS, ids=[f"{n}-tp{t}-ep{e}" for n, t, e in SPLITS])
def test_ranks_decode_exactly_like_the_tp1_golden_model(pairs, name, tp, ep):
    ckpt, tp1, golden = _sharded(pairs, name, tp, ep)
    runtime, emulated = _emulate(ckpt)
    assert compare_decodings(load_golden_model(tp1), golden, emulated, MAX_NEW) == []
    # Every rank loaded exactly its own file, holding its share of the heads (and experts).
    assert len(runtime.rank_models) == tp and all(m.unused_tensors == [] for m in runtime.rank_models)
    assert [m.config.mapping.tp_rank for m in runtime.rank_models] == list(range(tp))
    heads = PAIRS[name].heads // tp
    kv_heads = -(-PAIRS[name].kv_heads // tp)
    attention = runtime.model.transformer.layers[0].attention
    assert (attention.num_attention_heads, attention.num_attention_kv_heads) == (heads, kv_heads)
    assert runtime.kv_heads == kv_heads
    if PAIRS[name].arch == "qwen3_moe":
        experts = runtime.model.transformer.layers[0].mlp
        assert experts.experts_per_node == MOE["num_experts"] // ep
        assert experts.expert_inter_size == MOE["moe_intermediate_size"] // (tp // ep)


@pytest.mark.parametrize("name, tp, ep", [("qwen3-gqa", 4, 1), ("qwen3-moe", 2, 2)], ids=["tp4", "moe-tp2-ep2"])
def test_sampled_decoding_at_tp_matches_the_golden_model(pairs, name, tp, ep):
    """A batch mixing greedy and two temperatures: every rank draws the same verification from the gathered logits."""
    ckpt, _, _ = _sharded(pairs, name, tp, ep)
    greedy, golden, emulated = sampled_runs(ckpt, PROMPTS, "mixed", tokens_per_block=16)
    temperatures = per_request("mixed", len(PROMPTS))
    assert compare_decodings(load_golden_model(ckpt), golden, emulated, SAMPLED_TOKENS, temperatures) == []
    assert any(g.output_ids != e.output_ids for g, e, t in zip(greedy, emulated, temperatures, strict=True) if t)


def test_rank_networks_load_their_own_rank_file(pairs):
    """Rank r's qkv rows are rank r's file's, not rank 0's: the ranks' weights differ."""
    ckpt, _, _ = _sharded(pairs, "qwen3-gqa", 2, 1)
    runtime = EmulatedEngine(ckpt, max_batch_size=2)
    first, second = (m.transformer.layers[0].attention.qkv.weight.raw for m in runtime.rank_models)
    assert first.shape == second.shape and not torch.equal(first, second)


def _local_allreduce(tensor, group, all_reduce_params=None):
    """Each rank keeps its own partial sum."""
    return tensor


def _reversed_allgather(tensor, group, gather_dim=0):
    running = ranks._running.group
    gathered = running._exchange(ranks._running.rank, tensor.data)
    return layers.wrap_tensor(torch.cat(gathered[::-1], dim=gather_dim))


@pytest.mark.parametrize(
    "name, module, symbol, broken",
    [
        ("qwen3-gqa", layers, "allreduce", _local_allreduce),
        ("qwen3-gqa", layers, "allgather", _reversed_allgather),
        ("qwen3-moe", moe, "allreduce", _local_allreduce),
    ],
    ids=["no-allreduce", "allgather-reversed", "moe-no-allreduce"],
)
def test_broken_collectives_are_caught(pairs, monkeypatch, name, module, symbol, broken):
    ckpt, tp1, golden = _sharded(pairs, name, 2, 2 if name == "qwen3-moe" else 1)
    monkeypatch.setattr(module, symbol, broken)
    try:
        _, emulated = _emulate(ckpt)
    except EmulationError as exc:  # ranks that disagree on an output are refused outright
        assert "disagrees with rank 0" in str(exc)
        return
    assert compare_decodings(load_golden_model(tp1), golden, emulated, MAX_NEW) != []


def test_cli_emulate_on_a_tp2_checkpoint_matches_generate(pairs, tmp_path, capsys):
    ckpt, tp1, _ = _sharded(pairs, "qwen3-gqa", 2, 1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    args = ["--input_file", str(prompts), "--max_new_tokens", str(MAX_NEW), "--json"]
    assert cli.main(["generate", "--checkpoint_dir", str(tp1), *args]) == 0
    generated = json.loads(capsys.readouterr().out)["sequences"]
    assert cli.main(["emulate", "--checkpoint_dir", str(ckpt), *args, "--max_batch_size", "2"]) == 0
    emulated = json.loads(capsys.readouterr().out)["sequences"]
    assert [e["output_ids"] for e in emulated] == [g["output_ids"] for g in generated]


def test_a_missing_rank_file_is_one_clear_error(pairs, tmp_path):
    ckpt, _, _ = _sharded(pairs, "qwen3-gqa", 2, 1)
    broken = tmp_path / "ckpt"
    broken.mkdir()
    for f in ckpt.iterdir():
        if f.name != "rank1.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(DFlashTrtError, match="rank1.safetensors"):
        EmulatedEngine(broken)
