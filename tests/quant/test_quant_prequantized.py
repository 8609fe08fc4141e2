"""Pre-quantized modelopt unified-HF checkpoints: carried into TensorRT-LLM's fused linears.

Oracle: modelopt 0.47 quantizes and exports (`export_hf_checkpoint`) a random HF target; fusing its per-projection
tensors must give what our own quantizers give for the fused bf16 weights (bit for bit for NVFP4, whose global
scales modelopt shares; within one FP8 rounding for FP8, whose weight scales it leaves per projection).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_trt import tensor_names as names
from dflash_trt.conversion.prequantized import (
    fuse_prequantized,
    prequantized_kv_cache_scale,
    prequantized_layer_tensors,
    read_hf_quant_config,
)
from dflash_trt.errors import DFlashTrtError
from dflash_trt.quant.fp8 import dequantize_fp8, quantize_fp8
from dflash_trt.quant.linears import quantize_tensors
from dflash_trt.quant.nvfp4 import quantize_nvfp4, quantize_nvfp4_shared

mtq = pytest.importorskip("modelopt.torch.quantization")

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


@pytest.fixture(scope="module")
def target_dir(pair: tuple[Path, Path]) -> Path:
    return pair[0]


def _export(target_dir: Path, qformat: str, out: Path) -> tuple[dict, dict]:
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG if qformat == "fp8" else mtq.NVFP4_DEFAULT_CFG)
    cfg["quant_cfg"] = cfg["quant_cfg"] + copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    ids = torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(0))
    mtq.quantize(model, cfg, forward_loop=lambda m: m(input_ids=ids))
    export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=str(out))
    return original, load_file(str(out / "model.safetensors"))


def _parts(exported: dict, layer: int, members: tuple[str, ...]) -> list[dict]:
    parts = []
    for member in members:
        prefix = f"model.layers.{layer}.{member}."
        parts.append({k[len(prefix) :]: v for k, v in exported.items() if k.startswith(prefix)})
    return parts


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_nvfp4_prequantized_fuses_bit_exactly(target_dir: Path, tmp_path: Path) -> None:
    original, exported = _export(target_dir, "nvfp4", tmp_path / "hf")
    fmt = read_hf_quant_config(tmp_path / "hf")
    assert (fmt.qformat, fmt.kv_cache_dtype) == ("nvfp4", "fp8")
    for layer in range(2):
        qkv = fuse_prequantized(_parts(exported, layer, QKV), "nvfp4")
        ours = quantize_nvfp4(torch.cat([original[f"model.layers.{layer}.{m}.weight"] for m in QKV]))
        assert torch.equal(qkv[names.WEIGHT], ours.weight)
        assert torch.equal(
            qkv[names.WEIGHTS_SCALING_FACTOR].view(torch.uint8), ours.weights_scaling_factor.view(torch.uint8)
        )
        assert torch.equal(qkv[names.WEIGHTS_SCALING_FACTOR_2], ours.weights_scaling_factor_2)
        assert qkv[names.ACTIVATION_SCALING_FACTOR].shape == ()
        fused = [fuse_prequantized(p, "nvfp4") for p in ([part] for part in _parts(exported, layer, GATE_UP))]
        shared = quantize_nvfp4_shared([original[f"model.layers.{layer}.{m}.weight"] for m in GATE_UP])
        for got, want in zip(fused, shared, strict=True):
            assert torch.equal(got[names.WEIGHT], want.weight)
            assert torch.equal(got[names.WEIGHTS_SCALING_FACTOR_2], want.weights_scaling_factor_2)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fp8_prequantized_fuses_within_one_rounding(target_dir: Path, tmp_path: Path) -> None:
    original, exported = _export(target_dir, "fp8", tmp_path / "hf")
    parts = _parts(exported, 0, QKV)
    qkv = fuse_prequantized(parts, "fp8")
    direct = quantize_fp8(torch.cat([original[f"model.layers.0.{m}.weight"] for m in QKV]))
    assert torch.equal(qkv[names.WEIGHTS_SCALING_FACTOR], direct.weights_scaling_factor)
    assert qkv[names.WEIGHTS_SCALING_FACTOR].shape == qkv[names.ACTIVATION_SCALING_FACTOR].shape == (1,)
    scale = direct.weights_scaling_factor
    got, want = dequantize_fp8(qkv[names.WEIGHT], scale), dequantize_fp8(direct.weight, scale)
    assert bool(((got - want).abs() <= want.abs() * 2**-3 + scale * 2**-9).all())
    # The member owning the largest scale keeps its bytes.
    owner = max(range(3), key=lambda i: float(parts[i]["weight_scale"]))
    rows = [0, 64, 96, 128]
    assert torch.equal(
        qkv[names.WEIGHT][rows[owner] : rows[owner + 1]].view(torch.uint8), parts[owner]["weight"].view(torch.uint8)
    )
    k, v = parts[1]["k_scale"], parts[2]["v_scale"]
    assert prequantized_kv_cache_scale(k, v).tolist() == [max(float(k), float(v))]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_nvfp4_layers_carry_over_as_our_own_quantization(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """Whole layers: every weight-side tensor equals quantizing our bf16 conversion of the same target."""
    from dflash_trt.conversion.convert import convert_checkpoint

    _, exported = _export(pair[0], "nvfp4", tmp_path / "hf")
    fmt = read_hf_quant_config(tmp_path / "hf")
    convert_checkpoint(*pair, tmp_path / "ckpt", dtype="bfloat16")
    ours = quantize_tensors(load_file(str(tmp_path / "ckpt" / "rank0.safetensors")), "nvfp4")
    carried = {}
    for layer in range(4):
        carried.update(prequantized_layer_tensors(exported, f"model.layers.{layer}", names.target_layer(layer), fmt))
    weight_side = {
        n
        for n in ours
        if n.startswith("transformer.layers.")
        and n.rsplit(".", 1)[1] in (names.WEIGHTS_SCALING_FACTOR, names.WEIGHTS_SCALING_FACTOR_2)
    }
    weight_side |= {n.rsplit(".", 1)[0] + ".weight" for n in weight_side}
    assert weight_side <= set(carried)
    for name in weight_side:
        a, b = carried[name], ours[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name
    assert carried[names.kv_cache_scale(names.target_layer(3))].shape == (1,)
    assert carried["transformer.layers.0.mlp.fc.activation_scaling_factor"].shape == ()


def test_hf_quant_config_errors(tmp_path: Path) -> None:
    assert read_hf_quant_config(tmp_path) is None
    path = tmp_path / "hf_quant_config.json"
    path.write_text(json.dumps({"quantization": {"quant_algo": "W4A16_AWQ"}}))
    with pytest.raises(DFlashTrtError, match="not supported"):
        read_hf_quant_config(tmp_path)
    path.write_text("[]")
    with pytest.raises(DFlashTrtError, match="not a modelopt quantization config"):
        read_hf_quant_config(tmp_path)
    with pytest.raises(DFlashTrtError, match="no 'input_scale'"):
        fuse_prequantized([{"weight": torch.zeros(2, 2)}], "fp8")
