"""Tensor-parallel rank files checked against a split written here, independently of `dflash_trt.checkpoint.sharding`.

The expected pieces follow TensorRT-LLM 1.2.x's converters (`models/llama/convert.py`, `models/qwen/convert.py`,
`models/convert_utils.py`): q, k and v are split separately by heads; when there are fewer KV heads than ranks each
KV head is first repeated `tp // kv` times in place (`dup_kv_weight`) and the result split evenly; mlp fc/gate and
their biases by rows, dense/proj by columns with their biases whole on every rank; lm_head zero-padded to a multiple
of tp, then split by rows; norms, embeddings and the drafter's fc whole on every rank. The fixtures have a vocabulary
no tp divides and fewer KV heads than the largest tp.
"""

from __future__ import annotations

import json

import pytest
import torch
from _pairs import PairVariant, make_pair
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dflash_trt.checkpoint.sharding import HeadLayout, check_tp
from dflash_trt.cli import main
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model

TP_SIZES = (1, 2, 4, 8)

VARIANTS = {
    # Llama with attention and mlp biases; 2 KV heads (replicated at tp 4 and 8); drafter with 1 KV head.
    "llama_bias": PairVariant(
        arch="llama",
        vocab=93,
        hidden=64,
        intermediate=96,
        heads=8,
        kv_heads=2,
        head_dim=8,
        target_bias=True,
        draft_heads=8,
        draft_kv_heads=1,
        draft_head_dim=8,
        draft_intermediate=80,
        draft_bias=True,
        seed=3,
    ),
    # Qwen3 with tied embeddings: lm_head comes from the embedding and is padded (vocab 101 is prime).
    "qwen3_tied": PairVariant(
        arch="qwen3",
        vocab=101,
        hidden=64,
        intermediate=64,
        heads=8,
        kv_heads=4,
        head_dim=16,
        tie=True,
        draft_heads=8,
        draft_kv_heads=2,
        draft_head_dim=8,
        draft_intermediate=72,
        seed=5,
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tp_checkpoints(request, tmp_path_factory):
    """(variant, target_dir, draft_dir, {tp: checkpoint_dir}) with every tp of TP_SIZES converted in float32."""
    variant = VARIANTS[request.param]
    root = tmp_path_factory.mktemp(f"tp_{request.param}")
    target_dir, draft_dir = make_pair(root, variant)
    checkpoints = {}
    for tp in TP_SIZES:
        checkpoints[tp] = root / f"tp{tp}"
        convert_checkpoint(target_dir, draft_dir, checkpoints[tp], dtype="float32", tp_size=tp)
    return variant, target_dir, draft_dir, checkpoints


def _rows_of_heads(weight: torch.Tensor, heads: list[int], head_dim: int) -> torch.Tensor:
    return torch.cat([weight[h * head_dim : (h + 1) * head_dim] for h in heads], dim=0)


def _q_heads_of(rank: int, num_heads: int, tp: int) -> list[int]:
    per_rank = num_heads // tp
    return [h for h in range(num_heads) if h // per_rank == rank]


def _kv_heads_of(rank: int, num_kv: int, tp: int) -> list[int]:
    """TensorRT-LLM: repeat each KV head tp // kv times in place when kv < tp, then split the list evenly."""
    expanded = [h for h in range(num_kv) for _ in range(max(tp // num_kv, 1))]
    per_rank = len(expanded) // tp
    return expanded[rank * per_rank : (rank + 1) * per_rank]


def _expected_qkv(q, k, v, rank, tp, num_heads, num_kv, head_dim) -> torch.Tensor:
    return torch.cat(
        [
            _rows_of_heads(q, _q_heads_of(rank, num_heads, tp), head_dim),
            _rows_of_heads(k, _kv_heads_of(rank, num_kv, tp), head_dim),
            _rows_of_heads(v, _kv_heads_of(rank, num_kv, tp), head_dim),
        ]
    )


def _chunk(tensor: torch.Tensor, rank: int, tp: int, dim: int) -> torch.Tensor:
    size = tensor.shape[dim] // tp
    assert size * tp == tensor.shape[dim]
    return tensor.narrow(dim, rank * size, size)


def _expected_layer(
    src: dict,
    out_prefix: str,
    src_prefix: str,
    rank: int,
    tp: int,
    heads: int,
    kv: int,
    head_dim: int,
    attention_bias: bool,
    mlp_bias: bool,
    qk_norm: bool,
) -> dict[str, torch.Tensor]:
    attn, mlp = f"{src_prefix}self_attn.", f"{src_prefix}mlp."
    out = {
        f"{out_prefix}.input_layernorm.weight": src[f"{src_prefix}input_layernorm.weight"],
        f"{out_prefix}.post_layernorm.weight": src[f"{src_prefix}post_attention_layernorm.weight"],
        f"{out_prefix}.attention.qkv.weight": _expected_qkv(
            src[f"{attn}q_proj.weight"],
            src[f"{attn}k_proj.weight"],
            src[f"{attn}v_proj.weight"],
            rank,
            tp,
            heads,
            kv,
            head_dim,
        ),
        f"{out_prefix}.attention.dense.weight": _chunk(src[f"{attn}o_proj.weight"], rank, tp, 1),
        f"{out_prefix}.mlp.fc.weight": _chunk(src[f"{mlp}gate_proj.weight"], rank, tp, 0),
        f"{out_prefix}.mlp.gate.weight": _chunk(src[f"{mlp}up_proj.weight"], rank, tp, 0),
        f"{out_prefix}.mlp.proj.weight": _chunk(src[f"{mlp}down_proj.weight"], rank, tp, 1),
    }
    if qk_norm:
        out[f"{out_prefix}.attention.q_layernorm.weight"] = src[f"{attn}q_norm.weight"]
        out[f"{out_prefix}.attention.k_layernorm.weight"] = src[f"{attn}k_norm.weight"]
    if attention_bias:
        out[f"{out_prefix}.attention.qkv.bias"] = _expected_qkv(
            src[f"{attn}q_proj.bias"],
            src[f"{attn}k_proj.bias"],
            src[f"{attn}v_proj.bias"],
            rank,
            tp,
            heads,
            kv,
            head_dim,
        )
        out[f"{out_prefix}.attention.dense.bias"] = src[f"{attn}o_proj.bias"]
    if mlp_bias:
        out[f"{out_prefix}.mlp.fc.bias"] = _chunk(src[f"{mlp}gate_proj.bias"], rank, tp, 0)
        out[f"{out_prefix}.mlp.gate.bias"] = _chunk(src[f"{mlp}up_proj.bias"], rank, tp, 0)
        out[f"{out_prefix}.mlp.proj.bias"] = src[f"{mlp}down_proj.bias"]
    return out


def _expected_rank(v: PairVariant, hf: dict, zl: dict, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Every tensor rank `rank` of `tp` must hold, spelled out by hand."""
    embed = hf["model.embed_tokens.weight"]
    head = embed if v.tie else hf["lm_head.weight"]
    padded_vocab = -(-v.vocab // tp) * tp
    padded_head = torch.cat([head, torch.zeros(padded_vocab - v.vocab, v.hidden)])
    out = {
        "transformer.vocab_embedding.weight": embed,
        "transformer.ln_f.weight": hf["model.norm.weight"],
        "lm_head.weight": _chunk(padded_head, rank, tp, 0),
        "dflash.fc.weight": zl["fc.weight"],
        "dflash.hidden_norm.weight": zl["hidden_norm.weight"],
        "dflash.ln_f.weight": zl["norm.weight"],
    }
    for i in range(v.layers):
        out |= _expected_layer(
            hf,
            f"transformer.layers.{i}",
            f"model.layers.{i}.",
            rank,
            tp,
            v.heads,
            v.kv_heads,
            v.head_dim,
            v.target_bias,
            v.target_bias and v.arch == "llama",
            v.arch == "qwen3",
        )
    for i in range(v.draft_layers):
        out |= _expected_layer(
            zl,
            f"dflash.layers.{i}",
            f"layers.{i}.",
            rank,
            tp,
            v.draft_heads,
            v.draft_kv_heads,
            v.draft_head_dim,
            v.draft_bias,
            False,
            True,
        )
    return out


@pytest.mark.parametrize("tp", TP_SIZES)
def test_every_rank_holds_the_hand_split_pieces(tp_checkpoints, tp):
    v, target_dir, draft_dir, checkpoints = tp_checkpoints
    hf, zl = load_file(target_dir / "model.safetensors"), load_file(draft_dir / "model.safetensors")
    files = sorted(p.name for p in checkpoints[tp].glob("*.safetensors"))
    assert files == sorted(f"rank{r}.safetensors" for r in range(tp))
    for rank in range(tp):
        got = load_file(checkpoints[tp] / f"rank{rank}.safetensors")
        want = _expected_rank(v, hf, zl, rank, tp)
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            assert got[name].shape == tensor.shape, name
            assert torch.equal(got[name], tensor), f"{name} on rank {rank} of {tp}"


def test_pieces_reassemble_to_the_unsharded_tensors(tp_checkpoints):
    """Concatenating the hand-defined rank pieces back gives the TP=1 tensors (replicated KV heads counted once)."""
    v, _, _, checkpoints = tp_checkpoints
    full = load_file(checkpoints[1] / "rank0.safetensors")
    for tp in TP_SIZES[1:]:
        ranks = [load_file(checkpoints[tp] / f"rank{r}.safetensors") for r in range(tp)]
        head = torch.cat([r["lm_head.weight"] for r in ranks])
        assert torch.equal(head[: v.vocab], full["lm_head.weight"]) and not head[v.vocab :].any()
        for i in range(v.layers):
            layer = f"transformer.layers.{i}"
            for name, dim in (
                ("mlp.fc.weight", 0),
                ("mlp.gate.weight", 0),
                ("mlp.proj.weight", 1),
                ("attention.dense.weight", 1),
            ):
                merged = torch.cat([r[f"{layer}.{name}"] for r in ranks], dim=dim)
                assert torch.equal(merged, full[f"{layer}.{name}"]), (tp, layer, name)
            q_rows = v.heads * v.head_dim // tp
            kv_rows = max(v.kv_heads // tp, 1) * v.head_dim
            q = torch.cat([r[f"{layer}.attention.qkv.weight"][:q_rows] for r in ranks])
            replicas = max(tp // v.kv_heads, 1)
            k = torch.cat([r[f"{layer}.attention.qkv.weight"][q_rows : q_rows + kv_rows] for r in ranks[::replicas]])
            assert torch.equal(torch.cat([q, k]), full[f"{layer}.attention.qkv.weight"][: q.shape[0] + k.shape[0]])


def test_config_records_mapping_and_padded_vocab(tp_checkpoints):
    v, _, _, checkpoints = tp_checkpoints
    for tp, ckpt in checkpoints.items():
        cfg = json.loads((ckpt / "config.json").read_text())
        assert cfg["mapping"] == {"world_size": tp, "tp_size": tp, "pp_size": 1}
        assert cfg["vocab_size"] == v.vocab
        assert cfg["vocab_size_padded"] == -(-v.vocab // tp) * tp
        assert cfg["vocab_size_padded"] % tp == 0


def test_golden_model_tokens_are_identical_across_tp(tp_checkpoints):
    v, target_dir, _, checkpoints = tp_checkpoints
    prompts = [[5, 17, 33, 2, 9], [40, 41, 7]]
    runs = {}
    for tp, ckpt in checkpoints.items():
        results = speculative_generate(load_golden_model(ckpt), prompts, max_new_tokens=10)
        runs[tp] = [(r.output_ids, r.acceptance_lengths) for r in results]
    assert all(runs[tp] == runs[1] for tp in TP_SIZES), runs
    hf_model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for prompt, (output_ids, _) in zip(prompts, runs[1], strict=True):
        greedy = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert output_ids == greedy[0, len(prompt) :].tolist()


def test_parallel_workers_write_the_same_bytes(tp_checkpoints, tmp_path):
    _, target_dir, draft_dir, checkpoints = tp_checkpoints
    convert_checkpoint(target_dir, draft_dir, tmp_path / "w", dtype="float32", tp_size=4, workers=3)
    for rank in range(4):
        name = f"rank{rank}.safetensors"
        assert (tmp_path / "w" / name).read_bytes() == (checkpoints[4] / name).read_bytes()


def test_tp_that_does_not_divide_the_heads_is_refused(tp_checkpoints, tmp_path, capsys):
    _, target_dir, draft_dir, _ = tp_checkpoints
    out = tmp_path / "bad"
    code = main(
        [
            "convert",
            "--model_dir",
            str(target_dir),
            "--dflash_model_dir",
            str(draft_dir),
            "--output_dir",
            str(out),
            "--tp_size",
            "3",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "8 attention heads cannot be split over tp_size 3" in err
    assert not out.exists() and not list(tmp_path.glob(".bad*"))


@pytest.mark.parametrize(
    "heads, intermediate, tp, message",
    [
        (HeadLayout(6, 3, 16), 96, 2, "3 KV heads cannot be split or replicated over tp_size 2"),
        (HeadLayout(12, 4, 16), 96, 3, "4 KV heads cannot be split or replicated over tp_size 3"),
        (HeadLayout(8, 8, 16), 100, 8, "intermediate_size 100 is not divisible by tp_size 8"),
        (HeadLayout(8, 2, 16), 96, 16, "8 attention heads cannot be split over tp_size 16"),
        (HeadLayout(8, 2, 16), 96, 0, "tp_size must be >= 1, got 0"),
    ],
)
def test_geometries_tp_cannot_split_are_refused(heads, intermediate, tp, message):
    with pytest.raises(DFlashTrtError, match=message):
        check_tp(heads, intermediate, tp, "target")
