"""Qwen3-MoE targets through the emulated engine: `dflash_trt/trtllm/model.py` (unmodified) builds the stock
Qwen3-MoE decoder layers, whose `MixtureOfExperts` stand-ins (`dflash_trt/emulation/moe.py`) follow 1.2.x
`layers/moe.py`, against the golden model's own routing (`reference/model.py` `SparseMlp`).

All-sparse tiny random pairs (the build refuses dense layers among sparse ones), with and without `norm_topk_prob`.
Drafted tokens are compared per step, so a target whose MoE computes anything else shows even where the random
drafter is rarely accepted. The golden loop runs K tokens further (`divergences`), so it verifies a full block
wherever the engine does, greedy or sampled.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _emulation import PROMPTS, SAMPLED_TOKENS, STOP, convert, divergences, per_request, sampled_runs
from _pairs import PairVariant

from dflash_trt import cli
from dflash_trt.emulation import models
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.stand_ins import load_engine_module
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.emulated import decode_batch
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model

MOE_PAIRS = {
    # renormalized top-2 of 4 experts (Qwen3-Coder-30B-A3B's routing)
    "e4-top2-norm": PairVariant(
        arch="qwen3_moe",
        seed=3,
        moe={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
    ),
    # top-3 of 8 without renormalization, MQA target and drafter, tied embeddings
    "e8-top3-plain": PairVariant(
        arch="qwen3_moe",
        kv_heads=1,
        draft_kv_heads=1,
        tie=True,
        seed=5,
        moe={"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 16, "norm_topk_prob": False},
    ),
}
MAX_NEW = 10


@pytest.fixture(scope="module")
def moe_pairs(tmp_path_factory) -> dict[str, tuple[Path, list]]:
    """Each pair converted, with the golden model's greedy decoding of PROMPTS (K tokens further)."""
    pairs = {}
    for name, variant in MOE_PAIRS.items():
        ckpt = convert(tmp_path_factory.mktemp(name), variant)
        pairs[name] = ckpt, greedy_golden(ckpt)
    return pairs


def greedy_golden(ckpt: Path) -> list:
    model = load_golden_model(ckpt)
    return speculative_generate(model, PROMPTS, MAX_NEW + model.draft.spec.block_size - 1, STOP)


def emulate(ckpt: Path, prompts: list[list[int]] = PROMPTS) -> tuple[EmulatedEngine, list]:
    runtime = EmulatedEngine(ckpt, max_batch_size=2, tokens_per_block=16)
    return runtime, decode_batch(runtime, prompts, MAX_NEW, STOP)


@pytest.mark.parametrize("name", list(MOE_PAIRS))
def test_moe_targets_decode_like_the_golden_model(moe_pairs, name):
    ckpt, golden = moe_pairs[name]
    runtime, emulated = emulate(ckpt)
    assert divergences(ckpt, golden, emulated, MAX_NEW) == []
    assert runtime.model.unused_tensors == []
    layers = list(runtime.model.transformer.layers)
    assert all(type(layer.mlp).__name__ == "MixtureOfExperts" for layer in layers)


def test_sampled_decoding_of_a_moe_target(moe_pairs):
    ckpt, _ = moe_pairs["e8-top3-plain"]
    greedy, golden, emulated = sampled_runs(ckpt, PROMPTS[:3], "mixed", tokens_per_block=16)
    assert divergences(ckpt, golden, emulated, SAMPLED_TOKENS, per_request("mixed", 3)) == []
    assert any(g.output_ids != e.output_ids for g, e in zip(greedy[1:], emulated[1:], strict=True))


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.9", "--seed", "3"]], ids=["greedy", "sampled"])
def test_cli_emulate_decodes_a_moe_target_like_generate(moe_pairs, tmp_path, capsys, sampling):
    """`emulate` against `generate` run K tokens further: the same tokens, and the same acceptance lengths up to the
    engine's clipped last step."""
    ckpt, _ = moe_pairs["e4-top2-norm"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    args = ["--checkpoint_dir", str(ckpt), "--input_file", str(prompts), "--json", *sampling]
    k = load_golden_model(ckpt).draft.spec.block_size - 1
    assert cli.main(["generate", *args, "--max_new_tokens", str(MAX_NEW + k)]) == 0
    generated = json.loads(capsys.readouterr().out)["sequences"]
    assert cli.main(["emulate", *args, "--max_new_tokens", str(MAX_NEW), "--max_batch_size", "2"]) == 0
    emulated = json.loads(capsys.readouterr().out)["sequences"]
    for g, e in zip(generated, emulated, strict=True):
        assert e["output_ids"] == g["output_ids"][:MAX_NEW]
        steps = len(e["acceptance_lengths"])
        assert e["acceptance_lengths"][:-1] == g["acceptance_lengths"][: steps - 1]


# ------------------------------------------------------------------------------------ deliberately broken networks
def _caught(ckpt: Path, golden: list) -> bool:
    _, emulated = emulate(ckpt, PROMPTS[:2])
    return divergences(ckpt, golden[:2], emulated, MAX_NEW) != []


def test_experts_loaded_gate_first_are_caught(moe_pairs, monkeypatch):
    """A loader that stacks each expert's fc as [gate, up] instead of [up, gate]."""
    original = models.preprocess_weights

    def gate_first(weights, config):
        for name, tensor in weights.items():
            if name.endswith("mlp.fc.weight") and tensor.dim() == 3:
                weights[name] = torch.cat(tensor.chunk(2, dim=1)[::-1], dim=1)
        return original(weights, config)

    monkeypatch.setattr(models, "preprocess_weights", gate_first)
    assert _caught(*moe_pairs["e4-top2-norm"])


@pytest.mark.parametrize("name", list(MOE_PAIRS))
def test_flipped_renormalization_is_caught(moe_pairs, monkeypatch, name):
    """The target config routing with the other normalization mode (as TensorRT-LLM's own from_hugging_face writes
    NONE for qwen3_moe whatever norm_topk_prob says)."""
    engine = load_engine_module()
    original = engine.DFlashConfig.target_config

    def flipped(self):
        config = original(self)
        config.moe.normalization_mode = 1 - int(config.moe.normalization_mode)
        return config

    monkeypatch.setattr(engine.DFlashConfig, "target_config", flipped)
    assert _caught(*moe_pairs[name])


def test_dense_layers_among_sparse_ones_are_refused_like_the_build(tmp_path):
    variant = PairVariant(
        arch="qwen3_moe",
        moe={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1]},
    )
    with pytest.raises(DFlashTrtError, match="dense MLPs on layers \\[1\\]"):
        EmulatedEngine(convert(tmp_path, variant))


@pytest.mark.slow
def test_fp8_moe_checkpoint_with_fp8_kv_cache(tmp_path):
    pytest.importorskip("modelopt.torch.quantization")
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    ckpt = convert(
        tmp_path, MOE_PAIRS["e4-top2-norm"], qformat="fp8", kv_cache_dtype="fp8", calib_dataset=calib, calib_size=4
    )
    golden = greedy_golden(ckpt)
    runtime, emulated = emulate(ckpt)
    assert runtime.cache_dtype == torch.float8_e4m3fn
    assert runtime.model.transformer.layers[0].mlp.fc.weight.raw.dtype == torch.float8_e4m3fn
    assert divergences(ckpt, golden, emulated, MAX_NEW) == []
