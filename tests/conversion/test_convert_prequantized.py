"""A modelopt-exported (pre-quantized) target through the converter: its quantized linears and scales are carried
over, the bf16 drafter is quantized and calibrated, verify passes, and decoding stays lossless."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _pairs import make_pair
from safetensors.torch import load_file

from dflash_trt import tensor_names as names
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.conversion.prequantized import fuse_prequantized
from dflash_trt.conversion.verify import verify_checkpoint
from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model

mtq = pytest.importorskip("modelopt.torch.quantization")
PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10]]


def _export(target_dir, qformat, out):
    """modelopt's own PTQ + unified HF export: the oracle input format."""
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG if qformat == "fp8" else mtq.NVFP4_DEFAULT_CFG)
    cfg["quant_cfg"] = cfg["quant_cfg"] + copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    ids = torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(0))
    mtq.quantize(model, cfg, forward_loop=lambda m: m(input_ids=ids))
    export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=str(out))
    return out


@pytest.fixture(scope="module")
def prequantized_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prequantized")
    target_dir, draft_dir = make_pair(root)
    calib = root / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"input_ids": [i, i + 1, 5, 6]}) for i in range(10, 30)) + "\n")
    return target_dir, draft_dir, calib, root


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("qformat", ["fp8", "nvfp4"])
def test_prequantized_target_is_carried_over(prequantized_inputs, tmp_path, qformat):
    target_dir, draft_dir, calib, root = prequantized_inputs
    exported = _export(target_dir, qformat, root / f"exported-{qformat}")
    ckpt = tmp_path / "ckpt"
    convert_checkpoint(exported, draft_dir, ckpt, dtype="bfloat16", calib_dataset=calib, calib_size=8)
    stored = load_file(ckpt / "rank0.safetensors")
    source = load_file(exported / "model.safetensors")
    parts = [
        {
            k.split(f"model.layers.1.self_attn.{p}_proj.")[1]: v
            for k, v in source.items()
            if k.startswith(f"model.layers.1.self_attn.{p}_proj.")
        }
        for p in "qkv"
    ]
    fused = fuse_prequantized(parts, qformat)
    prefix = f"{names.target_layer(1)}.{names.QKV}"
    for leaf, tensor in fused.items():
        got = stored[f"{prefix}.{leaf}"]
        assert got.dtype == tensor.dtype, leaf
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), leaf
    k_scale = source["model.layers.1.self_attn.k_proj.k_scale"]
    v_scale = source["model.layers.1.self_attn.v_proj.v_scale"]
    assert float(stored[names.kv_cache_scale(names.target_layer(1))]) == max(float(k_scale), float(v_scale))
    config = json.loads((ckpt / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == qformat.upper()
    assert config["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert config["dflash_config"]["quantization"]["quant_algo"] == qformat.upper()  # drafter follows the target
    assert names.tensor(names.draft_layer(0), names.QKV, names.ACTIVATION_SCALING_FACTOR) in stored
    assert verify_checkpoint(ckpt, exported, draft_dir).ok
    model = load_golden_model(ckpt)
    spec = speculative_generate(model, PROMPTS, 16)
    alone = speculative_generate(model, PROMPTS, 16, block_size=1)
    assert [r.output_ids for r in spec] == [r.output_ids for r in alone]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_prequantized_target_refuses_another_format(prequantized_inputs, tmp_path):
    target_dir, draft_dir, calib, root = prequantized_inputs
    exported = _export(target_dir, "fp8", root / "exported-refuse")
    with pytest.raises(DFlashTrtError, match="pre-quantized as fp8; --qformat must be fp8 or omitted"):
        convert_checkpoint(exported, draft_dir, tmp_path / "a", qformat="nvfp4", calib_dataset=calib)
    with pytest.raises(DFlashTrtError, match="quantization needs --calib_dataset"):
        convert_checkpoint(exported, draft_dir, tmp_path / "b", dflash_qformat="none")  # its FP8 KV needs a scale
    # Weights only, drafter unquantized, KV cache in bf16: nothing to calibrate.
    convert_checkpoint(exported, draft_dir, tmp_path / "c", dflash_qformat="none", kv_cache_dtype="none")
    assert verify_checkpoint(tmp_path / "c", exported, draft_dir).ok
    assert not any(name.endswith("kv_cache_scaling_factor") for name in load_file(tmp_path / "c" / "rank0.safetensors"))
