"""Half-precision checkpoints through the emulated engine in their own dtype (activations, KV cache, plugin I/O),
under TensorRT's strongly-typed rules, against the float32 golden model with the tie-aware comparison: every first
divergence must be a labelled near-tie, and mean acceptance must stay within 2 %."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.emulation import layers, plugins, trt
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.functional import EmulationError, Network, PluginConfig, Tensor, net_guard
from dflash_trt.emulation.layers import ColumnLinear
from dflash_trt.executors.emulated import decode_batch
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.divergence import compare_decodings
from dflash_trt.reference.model import load_golden_model
from dflash_trt.reference.stats import mean_acceptance_length
from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir
from dflash_trt.tokenizer import load_tokenizer

PROMPTS = 12
MAX_NEW = 48


def _convert(root: Path, dtype: str, tp: int = 1) -> Path:
    out = root / f"{dtype}-tp{tp}"
    convert_checkpoint(target_dir(), draft_dir(), out, dtype=dtype, tp_size=tp)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tp", [("bfloat16", 1), ("float16", 1), ("bfloat16", 2)])
def test_half_precision_engines_match_the_golden_model_up_to_near_ties(tmp_path, dtype, tp):
    """The embedded trained pair (long accepted blocks): the engine in bf16 / fp16 against the fp32 golden model."""
    ckpt = _convert(tmp_path, dtype, tp)
    model = load_golden_model(ckpt)
    prompts = [load_tokenizer(ckpt).encode(p.text) for p in load_heldout(limit=PROMPTS)]
    stops = list(model.target.spec.eos_token_ids)
    k = model.draft.spec.block_size - 1
    runtime = EmulatedEngine(ckpt, max_batch_size=4, tokens_per_block=32)
    seen = set()
    original = ColumnLinear.forward

    def recording(self, x, *args, **kwargs):
        seen.add(x.data.dtype)
        return original(self, x, *args, **kwargs)

    ColumnLinear.forward = recording
    try:
        emulated = decode_batch(runtime, prompts, MAX_NEW, stops)
    finally:
        ColumnLinear.forward = original
    assert seen == {getattr(torch, dtype)} and runtime.cache_dtype == getattr(torch, dtype)
    divergences = compare_decodings(model, speculative_generate(model, prompts, MAX_NEW + k, stops), emulated, MAX_NEW)
    for divergence in divergences:
        print(divergence)
    assert [str(d) for d in divergences if not d.near_tie] == []
    golden = mean_acceptance_length(speculative_generate(model, prompts, MAX_NEW, stops))
    assert mean_acceptance_length(emulated) == pytest.approx(golden, rel=0.02)


def _linear(dtype: str) -> ColumnLinear:
    linear = ColumnLinear(4, 2, bias=False, dtype=dtype)
    linear.weight.value = torch.ones(2, 4, dtype=getattr(torch, dtype))
    return linear


def test_a_layer_fed_another_dtype_raises_like_the_builder():
    with net_guard(Network(PluginConfig())):
        out = _linear("bfloat16")(Tensor(data=torch.ones(3, 4, dtype=torch.bfloat16)))
        assert out.data.dtype == torch.bfloat16 and out.data.tolist() == [[4.0, 4.0]] * 3
        with pytest.raises(EmulationError, match="built for torch.bfloat16 fed a torch.float32 tensor"):
            _linear("bfloat16")(Tensor(data=torch.ones(3, 4)))
        with pytest.raises(EmulationError, match="different types BF16 and FLOAT"):
            Tensor(data=torch.ones(2, dtype=torch.bfloat16)) + Tensor(data=torch.ones(2))


def test_a_network_missing_a_cast_is_refused(tmp_path, monkeypatch):
    """An embedding that hands float32 rows to a bf16 network (what the fp32-only emulation did) fails at the first
    layer, as TensorRT's strongly-typed builder would refuse the graph."""
    ckpt = _convert(tmp_path, "bfloat16")
    original = layers.Embedding.forward
    monkeypatch.setattr(layers.Embedding, "forward", lambda self, x, *a: Tensor(data=original(self, x).data.float()))
    with pytest.raises(EmulationError, match="fed a torch.float32 tensor"):
        decode_batch(EmulatedEngine(ckpt), [[5, 6, 7]], 4)


def _plugin(type_id: int, cache_fp8: bool = False) -> plugins.KVInjectionPlugin:
    fields = {
        "num_layers": [1],
        "num_kv_heads": [1],
        "head_dim": [4],
        "layer_idx_offset": [0],
        "tokens_per_block": [16],
        "type_id": [type_id],
        "cache_fp8": [int(cache_fp8)],
        "eps": [1e-6],
        "rope_inv_freq": np.ones(2, np.float32),
        "rope_attention_scaling": [1.0],
    }
    return plugins.KVInjectionPlugin({k: np.asarray(v) for k, v in fields.items()})


def _inputs(ctx: torch.dtype, passthrough: torch.dtype = torch.float32, scale: torch.dtype | None = None) -> list:
    i32 = torch.zeros(1, dtype=torch.int32)
    tensors = [
        torch.zeros(1, 8, dtype=ctx),
        torch.ones(1, 4, dtype=ctx),
        i32,
        i32,
        i32,
        i32,
        torch.zeros(1, 1, 2, 1, dtype=torch.int32),
        torch.zeros(1, 2, dtype=torch.int64),
        torch.zeros(1, 2, dtype=torch.int32),
        torch.zeros(1, dtype=passthrough),
    ]
    if scale is not None:
        tensors.append(torch.ones(1, dtype=scale))
    return [Tensor(data=t) for t in tensors]


def test_the_plugin_stand_in_accepts_exactly_the_cuda_plugins_formats():
    """kvInjectionPlugin.cpp: type_id HALF or BF16 (FLOAT only as the emulation's float32 extension), ctx_kv and
    k_norm of that type, passthrough FLOAT / HALF / BF16 / INT32, the FP8 scale FLOAT."""
    half, bf16, f32 = (int(t) for t in (trt.DataType.HALF, trt.DataType.BF16, trt.DataType.FLOAT))
    for type_id, dtype in ((half, torch.float16), (bf16, torch.bfloat16), (f32, torch.float32)):
        for passthrough in (torch.float32, torch.float16, torch.bfloat16, torch.int32):
            assert len(_plugin(type_id).add_to_network(_inputs(dtype, passthrough))) == 1
        assert len(_plugin(type_id, cache_fp8=True).add_to_network(_inputs(dtype, scale=torch.float32))) == 1
    with pytest.raises(EmulationError, match="type_id must be HALF or BF16"):
        _plugin(int(trt.DataType.INT32))
    with pytest.raises(EmulationError, match="input 0 is FLOAT; the plugin supports BF16 there"):
        _plugin(bf16).add_to_network(_inputs(torch.float32))
    with pytest.raises(EmulationError, match="input 9 is INT64"):
        _plugin(half).add_to_network(_inputs(torch.float16, torch.int64))
    with pytest.raises(EmulationError, match="input 10 is HALF; the plugin supports FLOAT there"):
        _plugin(half, cache_fp8=True).add_to_network(_inputs(torch.float16, scale=torch.float16))
