"""Calibration inside the speculative loop, against modelopt calibrating the reference implementation.

Oracle: modelopt quantizes the HF target and the `dflash` reference drafter (FP8 + FP8 KV configs) and calibrates
both while `dflash.model.dflash_generate` decodes each prompt alone. Our golden model decodes the same prompts as
one ragged batch under `observe_amax`; every linear-input and K/V amax must agree (fp32 op-order tolerance), which
checks the valid-row masking, the drafter's two qkv inputs and the layer attribution of every observation.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch

from dflash_trt import tensor_names as names
from dflash_trt.conversion import calibrate as cal
from dflash_trt.errors import DFlashTrtError

mtq = pytest.importorskip("modelopt.torch.quantization")
reference = pytest.importorskip("dflash.model")

PROMPTS = [[3, 4, 5, 6, 7], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
MAX_NEW = 12
HF_LINEARS = {
    names.DENSE: ("self_attn.o_proj",),
    names.MLP_FC: ("mlp.gate_proj",),
    names.MLP_GATE: ("mlp.up_proj",),
    names.MLP_PROJ: ("mlp.down_proj",),
    names.QKV: ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
}


@pytest.fixture(scope="module")
def golden(converted: Path):
    from dflash_trt.reference.model import load_golden_model

    return load_golden_model(converted)


@pytest.fixture(scope="module")
def modelopt_calibrated(pair: tuple[Path, Path]):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(pair[0]).eval()
    draft = reference.DFlashDraftModel.from_pretrained(pair[1]).eval()
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    cfg["quant_cfg"] = cfg["quant_cfg"] + copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    timer = reference._cuda_time
    reference._cuda_time = time.perf_counter  # the reference times steps with CUDA events

    def decode(_) -> None:
        with torch.no_grad():
            for prompt in PROMPTS:
                reference.dflash_generate(draft, target, torch.tensor([prompt]), MAX_NEW, None)

    try:
        # Nested so both models are calibrating during the same decoding runs.
        mtq.quantize(
            target,
            copy.deepcopy(cfg),
            forward_loop=lambda _: mtq.quantize(draft, copy.deepcopy(cfg), forward_loop=decode),
        )
    finally:
        reference._cuda_time = timer
    return target, draft


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.float(), b.float(), rtol=1e-5, atol=0)


def test_amax_matches_modelopt_on_reference_decoding(golden, modelopt_calibrated) -> None:
    target, draft = modelopt_calibrated
    amax = cal.calibrate(golden, PROMPTS, MAX_NEW)
    pairs = [(target.model.layers, names.target_layer), (draft.layers, names.draft_layer)]
    for hf_layers, prefix in pairs:
        for index, hf_layer in enumerate(hf_layers):
            for module, hf_names in HF_LINEARS.items():
                theirs = torch.stack([hf_layer.get_submodule(n).input_quantizer.amax for n in hf_names]).max()
                ours = amax.input_amax(f"{prefix(index)}.{module}")
                assert _close(ours, theirs), (prefix(index), module, float(ours), float(theirs))
            attention = hf_layer.self_attn
            kv = torch.maximum(attention.k_bmm_quantizer.amax, attention.v_bmm_quantizer.amax)
            assert _close(amax.kv_amax(prefix(index)), kv), (prefix(index), "kv")
    assert _close(amax.input_amax("dflash.fc"), draft.fc.input_quantizer.amax)


def test_calibration_tensors_names_and_shapes(golden) -> None:
    amax = cal.calibrate(golden, PROMPTS[:1], 4)
    fp8 = cal.calibration_tensors(amax, "fp8", "fp8")
    nvfp4 = cal.calibration_tensors(amax, "nvfp4", "none")
    layers = [names.target_layer(i) for i in range(len(golden.target.layers))]
    layers += [names.draft_layer(i) for i in range(len(golden.draft.layers))]
    linears = [f"{layer}.{m}" for layer in layers for m in names.LINEAR_MODULES]
    assert set(fp8) == {f"{m}.{names.ACTIVATION_SCALING_FACTOR}" for m in linears} | {
        names.kv_cache_scale(layer) for layer in layers
    }
    assert set(nvfp4) == {f"{m}.{names.ACTIVATION_SCALING_FACTOR}" for m in linears}
    assert all(t.dtype == torch.float32 and t.shape == (1,) for t in fp8.values())
    assert all(t.dtype == torch.float32 and t.shape == () for t in nvfp4.values())
    assert all(float(fp8[names.kv_cache_scale(layer)]) >= 1.0 for layer in layers)
    # mlp.fc and mlp.gate run as one GEMM: one activation scale.
    fc, gate = (fp8[f"transformer.layers.2.{m}.{names.ACTIVATION_SCALING_FACTOR}"] for m in ("mlp.fc", "mlp.gate"))
    assert torch.equal(fc, gate)
    # The excluded drafter fc gets no activation scale.
    assert not any(name.startswith("dflash.fc.") for name in fp8)


@pytest.mark.parametrize("qformat", ["fp8", "nvfp4"])
def test_drafter_pass_sees_the_quantized_target(golden, qformat: str) -> None:
    """Second pass: target amaxes unchanged, drafter amaxes from the quantized target's (different) features."""
    plain = cal.calibrate(golden, PROMPTS, 6)
    pair = cal.calibrate_pair(golden, PROMPTS, 6, qformat, "fp8")
    assert pair.names() == plain.names()
    for name in plain.names():
        if name.startswith("transformer."):
            assert torch.equal(pair.amax(name), plain.amax(name))
    fc = "dflash.fc"
    assert not torch.equal(pair.input_amax(fc), plain.input_amax(fc))
    # Relative shift of the tap features: small (quantization noise), larger for NVFP4 than it could be for FP8.
    shift = float((pair.input_amax(fc) - plain.input_amax(fc)).abs() / plain.input_amax(fc))
    assert shift < (0.1 if qformat == "fp8" else 0.3)
    # The golden model is restored afterwards: a plain pass reproduces the first one exactly.
    again = cal.calibrate(golden, PROMPTS, 6)
    assert all(torch.equal(again.amax(n), plain.amax(n)) for n in plain.names())


def test_calibrate_checkpoint_for_the_converter(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """The converter's entry point: prompt file in, scales out; the drafter may use its own format."""
    from dflash_trt.checkpoint.stored import QuantSettings
    from dflash_trt.conversion.convert import convert_checkpoint

    convert_checkpoint(*pair, tmp_path / "ckpt", dtype="bfloat16")
    dataset = tmp_path / "calib.jsonl"
    dataset.write_text("\n".join(json.dumps({"input_ids": p}) for p in PROMPTS) + "\n")
    quant = QuantSettings(qformat="nvfp4", dflash_qformat="fp8", kv_cache_dtype="fp8")
    scales = cal.calibrate_checkpoint(
        tmp_path / "ckpt", quant, dataset, calib_size=2, calib_max_seq_len=4, max_new_tokens=5
    )
    qkv = f"attention.qkv.{names.ACTIVATION_SCALING_FACTOR}"
    assert scales[f"transformer.layers.0.{qkv}"].shape == ()  # NVFP4 target
    assert scales[f"dflash.layers.0.{qkv}"].shape == (1,)  # FP8 drafter
    assert names.kv_cache_scale("dflash.layers.1") in scales
    with pytest.raises(DFlashTrtError, match="calib_size"):
        cal.calibrate_checkpoint(tmp_path / "ckpt", quant, dataset, calib_size=0)
