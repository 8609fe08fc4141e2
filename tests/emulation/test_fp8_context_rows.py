"""FP8 context FMHA's FP8 output on the Blackwell split (generation_attention.py `stock_rows_as_generation_rows`).

With an FP8 KV cache and FP8 / NVFP4 weights the stock attention plugin writes e4m3; on B200 / B300 its context rows
meet DFlashAttention's bf16 / fp16 generation rows in one concatenation, which TensorRT refuses for mixed types and
for FP8. The network dequantizes them first. Here: the exactness argument for FP8 weights checked over every e4m3
value, the emulated TensorRT rules the fix answers, and the network without the dequantization caught on b200 / b300.
"""

from __future__ import annotations

import json

import pytest
import torch
from _emulation import PROMPTS, STOP, convert, divergences
from _pairs import PairVariant

from dflash_trt.emulation import functional, trt
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.functional import EmulationError, Network, PluginConfig, net_guard, wrap_tensor
from dflash_trt.emulation.stand_ins import load_engine_module
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.emulated import decode_batch
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.reference.quantized import (
    attention_output_orig_quant_scale,
    fake_quantize_fp8,
    fp8_attention_output,
    fp8_attention_rows,
)

FP8_MAX = 448.0


def _every_e4m3_value() -> torch.Tensor:
    """All finite e4m3 values (the 254 bit patterns that are not NaN)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return values[values.isfinite()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantized_fp8_rows_requantize_to_the_same_values(dtype):
    """The docstring's claim, checked exhaustively: every e4m3 value `q`, dequantized with the reciprocal of the
    orig->quant scale cast to the 16-bit type and rounded to it, is quantized back to `q` by an FP8 dense layer at its
    activation scale `s`, both as TensorRT-LLM's FP8RowLinear does it (x / s with `s` cast to the 16-bit type) and as
    the golden model does it (x times the float32 reciprocal), for scales across fp16's usable range."""
    q = _every_e4m3_value()
    generator = torch.Generator().manual_seed(0)
    exponents = torch.empty(200).uniform_(-14.0, 6.0, generator=generator)
    for s in (2.0**exponents).tolist() + [2.0**-14, 1.0, 0.37]:
        s32 = torch.tensor([s], dtype=torch.float32)
        orig_quant = attention_output_orig_quant_scale(s32, "fp8")
        y = fp8_attention_rows(q * s, orig_quant, dtype)  # q * s: the fp32 attention output that rounds to q
        assert torch.equal(fp8_attention_output(q * s, orig_quant).float(), q)
        dense_scale = s32.to(dtype).float()
        trtllm = (y.float() / dense_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        assert torch.equal(trtllm, q), s
        golden = fake_quantize_fp8(y.float(), s32).float() / s32
        assert torch.equal(golden.to(torch.float8_e4m3fn).float(), q), s


def test_nvfp4_output_scale_is_the_dense_input_scale_reciprocal_over_six():
    """1.2.x quantizes the attention output for an FP4 dense layer at 1 / (6 x its input scale): its largest e4m3
    value 448 then maps back to 6 x 448 x scale, the amax NVFP4's global scale was calibrated for."""
    scale = torch.tensor([0.01], dtype=torch.float32)
    assert attention_output_orig_quant_scale(scale, "nvfp4").item() == pytest.approx(1 / 0.06, rel=1e-6)
    assert attention_output_orig_quant_scale(scale, "fp8").item() == pytest.approx(100.0, rel=1e-6)


def test_concatenation_refuses_fp8_and_mixed_types_as_tensorrt_does():
    fp8 = wrap_tensor(torch.zeros(2, 4).to(torch.float8_e4m3fn))
    bf16 = wrap_tensor(torch.zeros(3, 4, dtype=torch.bfloat16))
    with pytest.raises(EmulationError, match="concat of different types"):
        functional.concat([fp8, bf16])
    with pytest.raises(EmulationError, match="IConcatenationLayer takes no such type"):
        functional.concat([fp8, fp8])
    assert functional.concat([bf16, bf16]).shape == (6, 4)


def test_dequantize_follows_the_operator_rules():
    q = wrap_tensor(torch.tensor([[1.5, -448.0]]).to(torch.float8_e4m3fn))
    scale = wrap_tensor(torch.tensor([0.25], dtype=torch.bfloat16))
    out = functional.dequantize(q, scale, -1, trt.bfloat16)
    assert out.data.dtype == torch.bfloat16 and out.data.tolist() == [[0.375, -112.0]]
    with pytest.raises(EmulationError, match="with a FLOAT scale"):
        functional.dequantize(q, wrap_tensor(torch.tensor([0.25])), -1, trt.bfloat16)
    with pytest.raises(EmulationError, match="IDequantizeLayer takes"):
        functional.dequantize(wrap_tensor(torch.zeros(1, 2, dtype=torch.bfloat16)), scale, -1, trt.bfloat16)


def test_the_stock_plugin_stand_in_takes_the_output_scale_exactly_with_fp8_context_fmha():
    """functional.gpt_attention refuses an output scale without FP8 context FMHA, and the plugin needs it with."""
    from dflash_trt.emulation.layers import _StockCall

    kwargs = {"num_heads": 1, "num_kv_heads": 1, "hidden_size_per_head": 4, "q_scaling": 1.0}
    kwargs |= {"rotary_embedding_dim": 4, "rotary_cos_sin": wrap_tensor(torch.zeros(1, 2, 2))}
    scale = wrap_tensor(torch.tensor([2.0]))
    with net_guard(Network(PluginConfig(use_fp8_context_fmha=False))):
        with pytest.raises(EmulationError, match="FP8 Context FMHA needs to be enabled"):
            _StockCall({**kwargs, "attention_output_orig_quant_scale": scale})
    with net_guard(Network(PluginConfig(use_fp8_context_fmha=True))):
        with pytest.raises(EmulationError, match="without attention_output_orig_quant_scale"):
            _StockCall(kwargs)
        assert _StockCall({**kwargs, "attention_output_orig_quant_scale": scale}).output_orig_quant is scale


@pytest.fixture(scope="module")
def fp8_kv_checkpoints(tmp_path_factory):
    """FP8 and NVFP4 weights, each with an FP8 KV cache (converted once for the module)."""
    pytest.importorskip("modelopt.torch.quantization")
    root = tmp_path_factory.mktemp("fp8_kv")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    variant = PairVariant(intermediate=128, draft_intermediate=64)
    return {
        qformat: convert(
            root / qformat, variant, qformat=qformat, kv_cache_dtype="fp8", calib_dataset=calib, calib_size=4
        )
        for qformat in ("fp8", "nvfp4")
    }


@pytest.mark.slow
@pytest.mark.parametrize(("qformat", "gpu"), [("fp8", "b200"), ("nvfp4", "b300")])
def test_stock_rows_left_in_fp8_are_refused_at_the_concatenation(qformat, gpu, fp8_kv_checkpoints, monkeypatch):
    """The network without the dequantization (the stock rows concatenated as the plugin returns them) fails at the
    first step with context and generation rows, as TensorRT's builder would refuse it; with it, it decodes like the
    golden model."""
    ckpt = fp8_kv_checkpoints[qformat]
    golden = speculative_generate(load_golden_model(ckpt), PROMPTS, 10, STOP)
    runtime = EmulatedEngine(ckpt, gpu=gpu, max_batch_size=2, max_num_tokens=16, tokens_per_block=16)
    assert divergences(ckpt, golden, decode_batch(runtime, PROMPTS, 10, STOP, arrivals=[0, 0, 1, 2]), 10) == []
    module = load_engine_module().dflash_attention.__wrapped__.__globals__
    monkeypatch.setitem(module, "stock_rows_as_generation_rows", lambda context, kwargs: context)
    runtime = EmulatedEngine(ckpt, gpu=gpu, max_batch_size=2, max_num_tokens=16, tokens_per_block=16)
    with pytest.raises(EmulationError, match=r"concat of different types \['FP8', 'FLOAT'\]"):
        decode_batch(runtime, PROMPTS, 10, STOP, arrivals=[0, 0, 1, 2])


def test_an_nvfp4_checkpoint_is_not_emulated_on_hopper(fp8_kv_checkpoints):
    """What `build` refuses the emulated engine refuses: NVFP4 GEMMs exist from Blackwell on."""
    with pytest.raises(DFlashTrtError, match=r"quantization is nvfp4, which needs Blackwell \(SM100 or newer\); h200"):
        EmulatedEngine(fp8_kv_checkpoints["nvfp4"], gpu="h200")
