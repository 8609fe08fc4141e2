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
    # Biases on every linear (qkv, dense, fc, gate, proj; the drafter's qkv and dense): row-parallel ones at tp 2.
    "llama-bias": PairVariant(arch="llama", target_bias=True, draft_bias=True, seed=4),
    # 95 tokens: tp 2 pads lm_head to 96 rows, and every logit is negative, so zero padding rows would win an argmax.
    "qwen3-odd-vocab": PairVariant(vocab=95, negative_logits=True, seed=5),
    # Multi-head attention: at tp 4 each rank holds one query and one KV head (tp 1 and 2 are refused, see below).
    "llama-mha": PairVariant(arch="llama", kv_heads=4, draft_kv_heads=4, seed=6),
}
# (pair, tp_size, moe_ep_size)
SPLITS = [
    ("qwen3-gqa", 2, 1),
    ("qwen3-gqa", 4, 1),
    ("llama-mqa-tied", 4, 1),
    ("qwen3-moe", 2, 2),  # each rank holds two whole experts
    ("qwen3-moe", 4, 2),  # two experts per rank, each split in two
    ("llama-bias", 2, 1),
    ("qwen3-odd-vocab", 2, 1),
    ("llama-mha", 4, 1),
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


def test_the_all_reduce_adds_in_the_dtype_from_rank_0():
    """As the custom all-reduce kernels add (customAllReduceKernels.cu, "Always reduce from rank 0", `add128b` in the
    element type): in bf16, 1 + 2^-8 is a tie that rounds back to 1, so ranks holding (1, 2^-8, 2^-8) sum to 1 from
    rank 0, while an fp32 accumulation (or the reverse order) gives 1 + 2^-7."""
    held = [torch.tensor([value], dtype=torch.bfloat16) for value in (1.0, 2.0**-8, 2.0**-8)]
    group = ranks.RankGroup(3)
    sums = group.run([lambda r=r: ranks.allreduce(layers.wrap_tensor(held[r]), [0, 1, 2]).data for r in range(3)])
    assert all(total.dtype == torch.bfloat16 and total.item() == 1.0 for total in sums)


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


@pytest.mark.parametrize("tp", [1, 2])
def test_equal_heads_per_rank_with_qk_norms_are_refused(pairs, tp):
    """The MHA pair's drafter has q/k norms; with 4 (tp 1) or 2 (tp 2) query and KV heads per rank 1.2.x's Attention
    reads its fused qkv rows interleaved per head, not as the checkpoint holds them, so the engine is refused."""
    ckpt = _sharded(pairs, "llama-mha", tp, 1)[0] if tp > 1 else pairs["llama-mha"][1]
    with pytest.raises(
        DFlashTrtError, match=f"drafter's attention holds {4 // tp} query and {4 // tp} KV heads per rank"
    ):
        EmulatedEngine(ckpt, max_batch_size=2)


# ------------------------------------------------------------------------------------------------ kept mutations


def _bias_before_allreduce(self, x, lora_runtime_params=None, **unused):
    """Each rank adds the bias to its partial product: the sum holds it tp times."""
    return ranks.allreduce(layers.wrap_tensor(self._gemm(x, with_bias=True)), self.tp_group)


def test_a_row_parallel_bias_added_before_the_all_reduce_is_caught(pairs, monkeypatch):
    ckpt, tp1, golden = _sharded(pairs, "llama-bias", 2, 1)
    monkeypatch.setattr(layers.RowLinear, "forward", _bias_before_allreduce)
    _, emulated = _emulate(ckpt)
    assert compare_decodings(load_golden_model(tp1), golden, emulated, MAX_NEW) != []


ARGMAX_OVER_PADDING = {
    "draft argmax": (
        "model",
        "        logits = slice(logits, [0, 0], concat([batch * k, self.config.vocab_size]))\n",
        "",
    ),
    "greedy verification": ("verify", "    if logits.size(-1) > vocab_size:\n", "    if False:\n"),
}


@pytest.mark.parametrize("source, old, new", ARGMAX_OVER_PADDING.values(), ids=ARGMAX_OVER_PADDING.keys())
def test_an_argmax_over_lm_head_padding_is_caught(pairs, monkeypatch, tmp_path, source, old, new):
    """The 95-token pair at tp 2: lm_head's 96th row is zero padding and every real logit is negative."""
    from _mutations import install, mutated_engine_module

    ckpt, _, _ = _sharded(pairs, "qwen3-odd-vocab", 2, 1)
    install(monkeypatch, mutated_engine_module(tmp_path, source, old, new))
    with pytest.raises(EmulationError, match="embedding index out of range"):  # a padding id fed back as a token
        _emulate(ckpt)


def test_lm_head_padding_rows_misplaced_by_the_converter_are_caught(pairs, monkeypatch, tmp_path):
    """The converter pads each rank's vocabulary slice before its rows instead of after the vocabulary's end."""
    from dflash_trt.checkpoint import sharding
    from dflash_trt.conversion import rank_writer

    real = sharding.rank_piece

    def padding_first(shape, split, tp_size, rank, heads=None, experts=None):
        piece = real(shape, split, tp_size, rank, heads, experts)
        if split is sharding.Split.VOCAB and len(piece.parts) == 2:
            return sharding.Piece(piece.axis, piece.parts[::-1])
        return piece

    root, tp1, golden = pairs["qwen3-odd-vocab"]
    monkeypatch.setattr(sharding, "rank_piece", padding_first)
    monkeypatch.setattr(rank_writer, "rank_piece", padding_first)
    convert_checkpoint(root / "target", root / "draft", tmp_path / "tp2", dtype="float32", tp_size=2)
    try:
        _, emulated = _emulate(tmp_path / "tp2")
    except EmulationError as exc:
        assert "embedding index out of range" in str(exc)
        return
    assert compare_decodings(load_golden_model(tp1), golden, emulated, MAX_NEW) != []


def test_equal_heads_read_as_1_2_reads_them_diverge_from_the_checkpoint_layout(pairs, monkeypatch):
    """Without the refusal, the MHA pair at tp 2 runs the stand-in's interleaved reading of its qkv rows (1.2.x's
    `Attention.forward` branch for equal per-rank heads with q/k norms): the drafts are wrong from the first block."""
    from dflash_trt.emulation import engine as emulated_engine
    from dflash_trt.trtllm import network_checks

    ckpt, tp1, golden = _sharded(pairs, "llama-mha", 2, 1)
    monkeypatch.setattr(network_checks, "check_qk_norm_heads", lambda facts: None)
    monkeypatch.setattr(emulated_engine, "check_network", network_checks.check_network)
    _, emulated = _emulate(ckpt)
    assert compare_decodings(load_golden_model(tp1), golden, emulated, MAX_NEW) != []


# -------------------------------------------------------------------- rank numbering against the upstream Mapping


def upstream_moe_ranks(rank: int, tp: int, ep: int) -> tuple[int, int]:
    """(moe_ep_rank, moe_tp_rank) of `rank`, restated from 1.2.x tensorrt_llm/mapping.py as read: tp_rank = rank %
    tp_size, moe_ep_rank = tp_rank % moe_ep_size, moe_tp_rank = tp_rank // (moe_ep_size * moe_cluster_size), the
    cluster size being 1."""
    tp_rank = rank % tp
    return tp_rank % ep, tp_rank // ep


@pytest.mark.parametrize("tp, ep", [(t, e) for t in (1, 2, 4, 8) for e in (1, 2, 4, 8) if t % e == 0])
def test_converter_and_emulation_number_ranks_as_the_upstream_mapping(tp, ep):
    """A numbering changed the same way in the converter and the emulated Mapping keeps every decoding test green;
    only this comparison with the upstream formulas catches it. Experts per group: layers/moe.py MixtureOfExperts,
    experts_per_node = num_experts // moe_ep_size, group g holding [g * experts_per_node, (g + 1) * ...)."""
    from dflash_trt.checkpoint.sharding import ExpertLayout
    from dflash_trt.emulation.models import Mapping

    layout = ExpertLayout(num_experts=16, ep_size=ep)
    for rank in range(tp):
        group, piece, pieces = layout.ranks(tp, rank)
        assert (group, piece, pieces) == (*upstream_moe_ranks(rank, tp, ep), tp // ep)
        assert layout.experts_of(group) == range(group * 16 // ep, (group + 1) * 16 // ep)
        mapping = Mapping(world_size=tp, rank=rank, tp_size=tp, moe_ep_size=ep)
        assert (mapping.moe_ep_rank, mapping.moe_tp_rank) == upstream_moe_ranks(rank, tp, ep)


def test_rank_files_hold_the_expert_slices_the_upstream_mapping_assigns(pairs):
    """tp 4 x ep 2: rank r's stacked experts are group r % 2 of the TP 1 stacks, slice r // 2 of each expert's up and
    gate halves (fc rows) and of proj's input columns."""
    from safetensors.torch import load_file

    from dflash_trt import tensor_names as names

    ckpt, tp1, _ = _sharded(pairs, "qwen3-moe", 4, 2)
    full = load_file(tp1 / "rank0.safetensors")
    fc, proj = (f"{names.target_layer(0)}.{m}.weight" for m in (names.MOE_FC, names.MOE_PROJ))
    inter = MOE["moe_intermediate_size"]
    for rank in range(4):
        ep_rank, tp_rank = upstream_moe_ranks(rank, 4, 2)
        experts = slice(ep_rank * 2, ep_rank * 2 + 2)
        part = slice(tp_rank * inter // 2, (tp_rank + 1) * inter // 2)
        held = load_file(ckpt / f"rank{rank}.safetensors")
        up, gate = full[fc][experts, :inter][:, part], full[fc][experts, inter:][:, part]
        assert torch.equal(held[fc], torch.cat([up, gate], dim=1))
        assert torch.equal(held[proj], full[proj][experts][:, :, part])
