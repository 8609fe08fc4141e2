"""The stock TensorRT-LLM 1.2.x GPT attention plugin as DFlash's block attention, against a dense reference.

Context K/V are written into a paged pool by our KV-injection definition (so this also checks that the stock
attention reads our layout, layer offset included); the block of B tokens then runs as one spec-decoding
generation step. An all-ones packed mask must give every block query every block key (bidirectional), a
lower-triangular mask causal-in-block; the context is always fully visible.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dflash_trt.reference.kv_injection import PagedKVCacheLayout, kv_injection
from dflash_trt.rope import RopeConfig, apply_rope, rope_cos_sin

pytestmark = [pytest.mark.gpu, pytest.mark.trtllm]

HEADS, KV_HEADS, HEAD_DIM, BLOCK, TOKENS_PER_BLOCK, THETA = 8, 2, 128, 8, 32, 1_000_000.0
CTX_LENS = [37, 70]
LAYER = 1  # the attention's layer in a two-layer pool, so the per-layer offset is exercised
MAX_SEQ_LEN = 128


def _packed_mask(bidirectional: bool) -> torch.Tensor:
    """[batch * B, 1] int32: bit j of row i set when block query i may see block key j."""
    rows = [(1 << BLOCK) - 1 if bidirectional else (1 << (i + 1)) - 1 for i in range(BLOCK)]
    return torch.tensor(rows * len(CTX_LENS), dtype=torch.int32).view(-1, 1)


def _dense_reference(q, k_block, v_block, ctx_k, ctx_v, bidirectional: bool) -> torch.Tensor:
    """Per request: block queries over [context ; block] keys, float32; returns [batch * B, HEADS * HEAD_DIM]."""
    out = []
    group = HEADS // KV_HEADS
    for b, ctx in enumerate(CTX_LENS):
        rows = slice(b * BLOCK, (b + 1) * BLOCK)
        keys = torch.cat([ctx_k[b][:, :ctx], k_block[rows].transpose(0, 1)], dim=1)  # [kv_heads, ctx+B, D]
        values = torch.cat([ctx_v[b][:, :ctx], v_block[rows].transpose(0, 1)], dim=1)
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        scores = torch.einsum("qhd,hkd->hqk", q[rows], keys) / math.sqrt(HEAD_DIM)
        visible = torch.ones(BLOCK, ctx + BLOCK, dtype=torch.bool)
        if not bidirectional:
            visible[:, ctx:] = torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool))
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,hkd->qhd", scores.softmax(-1), values).reshape(BLOCK, -1))
    return torch.cat(out)


def _build_session(dtype: str, max_context: int):
    import tensorrt_llm
    from tensorrt_llm import Tensor
    from tensorrt_llm.functional import PositionEmbeddingType, RopeEmbeddingUtils, constant, gpt_attention
    from tensorrt_llm.quantization import QuantMode

    batch, tokens = len(CTX_LENS), len(CTX_LENS) * BLOCK
    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    max_blocks = MAX_SEQ_LEN // TOKENS_PER_BLOCK
    builder = tensorrt_llm.Builder()
    net = builder.create_network()
    net.plugin_config.gpt_attention_plugin = dtype
    net.plugin_config.remove_input_padding = True
    net.plugin_config.enable_paged_kv_cache(TOKENS_PER_BLOCK)
    i32, i64 = tensorrt_llm.str_dtype_to_trt("int32"), tensorrt_llm.str_dtype_to_trt("int64")
    with tensorrt_llm.net_guard(net):
        qkv = Tensor(name="qkv", shape=(tokens, qkv_width), dtype=tensorrt_llm.str_dtype_to_trt(dtype))
        named = {
            name: Tensor(name=name, shape=shape, dtype=kind)
            for name, shape, kind in [
                ("sequence_length", (batch,), i32),
                ("host_past_key_value_lengths", (batch,), i32),
                ("host_max_attention_window_sizes", (LAYER + 1,), i32),
                ("host_sink_token_length", (1,), i32),
                ("context_lengths", (batch,), i32),
                ("host_context_lengths", (batch,), i32),
                ("cache_indirection", (batch, 1, MAX_SEQ_LEN), i32),
                ("host_request_types", (batch,), i32),
                ("host_runtime_perf_knobs", (16,), i64),
                ("host_context_progress", (1,), i64),
                ("kv_cache_block_offsets", (1, batch, 2, max_blocks), i32),
                ("host_kv_cache_block_offsets", (1, batch, 2, max_blocks), i32),
                ("host_kv_cache_pool_pointers", (1, 2), i64),
                ("host_kv_cache_pool_mapping", (LAYER + 1, 2), i32),
                ("spec_decoding_generation_lengths", (batch,), i32),
                ("spec_decoding_position_offsets", (batch, BLOCK), i32),
                ("spec_decoding_packed_mask", (tokens, 1), i32),
                ("spec_decoding_use", (1,), i32),
            ]
        }
        inv_freq, cos_sin = RopeEmbeddingUtils.create_sinusoidal_positions_for_attention_plugin(
            MAX_SEQ_LEN, HEAD_DIM, THETA, 1.0
        )
        outputs = gpt_attention(
            qkv=qkv,
            past_key_value=None,
            sequence_length=named["sequence_length"],
            host_past_key_value_lengths=named["host_past_key_value_lengths"],
            host_max_attention_window_sizes=named["host_max_attention_window_sizes"],
            host_sink_token_length=named["host_sink_token_length"],
            context_lengths=named["context_lengths"],
            cache_indirection=named["cache_indirection"],
            host_request_types=named["host_request_types"],
            layer_idx=LAYER,
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            hidden_size_per_head=HEAD_DIM,
            q_scaling=1.0,
            rotary_embedding_dim=HEAD_DIM,
            rotary_embedding_base=THETA,
            rotary_embedding_max_positions=MAX_SEQ_LEN,
            position_embedding_type=PositionEmbeddingType.rope_gpt_neox,
            rotary_inv_freq=constant(inv_freq),
            rotary_cos_sin=constant(cos_sin),
            kv_cache_quant_mode=QuantMode(0),
            host_context_lengths=named["host_context_lengths"],
            kv_cache_block_offsets=named["kv_cache_block_offsets"],
            host_kv_cache_block_offsets=named["host_kv_cache_block_offsets"],
            host_kv_cache_pool_pointers=named["host_kv_cache_pool_pointers"],
            host_kv_cache_pool_mapping=named["host_kv_cache_pool_mapping"],
            max_context_length=max_context,
            host_runtime_perf_knobs=named["host_runtime_perf_knobs"],
            host_context_progress=named["host_context_progress"],
            spec_decoding_is_generation_length_variable=True,
            spec_decoding_max_generation_length=BLOCK,
            spec_decoding_generation_lengths=named["spec_decoding_generation_lengths"],
            spec_decoding_position_offsets=named["spec_decoding_position_offsets"],
            spec_decoding_packed_mask=named["spec_decoding_packed_mask"],
            spec_decoding_use=named["spec_decoding_use"],
        )
        net._mark_output(outputs[0], "output", dtype=tensorrt_llm.str_dtype_to_trt(dtype))
    config = builder.create_builder_config(name="dflash_block_attention", precision=dtype)
    engine = builder.build_engine(net, config)
    return tensorrt_llm.runtime.Session.from_serialized_engine(engine)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_spec_decoding_attention_with_packed_mask_matches_dense(bidirectional: bool) -> None:
    if torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] == 10:
        pytest.skip("SM100 / SM103: 1.2.x's stock plugin has no spec-decoding kernel there (DFlashAttention serves it)")
    gen = torch.Generator().manual_seed(7)
    batch, tokens = len(CTX_LENS), len(CTX_LENS) * BLOCK
    max_blocks = MAX_SEQ_LEN // TOKENS_PER_BLOCK
    rope = RopeConfig(HEAD_DIM, THETA)

    # Pool with two layers per block; each sequence owns consecutive blocks.
    layout = PagedKVCacheLayout(KV_HEADS, HEAD_DIM, TOKENS_PER_BLOCK, max_blocks, layer_idx_in_pool=LAYER)
    blocks = torch.arange(batch * max_blocks).view(batch, max_blocks)
    raw = blocks * (LAYER + 1) * 2
    block_offsets = torch.stack([raw, raw + 1], dim=1).to(torch.int32)
    pool = torch.zeros(batch * max_blocks, LAYER + 1, 2, KV_HEADS, TOKENS_PER_BLOCK, HEAD_DIM, dtype=torch.bfloat16)
    total_ctx = sum(CTX_LENS)
    seq_slots = torch.cat([torch.full((c,), b, dtype=torch.int32) for b, c in enumerate(CTX_LENS)])
    positions = torch.cat([torch.arange(c, dtype=torch.int32) for c in CTX_LENS])
    ctx_kv = torch.randn(total_ctx, 1, 2, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    kv_injection(
        ctx_kv,
        torch.ones(1, HEAD_DIM),
        1e-6,
        positions,
        seq_slots,
        torch.ones(total_ctx),
        rope,
        layout,
        block_offsets,
        pool,
    )
    ctx_k = [
        pool[blocks[b], LAYER, 0].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, HEAD_DIM).float() for b in range(batch)
    ]
    ctx_v = [
        pool[blocks[b], LAYER, 1].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, HEAD_DIM).float() for b in range(batch)
    ]

    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(torch.bfloat16)
    q, k, v = qkv.float().split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1)
    block_positions = torch.cat([torch.arange(c, c + BLOCK) for c in CTX_LENS])
    cos, sin = rope_cos_sin(block_positions, rope)
    q = apply_rope(q.view(tokens, HEADS, HEAD_DIM), cos[:, None], sin[:, None])
    k = apply_rope(k.view(tokens, KV_HEADS, HEAD_DIM), cos[:, None], sin[:, None])
    want = _dense_reference(q, k, v.view(tokens, KV_HEADS, HEAD_DIM), ctx_k, ctx_v, bidirectional)

    cuda = torch.device("cuda")
    pool_gpu = pool.to(cuda)
    ctx = torch.tensor(CTX_LENS, dtype=torch.int32)
    knobs = torch.full((16,), -1, dtype=torch.int64)
    knobs[0] = 1
    inputs = {
        "qkv": qkv.to(cuda),
        "sequence_length": (ctx + BLOCK).to(cuda),
        "host_past_key_value_lengths": ctx + BLOCK - 1,
        "host_max_attention_window_sizes": torch.full((LAYER + 1,), MAX_SEQ_LEN, dtype=torch.int32),
        "host_sink_token_length": torch.zeros(1, dtype=torch.int32),
        "context_lengths": ctx.to(cuda),
        "host_context_lengths": ctx.clone(),
        "cache_indirection": torch.zeros(batch, 1, MAX_SEQ_LEN, dtype=torch.int32, device=cuda),
        "host_request_types": torch.ones(batch, dtype=torch.int32),
        "host_runtime_perf_knobs": knobs,
        "host_context_progress": torch.zeros(1, dtype=torch.int64),
        "kv_cache_block_offsets": block_offsets[None].to(cuda),
        "host_kv_cache_block_offsets": block_offsets[None].clone(),
        "host_kv_cache_pool_pointers": torch.tensor([[pool_gpu.data_ptr(), 0]], dtype=torch.int64),
        "host_kv_cache_pool_mapping": torch.tensor([[0, layer] for layer in range(LAYER + 1)], dtype=torch.int32),
        "spec_decoding_generation_lengths": torch.full((batch,), BLOCK, dtype=torch.int32, device=cuda),
        "spec_decoding_position_offsets": torch.arange(BLOCK, dtype=torch.int32).repeat(batch, 1).to(cuda),
        "spec_decoding_packed_mask": _packed_mask(bidirectional).to(cuda),
        "spec_decoding_use": torch.ones(1, dtype=torch.int32),
    }
    output = torch.zeros(tokens, HEADS * HEAD_DIM, dtype=torch.bfloat16, device=cuda)
    session = _build_session("bfloat16", max(CTX_LENS))
    stream = torch.cuda.current_stream()
    assert session.run(inputs=inputs, outputs={"output": output}, stream=stream.cuda_stream)
    torch.cuda.synchronize()
    np.testing.assert_allclose(output.float().cpu().numpy(), want.numpy(), atol=3e-2, rtol=3e-2)
    # The block's K/V went into the same pages, right after each context.
    written = pool_gpu.cpu()
    for b, c in enumerate(CTX_LENS):
        page, row = blocks[b, c // TOKENS_PER_BLOCK], c % TOKENS_PER_BLOCK
        torch.testing.assert_close(
            written[page, LAYER, 1, :, row].float(), v[b * BLOCK].view(KV_HEADS, HEAD_DIM), atol=1e-2, rtol=1e-2
        )
