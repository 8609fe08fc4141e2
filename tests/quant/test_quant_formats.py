"""Quantization formats of a converted checkpoint: config dict, exclusions, names, and the whole-model check that
quantizing our converter's output gives byte for byte what modelopt 0.47 exports for the same target."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_trt import formats
from dflash_trt import tensor_names as names
from dflash_trt.errors import DFlashTrtError
from dflash_trt.quant import linears
from dflash_trt.quant.fp8 import fp8_activation_scale, kv_cache_scale
from dflash_trt.quant.nvfp4 import nvfp4_activation_scale

WEIGHT_LEAVES = (names.WEIGHT, names.WEIGHTS_SCALING_FACTOR, names.WEIGHTS_SCALING_FACTOR_2)


# ---------------------------------------------------------------------------------------------- config / names
def test_quantization_config_dicts() -> None:
    assert formats.quantization_config("fp8", "fp8") == {
        "quant_algo": "FP8",
        "kv_cache_quant_algo": "FP8",
        "group_size": 16,
        "exclude_modules": [
            "lm_head",
            "dflash.fc",
            "transformer.layers.*.mlp.router",
            "dflash.layers.*.*_conv.kernel_projection",
            "dflash.selector.hidden_projection",
            "dflash.lm_head",
        ],
    }
    assert formats.quantization_config("nvfp4")["quant_algo"] == "NVFP4"
    assert formats.quantization_config("nvfp4")["kv_cache_quant_algo"] is None
    assert formats.quantization_config("none", "fp8") == {
        "quant_algo": None,
        "kv_cache_quant_algo": "FP8",
        "group_size": 16,
        "exclude_modules": [],
    }
    with pytest.raises(DFlashTrtError, match="--qformat must be one of none, fp8, nvfp4"):
        formats.quantization_config("int8")
    with pytest.raises(DFlashTrtError, match="--kv_cache_dtype"):
        formats.quantization_config("fp8", "nvfp4")


def test_which_tensors_are_quantized() -> None:
    quantized = {
        "transformer.layers.0.attention.qkv.weight": "transformer.layers.0.attention.qkv",
        "transformer.layers.11.attention.dense.weight": "transformer.layers.11.attention.dense",
        "transformer.layers.2.mlp.fc.weight": "transformer.layers.2.mlp.fc",
        "transformer.layers.2.mlp.gate.weight": "transformer.layers.2.mlp.gate",
        "dflash.layers.1.mlp.proj.weight": "dflash.layers.1.mlp.proj",
    }
    for name, module in quantized.items():
        assert formats.quantized_linear(name) == module
    kept = [
        names.LM_HEAD,
        names.DRAFT_FC,
        names.VOCAB_EMBEDDING,
        names.DRAFT_HIDDEN_NORM,
        names.TARGET_FINAL_NORM,
        "transformer.layers.0.attention.qkv.bias",
        "transformer.layers.0.input_layernorm.weight",
        "transformer.layers.0.attention.q_layernorm.weight",
        "dflash.layers.0.post_layernorm.weight",
        "transformer.layers.x.attention.qkv.weight",
        "other.layers.0.attention.qkv.weight",
    ]
    for name in kept:
        assert formats.quantized_linear(name) is None, name
    # Without the default exclusions lm_head and the drafter fc are ordinary linears.
    assert formats.quantized_linear(names.DRAFT_FC, exclude_modules=()) == "dflash.fc"
    assert formats.quantized_linear(names.LM_HEAD, exclude_modules=()) == "lm_head"
    assert formats.is_excluded("dflash.layers.3.mlp.fc", ["dflash.layers.*"])


def test_fused_partners() -> None:
    pair = ("transformer.layers.4.mlp.fc", "transformer.layers.4.mlp.gate")
    assert formats.fused_partners(pair[0]) == formats.fused_partners(pair[1]) == pair
    assert formats.fused_partners("dflash.fc") == ("dflash.fc",)
    assert formats.fused_partners("dflash.layers.0.attention.qkv") == ("dflash.layers.0.attention.qkv",)


def test_nvfp4_shape_checks() -> None:
    linears.check_quantizable("transformer.layers.0.mlp.proj.weight", (64, 96), "fp8", tp_size=4)
    with pytest.raises(DFlashTrtError, match="transformer.layers.0.attention.qkv.weight has 40"):
        linears.check_quantizable("transformer.layers.0.attention.qkv.weight", (64, 40), "nvfp4")
    # 96 in-features over 4 ranks is 24 per rank: not whole blocks for a row-parallel linear ...
    with pytest.raises(DFlashTrtError, match="tp_size 4"):
        linears.check_quantizable("transformer.layers.0.mlp.proj.weight", (64, 96), "nvfp4", tp_size=4)
    # ... but fine for a column-parallel one (rows are split) and for tp 2.
    linears.check_quantizable("transformer.layers.0.mlp.fc.weight", (96, 96), "nvfp4", tp_size=4)
    linears.check_quantizable("transformer.layers.0.mlp.proj.weight", (64, 96), "nvfp4", tp_size=2)
    linears.check_quantizable(names.DRAFT_FC, (64, 40), "nvfp4")  # excluded: stays bf16


def test_quantize_tensors_pass_through_and_missing_partner() -> None:
    w = torch.randn(32, 32).to(torch.bfloat16)
    tensors = {"transformer.layers.0.mlp.fc.weight": w, names.DRAFT_FC: w}
    assert linears.quantize_tensors(tensors, "none") == tensors
    with pytest.raises(DFlashTrtError, match="mlp.gate.weight, which is missing"):
        linears.quantize_tensors(tensors, "fp8")
    out = linears.quantize_weight(names.DRAFT_FC, w, "nvfp4")
    assert out.keys() == {names.DRAFT_FC} and out[names.DRAFT_FC] is w


# ---------------------------------------------------------------------------------------------- whole model vs modelopt
@pytest.fixture(scope="module")
def bf16_tensors(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    from dflash_trt.conversion.convert import convert_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / "bf16"
    convert_checkpoint(*pair, out, dtype="bfloat16")
    return load_file(str(out / "rank0.safetensors"))


def _modelopt_export(qformat: str, target_dir: Path, tmp: Path):
    """modelopt's own TensorRT-LLM export of the tiny target (bf16), FP8 KV cache, and its quantized model."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, model.config.vocab_size, (2, 24), generator=gen) for _ in range(2)]

    def forward_loop(m) -> None:
        with torch.no_grad():
            for ids in batches:
                m(input_ids=ids)

    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG if qformat == "fp8" else mtq.NVFP4_DEFAULT_CFG)
    cfg["quant_cfg"] = cfg["quant_cfg"] + copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    model = mtq.quantize(model, cfg, forward_loop=forward_loop)
    export_tensorrt_llm_checkpoint(
        copy.deepcopy(model),
        decoder_type="qwen",
        dtype=torch.bfloat16,
        export_dir=str(tmp),
        inference_tensor_parallel=1,
    )
    return load_file(str(tmp / "rank0.safetensors")), model


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("qformat", ["fp8", "nvfp4"])
def test_converted_target_matches_modelopt_export(
    qformat: str, pair: tuple[Path, Path], bf16_tensors: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    theirs, model = _modelopt_export(qformat, pair[0], tmp_path)
    ours = linears.quantize_tensors(bf16_tensors, qformat)

    # Every weight-side tensor modelopt writes for the target (norms and embeddings included) we write under the
    # same name, dtype, shape and bytes, and no other weight scale.
    def leaf(name: str) -> str:
        return name.rsplit(".", 1)[1]

    for name, ref in theirs.items():
        if leaf(name) in WEIGHT_LEAVES:
            assert _same(ours[name], ref), name
    scale_leaves = WEIGHT_LEAVES[1:]
    assert {n for n in ours if n.startswith("transformer.") and leaf(n) in scale_leaves} == {
        n for n in theirs if leaf(n) in scale_leaves
    }
    assert ours[names.LM_HEAD].dtype == torch.bfloat16
    assert ours[names.DRAFT_FC].dtype == torch.bfloat16
    assert ours["dflash.layers.0.attention.qkv.weight"].element_size() == 1

    # Activation and KV scales from modelopt's calibrated amaxes, through our formulas, equal its export.
    activation_scale = fp8_activation_scale if qformat == "fp8" else nvfp4_activation_scale
    hf_layer = model.model.layers[0]
    inputs = {
        "attention.qkv": hf_layer.self_attn.q_proj,
        "attention.dense": hf_layer.self_attn.o_proj,
        "mlp.fc": hf_layer.mlp.gate_proj,
        "mlp.gate": hf_layer.mlp.up_proj,
        "mlp.proj": hf_layer.mlp.down_proj,
    }
    for module, hf_module in inputs.items():
        amax = hf_module.input_quantizer.amax
        if module in ("mlp.fc", "mlp.gate"):
            amax = torch.maximum(amax, hf_layer.mlp.up_proj.input_quantizer.amax)
        ref = theirs[f"transformer.layers.0.{module}.{names.ACTIVATION_SCALING_FACTOR}"]
        assert _same(activation_scale(amax), ref), module
    kv = kv_cache_scale(hf_layer.self_attn.k_bmm_quantizer.amax, hf_layer.self_attn.v_bmm_quantizer.amax)
    assert _same(kv, theirs[names.kv_cache_scale("transformer.layers.0")])


def test_exclusion_evidence_outlier_channel_costs_nvfp4_its_block() -> None:
    """docs/quantization.md §4: the drafter fc reads raw residual-stream taps, where a few channels carry massive
    activations. Per-tensor FP8 input rounding keeps the other channels' precision; NVFP4's 16-wide input blocks
    round every neighbour of such a channel to zero."""
    from dflash_trt.quant.fp8 import fp8_activation_scale
    from dflash_trt.quant.nvfp4 import nvfp4_global_scale
    from dflash_trt.reference.quantized import fake_quantize_input

    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    plain = {}
    for outlier in (None, 1000.0):
        y = x.clone()
        if outlier:
            y[:, 5] = outlier
        others = torch.ones(128, dtype=torch.bool)
        others[5] = False
        amax = y.abs().max()
        fp8 = fake_quantize_input(y, fp8_activation_scale(amax), "fp8")[:, others]
        nv = fake_quantize_input(y, nvfp4_global_scale(amax), "nvfp4")[:, others]
        errors = [float((q - y[:, others]).norm() / y[:, others].norm()) for q in (fp8, nv)]
        if outlier is None:
            plain = errors
            continue
        assert errors[0] < plain[0] * 1.05  # FP8: unchanged
        assert errors[1] > plain[1] * 2  # NVFP4: more than doubled ...
        assert bool((nv[:, :15] == 0).all())  # ... because the outlier's 15 block neighbours all round to zero
