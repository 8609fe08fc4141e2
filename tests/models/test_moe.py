"""Qwen3-MoE targets: config parsing, conversion (TP / EP), hostile inputs, and the golden model against HF's
`Qwen3MoeForCausalLM` and the `dflash` reference on tiny random pairs.

The independent side: HF writes the per-expert checkpoint and computes logits and greedy tokens; `dflash_generate`
decodes with the HF MoE target; the rank pieces are cut here following TensorRT-LLM 1.2.x's Qwen converter
(`models/qwen/convert.py`: experts `ep_experts` of the rank's expert group stacked, up_proj and gate_proj each split
by rows over moe_tp and concatenated [up, gate], down_proj split by columns; router float32, replicated).
"""

from __future__ import annotations

import json
import re

import dflash.model as reference
import pytest
import torch
from _pairs import PairVariant, make_pair
from _reference import assert_matches_dflash_generate
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from dflash_trt.cli import main
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.conversion.verify import verify_checkpoint
from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.spec import QWEN3_MOE, parse_target_config

VARIANTS = {
    # a dense layer among sparse ones, renormalized top-2 of 4
    "e4-top2-norm-dense1": PairVariant(
        arch="qwen3_moe",
        moe={
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    # every second layer sparse, top-3 of 8 without renormalization, GQA 4:1
    "e8-top3-step2": PairVariant(
        arch="qwen3_moe",
        kv_heads=1,
        seed=4,
        moe={
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 16,
            "norm_topk_prob": False,
            "decoder_sparse_step": 2,
        },
    ),
    # top-1 of 2, tied embeddings, one tap
    "e2-top1-tied": PairVariant(
        arch="qwen3_moe",
        tie=True,
        taps=[3],
        draft_layers=1,
        block_size=4,
        seed=7,
        moe={"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 48, "norm_topk_prob": True},
    ),
}
PROMPTS = [[3, 4, 5, 6, 7], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
PARALLEL = ((2, 1), (2, 2), (4, 1), (4, 2), (4, 4))  # (tp, moe_ep)

CODER_30B_A3B = {  # Qwen3-Coder-30B-A3B-Instruct's config.json, as published
    "architectures": [QWEN3_MOE],
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000000,
    "max_position_embeddings": 262144,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


# ------------------------------------------------------------------------------------------------------ spec
def test_spec_reads_qwen3_coder_30b_a3b():
    spec = parse_target_config(CODER_30B_A3B)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.intermediate_size) == (128, 8, 768)
    assert spec.moe.norm_topk_prob and spec.moe.sparse_layers == tuple(range(48)) and spec.qk_norm
    assert spec.num_attention_heads * spec.head_dim != spec.hidden_size


def test_spec_follows_transformers_sparse_layer_rule_and_defaults():
    spec = parse_target_config({**CODER_30B_A3B, "decoder_sparse_step": 3, "mlp_only_layers": [5]})
    assert spec.moe.sparse_layers == tuple(i for i in range(48) if (i + 1) % 3 == 0 and i != 5)
    minimal = {
        k: v
        for k, v in CODER_30B_A3B.items()
        if k
        not in (
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
        )
    }
    defaults = parse_target_config({**minimal, "num_local_experts": 64}).moe
    assert (defaults.num_experts, defaults.top_k, defaults.intermediate_size, defaults.norm_topk_prob) == (
        64,
        8,
        768,
        False,
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts_per_tok": 129}, "exceeds num_experts"),
        ({"num_experts": 1}, "'num_experts' must be an integer >= 2"),
        ({"num_experts": 1 << 20}, "'num_experts' must be an integer"),
        ({"num_local_experts": 64}, "disagree"),
        ({"mlp_only_layers": [48]}, "mlp_only_layers"),
        ({"mlp_only_layers": "0"}, "mlp_only_layers"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"decoder_sparse_step": 49}, "no layer is sparse"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
        ({"shared_expert_intermediate_size": 512}, "shared experts"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_spec_refuses_what_cannot_be_built(change, message):
    with pytest.raises(DFlashTrtError, match=message):
        parse_target_config({**CODER_30B_A3B, **change})


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", params=list(VARIANTS))
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target_dir, draft_dir = make_pair(root, VARIANTS[request.param])
    convert_checkpoint(target_dir, draft_dir, root / "ckpt", dtype="float32")
    hf_target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    ref_draft = reference.DFlashDraftModel.from_pretrained(draft_dir).eval()
    return load_golden_model(root / "ckpt"), hf_target, ref_draft


@pytest.fixture(scope="module")
def parallel(tmp_path_factory):
    """The dense-among-sparse pair converted at every (tp, moe_ep) of PARALLEL, plus tp 1."""
    root = tmp_path_factory.mktemp("moe_parallel")
    target_dir, draft_dir = make_pair(root, VARIANTS["e4-top2-norm-dense1"])
    checkpoints = {}
    for tp, ep in ((1, 1), *PARALLEL):
        checkpoints[tp, ep] = root / f"tp{tp}ep{ep}"
        convert_checkpoint(target_dir, draft_dir, checkpoints[tp, ep], dtype="float32", tp_size=tp, moe_ep_size=ep)
    return target_dir, draft_dir, checkpoints


# ------------------------------------------------------------------------------------------- golden model
def test_target_logits_and_taps_match_transformers(converted):
    golden, hf_target, ref_draft = converted
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        out = hf_target(ids, output_hidden_states=True)
    positions = torch.arange(ids.shape[1])[None]
    logits, taps = golden.target.forward(
        ids, positions, torch.ones_like(ids, dtype=torch.bool), golden.target.new_cache(1, 16)
    )
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)
    want = reference.extract_context_feature(out.hidden_states, ref_draft.target_layer_ids)
    torch.testing.assert_close(taps, want, rtol=1e-5, atol=1e-5)


def test_routing_is_not_trivial(converted):
    """Every expert of the first sparse layer wins some token, so a wrong expert order would show in the logits."""
    golden, _, _ = converted
    layer = next(layer for layer in golden.target.layers if layer.sparse is not None)
    hidden = torch.nn.functional.embedding(torch.arange(golden.target.spec.vocab_size), golden.target.embedding)
    logits = hidden @ layer.sparse.router.T
    assert set(logits.argmax(-1).tolist()) == set(range(layer.sparse.router.shape[0]))


@pytest.mark.parametrize("max_new, stops", [(30, None), (13, [5, 17, 40, 60])])
def test_generate_matches_dflash_generate(converted, monkeypatch, max_new, stops):
    assert_matches_dflash_generate(*converted, PROMPTS, max_new, stops, monkeypatch)


def test_ragged_batch_is_lossless_against_hf_greedy(converted):
    golden, hf_target, _ = converted
    max_new = [24, 11, 17]
    for prompt, n, result in zip(PROMPTS, max_new, speculative_generate(golden, PROMPTS, max_new), strict=True):
        want = hf_target.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert result.output_ids == want[0, len(prompt) :].tolist()


# ------------------------------------------------------------------------------------ tensor / expert parallel
def _hand_split(hf: dict[str, torch.Tensor], layer: int, num_experts: int, tp: int, ep: int, rank: int):
    """TensorRT-LLM's stacking and split of one sparse layer for one rank, written out independently."""
    moe_tp, moe_tp_rank, ep_rank = tp // ep, rank // ep, rank % ep
    per_group = num_experts // ep
    experts = range(ep_rank * per_group, (ep_rank + 1) * per_group)
    p = f"model.layers.{layer}.mlp."

    def stack(leaf):
        return torch.stack([hf[f"{p}experts.{e}.{leaf}.weight"] for e in experts])

    up, gate, down = stack("up_proj"), stack("gate_proj"), stack("down_proj")
    up, gate = up.chunk(moe_tp, dim=1)[moe_tp_rank], gate.chunk(moe_tp, dim=1)[moe_tp_rank]
    return {
        "mlp.fc.weight": torch.cat([up, gate], dim=1),
        "mlp.proj.weight": down.chunk(moe_tp, dim=2)[moe_tp_rank],
        "mlp.router.weight": hf[f"{p}gate.weight"].float(),
    }


@pytest.mark.parametrize("tp, ep", PARALLEL)
def test_every_rank_holds_the_hand_split_experts(parallel, tp, ep):
    target_dir, _, checkpoints = parallel
    hf = load_file(target_dir / "model.safetensors")
    config = json.loads((checkpoints[tp, ep] / "config.json").read_text())
    assert config["mapping"] | {} == {
        "world_size": tp,
        "tp_size": tp,
        "pp_size": 1,
        "moe_tp_size": tp // ep,
        "moe_ep_size": ep,
    }
    assert config["moe"] == {"num_experts": 4, "top_k": 2, "normalization_mode": 1}
    for rank in range(tp):
        stored = load_file(checkpoints[tp, ep] / f"rank{rank}.safetensors")
        assert not any(name.startswith("transformer.layers.1.mlp.router") for name in stored)  # the dense layer
        for layer in (0, 2, 3):
            for leaf, want in _hand_split(hf, layer, 4, tp, ep, rank).items():
                got = stored[f"transformer.layers.{layer}.{leaf}"]
                assert got.dtype == want.dtype and torch.equal(got, want), (tp, ep, rank, layer, leaf)


def test_shards_verify_and_decode_like_tp1(parallel):
    target_dir, draft_dir, checkpoints = parallel
    want = speculative_generate(load_golden_model(checkpoints[1, 1]), PROMPTS, 20)
    for (tp, ep), ckpt in checkpoints.items():
        report = verify_checkpoint(ckpt, target_dir, draft_dir)
        assert report.ok, report.verdict()
        got = speculative_generate(load_golden_model(ckpt), PROMPTS, 20)
        assert [(r.output_ids, r.acceptance_lengths) for r in got] == [
            (r.output_ids, r.acceptance_lengths) for r in want
        ], (tp, ep)


def test_experts_are_written_one_at_a_time(parallel, tmp_path, monkeypatch):
    """A stacked expert tensor is never assembled: it arrives one expert's part per block."""
    from dflash_trt.checkpoint.safetensors_io import StreamingSafetensorsWriter

    target_dir, draft_dir, _ = parallel
    blocks: dict[str, list[int]] = {}  # bytes of each block appended to the last rank's file
    original_start, original_append = StreamingSafetensorsWriter.start, StreamingSafetensorsWriter.append

    def start(self, name):
        if self.path.name == "rank3.safetensors":
            blocks[name] = []
        return original_start(self, name)

    def append(self, data):
        if self.path.name == "rank3.safetensors":
            blocks[self._order[self._next]].append(data.nbytes)
        return original_append(self, data)

    monkeypatch.setattr(StreamingSafetensorsWriter, "start", start)
    monkeypatch.setattr(StreamingSafetensorsWriter, "append", append)
    convert_checkpoint(target_dir, draft_dir, tmp_path / "out", dtype="bfloat16", tp_size=4, moe_ep_size=2)
    # the last rank's two experts, each cut to its half of the up and gate rows (16 + 16 of 64 bf16 columns) and of
    # the down columns (64 rows of 16)
    assert blocks["transformer.layers.0.mlp.fc.weight"] == [16 * 64 * 2] * 4
    assert blocks["transformer.layers.0.mlp.proj.weight"] == [64 * 16 * 2] * 2


# --------------------------------------------------------------------------------------------------- hostile
def _broken_pair(tmp_path, edit_tensors=None, edit_config=None):
    target_dir, draft_dir = make_pair(tmp_path, VARIANTS["e4-top2-norm-dense1"])
    if edit_tensors is not None:
        tensors = load_file(target_dir / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, target_dir / "model.safetensors", metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((target_dir / "config.json").read_text())
        edit_config(config)
        (target_dir / "config.json").write_text(json.dumps(config))
    return target_dir, draft_dir


E0 = "model.layers.0.mlp.experts"
HOSTILE = {
    "missing expert": (lambda t: t.pop(f"{E0}.3.up_proj.weight"), None, "missing tensor 'model.layers.0.mlp.experts.3"),
    "extra expert": (
        lambda t: t.update({f"{E0}.4.up_proj.weight": t[f"{E0}.0.up_proj.weight"].clone()}),
        None,
        "unexpected tensor 'model.layers.0.mlp.experts.4",
    ),
    "fewer experts than config": (None, lambda c: c.update(num_local_experts=8), "missing tensor"),
    "more experts than config": (None, lambda c: c.update(num_local_experts=2), "unexpected tensor"),
    "router shape": (
        lambda t: t.update({"model.layers.0.mlp.gate.weight": torch.zeros(3, 64)}),
        None,
        r"'model.layers.0.mlp.gate.weight' has shape \(3, 64\), expected \(4, 64\)",
    ),
    "expert shape": (
        lambda t: t.update({f"{E0}.1.down_proj.weight": torch.zeros(64, 16)}),
        None,
        "down_proj.weight' has shape",
    ),
    "router on a dense layer": (
        lambda t: t.update({"model.layers.1.mlp.gate.weight": torch.zeros(4, 64)}),
        None,
        "unexpected tensor 'model.layers.1.mlp.gate.weight'",
    ),
    "NaN in an expert": (
        lambda t: t[f"{E0}.2.gate_proj.weight"].__setitem__((0, 0), float("nan")),
        None,
        "contains NaN or Inf",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_moe_checkpoints_are_refused_with_one_line(tmp_path, capsys, case):
    edit_tensors, edit_config, message = HOSTILE[case]
    target_dir, draft_dir = _broken_pair(tmp_path, edit_tensors, edit_config)
    capsys.readouterr()  # the fixture writer's progress output
    out = tmp_path / "out"
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
            "2",
            "--moe_ep_size",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not out.exists()


@pytest.mark.parametrize(
    "tp, ep, message",
    [
        (2, 4, "--moe_ep_size must divide tp_size"),
        (3, 3, "cannot be split"),  # 4 attention heads over 3 ranks
        (4, 0, "--moe_ep_size must divide"),
    ],
)
def test_parallel_sizes_that_cannot_split_are_refused(parallel, tmp_path, tp, ep, message):
    target_dir, draft_dir, _ = parallel
    with pytest.raises(DFlashTrtError, match=message):
        convert_checkpoint(target_dir, draft_dir, tmp_path / "out", tp_size=tp, moe_ep_size=ep)


def test_expert_parallel_on_a_dense_target_and_nvfp4_experts_are_refused(tmp_path):
    target_dir, draft_dir = make_pair(tmp_path / "dense", PairVariant())
    with pytest.raises(DFlashTrtError, match="mixture-of-experts targets only"):
        convert_checkpoint(target_dir, draft_dir, tmp_path / "out", tp_size=2, moe_ep_size=2)
    moe_target, moe_draft = make_pair(tmp_path / "moe", VARIANTS["e2-top1-tied"])
    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"input_ids": [3, 4, 5]}\n')
    with pytest.raises(DFlashTrtError, match="use --qformat fp8 for MoE targets"):
        convert_checkpoint(moe_target, moe_draft, tmp_path / "q", qformat="nvfp4", calib_dataset=calib)
    assert not (tmp_path / "q").exists()


# ------------------------------------------------------------------------------------------------- engine plan
def test_engine_plan_builds_all_sparse_targets_and_refuses_dense_layers_among_them(parallel, converted, tmp_path):
    from dflash_trt.trtllm.build_plan import plan_engine_build
    from dflash_trt.trtllm.build_settings import EngineBuildSettings

    settings = EngineBuildSettings(max_seq_len=256, max_input_len=128)  # within the tiny targets' positions
    golden, _, _ = converted
    _, _, checkpoints = parallel  # layer 1 of that target keeps a dense MLP
    with pytest.raises(DFlashTrtError, match=r"dense MLPs on layers \[1\]"):
        plan_engine_build(checkpoints[2, 2], tmp_path / "e", settings, plugin_library="/x.so")
    spec = golden.target.spec
    if len(spec.moe.sparse_layers) == spec.num_hidden_layers:
        ckpt = tmp_path / "all_sparse"
        ckpt.mkdir()
        (ckpt / "config.json").write_text(json.dumps(golden.config))
        plan = plan_engine_build(ckpt, tmp_path / "e", settings, plugin_library="/x.so", require_weights=False)
        assert plan.dflash_manifest["tp_size"] == 1


# ------------------------------------------------------------------------------------------- sizing and plan
CODER_DRAFTER = {
    "architectures": ["DFlashDraftModel"],
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 12, 23, 34, 45]},
}


def test_profile_sizing_holds_every_expert():
    from pathlib import Path

    from dflash_trt.pipeline.profiles import load_profile, weight_bytes_per_gpu
    from dflash_trt.spec import parse_draft_config

    root = Path(__file__).resolve().parents[2]
    profile = load_profile(root / "build_configs/h100-fp8/qwen3-coder-30b-a3b.yaml")
    attention = 2048 * (32 + 2 * 4) * 128 + 32 * 128 * 2048
    router = 2048 * 128  # costed with the linears
    target = 48 * (attention + 128 * 3 * 2048 * 768 + router)
    draft = 8 * (attention + 3 * 2048 * 6144)
    fc = 5 * 2048 * 2048
    embeddings = 2 * 151936 * 2048
    assert 30e9 < target + embeddings < 31.5e9  # the published 30.5B
    want = embeddings * 2 + fc * 2 + (target + draft) * 1  # bf16 embeddings, lm_head and fc; FP8 linears; tp 1
    target_spec = parse_target_config(CODER_30B_A3B)
    draft_spec = parse_draft_config(CODER_DRAFTER, target_spec)
    assert weight_bytes_per_gpu(profile, target_spec, draft_spec) == pytest.approx(want)


def test_plan_costs_a_moe_target_by_its_active_experts(tmp_path, capsys):
    from dflash_trt.analysis.shapes import target_from_spec

    stack = target_from_spec(parse_target_config(CODER_30B_A3B)).stack
    assert (stack.num_experts, stack.experts_per_token, stack.intermediate) == (128, 8, 768)
    assert stack.experts_touched(1) == pytest.approx(8) and stack.experts_touched(4096) == pytest.approx(128)
    for name, config in (("target", CODER_30B_A3B), ("draft", CODER_DRAFTER)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    argv = [
        "plan",
        "--model_dir",
        str(tmp_path / "target"),
        "--dflash_model_dir",
        str(tmp_path / "draft"),
        "--gpu",
        "h200",
        "--qformat",
        "fp8",
        "--acceptance_length",
        "4",
        "--concurrency",
        "1,64",
        "--json",
    ]
    assert main(argv) == 0
    curves = json.loads(capsys.readouterr().out)["curves"]
    assert [p["concurrency"] for p in curves["dflash"]] == [1, 64]


def test_verify_catches_a_changed_expert_slice(parallel, tmp_path):
    import shutil

    target_dir, draft_dir, checkpoints = parallel
    ckpt = tmp_path / "tampered"
    shutil.copytree(checkpoints[4, 2], ckpt)
    tensors = load_file(ckpt / "rank3.safetensors")
    tensors["transformer.layers.2.mlp.proj.weight"][1, 5, 3] += 1.0  # rank 3: experts 2-3, second slice
    save_file(tensors, ckpt / "rank3.safetensors", metadata={"format": "pt"})
    report = verify_checkpoint(ckpt, target_dir, draft_dir)
    assert report.problems == [
        "rank3.safetensors tensor 'transformer.layers.2.mlp.proj.weight' differs from its source"
    ]
