"""Quantized conversion end to end: stored tensors per format, TP, verify, and the golden model on the result."""

from __future__ import annotations

import json

import pytest
import torch
from _pairs import PairVariant, make_pair
from safetensors.torch import load_file, save_file

from dflash_trt import tensor_names as names
from dflash_trt.cli import main
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.conversion.verify import verify_checkpoint
from dflash_trt.errors import DFlashTrtError
from dflash_trt.quant.fp8 import quantize_fp8
from dflash_trt.quant.nvfp4 import quantize_nvfp4
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def calibrated_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    target_dir, draft_dir = make_pair(root, PairVariant(intermediate=128, draft_intermediate=64))
    calib = root / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"input_ids": [i, i + 1, 5, 6, i % 7 + 2]}) for i in range(10, 40)) + "\n")
    return target_dir, draft_dir, calib


def _convert(calibrated_pair, out, **kwargs):
    target_dir, draft_dir, calib = calibrated_pair
    convert_checkpoint(target_dir, draft_dir, out, dtype="bfloat16", calib_dataset=calib, calib_size=12, **kwargs)
    return out


@pytest.mark.parametrize("qformat", ["fp8", "nvfp4"])
def test_stored_tensors_match_quantizers_of_the_source_weights(calibrated_pair, tmp_path, qformat):
    ckpt = _convert(calibrated_pair, tmp_path / "ckpt", qformat=qformat, kv_cache_dtype="fp8")
    stored = load_file(ckpt / "rank0.safetensors")
    hf = load_file(calibrated_pair[0] / "model.safetensors")
    qkv = torch.cat([hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]).to(torch.bfloat16)
    prefix = f"{names.target_layer(1)}.{names.QKV}"
    if qformat == "fp8":
        want = quantize_fp8(qkv)
        assert stored[f"{prefix}.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(stored[f"{prefix}.weight"].view(torch.uint8), want.weight.view(torch.uint8))
    else:
        want = quantize_nvfp4(qkv)
        assert torch.equal(stored[f"{prefix}.weight"], want.weight)
        assert torch.equal(stored[f"{prefix}.{names.WEIGHTS_SCALING_FACTOR_2}"], want.weights_scaling_factor_2)
    assert torch.equal(stored[f"{prefix}.{names.WEIGHTS_SCALING_FACTOR}"].float(), want.weights_scaling_factor.float())
    assert stored[f"{prefix}.{names.ACTIVATION_SCALING_FACTOR}"].dtype == torch.float32
    assert stored[names.kv_cache_scale(names.draft_layer(0))].dtype == torch.float32
    # lm_head and the drafter's fc stay in the checkpoint dtype; so do norms and the embedding.
    for kept in (names.LM_HEAD, names.DRAFT_FC, names.VOCAB_EMBEDDING, names.DRAFT_HIDDEN_NORM):
        assert stored[kept].dtype == torch.bfloat16
    shared = names.WEIGHTS_SCALING_FACTOR_2 if qformat == "nvfp4" else names.WEIGHTS_SCALING_FACTOR
    fc, gate = (f"{names.draft_layer(0)}.{m}.{shared}" for m in (names.MLP_FC, names.MLP_GATE))
    assert torch.equal(stored[fc], stored[gate])  # one GEMM in the engine, one scale
    config = json.loads((ckpt / "config.json").read_text())
    algo = {"fp8": "FP8", "nvfp4": "NVFP4"}[qformat]
    assert config["quantization"]["quant_algo"] == algo and config["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert config["dflash_config"]["quantization"]["quant_algo"] == algo
    assert verify_checkpoint(ckpt, calibrated_pair[0], calibrated_pair[1]).ok


def test_tensor_parallel_quantized_checkpoint_decodes_like_tp1(calibrated_pair, tmp_path):
    outputs = []
    for tp in (1, 2):
        ckpt = _convert(calibrated_pair, tmp_path / f"tp{tp}", qformat="nvfp4", tp_size=tp)
        assert verify_checkpoint(ckpt, calibrated_pair[0], calibrated_pair[1]).ok
        model = load_golden_model(ckpt)
        spec = speculative_generate(model, PROMPTS, 16)
        alone = speculative_generate(model, PROMPTS, 16, block_size=1)
        assert [r.output_ids for r in spec] == [r.output_ids for r in alone]  # lossless w.r.t. the quantized target
        outputs.append([r.output_ids for r in spec])
    assert outputs[0] == outputs[1]


def test_drafter_format_may_differ_from_the_target(calibrated_pair, tmp_path):
    ckpt = _convert(calibrated_pair, tmp_path / "ckpt", qformat="fp8", dflash_qformat="none")
    stored = load_file(ckpt / "rank0.safetensors")
    assert stored[f"{names.target_layer(0)}.{names.QKV}.weight"].dtype == torch.float8_e4m3fn
    assert stored[f"{names.draft_layer(0)}.{names.QKV}.weight"].dtype == torch.bfloat16
    assert not any(name.startswith("dflash.") and name.endswith("scaling_factor") for name in stored)


def test_verify_catches_a_tampered_weight_scale(calibrated_pair, tmp_path):
    ckpt = _convert(calibrated_pair, tmp_path / "ckpt", qformat="fp8")
    tensors = load_file(ckpt / "rank0.safetensors")
    name = f"{names.target_layer(2)}.{names.MLP_PROJ}.{names.WEIGHTS_SCALING_FACTOR}"
    tensors[name] = tensors[name] * 1.5
    (ckpt / "rank0.safetensors").unlink()
    save_file(tensors, ckpt / "rank0.safetensors")
    report = verify_checkpoint(ckpt, calibrated_pair[0], calibrated_pair[1])
    assert not report.ok and any(name in problem for problem in report.problems)


def test_quantization_refusals(calibrated_pair, tmp_path, capsys):
    target_dir, draft_dir, calib = calibrated_pair
    with pytest.raises(DFlashTrtError, match="quantization needs --calib_dataset"):
        convert_checkpoint(target_dir, draft_dir, tmp_path / "a", qformat="fp8")
    odd_target, odd_draft = make_pair(tmp_path / "odd", PairVariant(intermediate=128, draft_intermediate=96))
    with pytest.raises(DFlashTrtError, match="96 in-features to split into whole blocks of 16 per rank"):
        convert_checkpoint(odd_target, odd_draft, tmp_path / "b", qformat="nvfp4", tp_size=4, calib_dataset=calib)
    code = main(
        [
            "convert",
            "--model_dir",
            str(target_dir),
            "--dflash_model_dir",
            str(draft_dir),
            "--output_dir",
            str(tmp_path / "c"),
            "--qformat",
            "fp8",
            "--calib_dataset",
            str(tmp_path / "missing.jsonl"),
        ]
    )
    assert code == 2 and "missing.jsonl does not exist" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd"]
