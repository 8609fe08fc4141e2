"""The stock TensorRT-LLM 1.2.x GPT attention plugin as a one-layer engine running one spec-decoding generation step,
for `bench_dflash_attention_gpu.py`'s comparison on Hopper (XQA). GPU hosts with TensorRT-LLM only.

The layout mirrors the benchmark's problem: one single-layer pool, every request a generation request of `queries`
tokens after its context, a causal (chain) packed mask, RoPE from the plugin's own table.
"""

from __future__ import annotations

import torch


def _network(batch: int, queries: int, heads: int, kv_heads: int, head_dim: int, tpb: int, theta: float, total: int):
    import tensorrt_llm
    from tensorrt_llm import Tensor
    from tensorrt_llm.functional import PositionEmbeddingType, RopeEmbeddingUtils, constant, gpt_attention
    from tensorrt_llm.quantization import QuantMode

    tokens, pages = batch * queries, -(-total // tpb)
    i32, i64 = tensorrt_llm.str_dtype_to_trt("int32"), tensorrt_llm.str_dtype_to_trt("int64")
    builder = tensorrt_llm.Builder()
    net = builder.create_network()
    net.plugin_config.gpt_attention_plugin = "bfloat16"
    net.plugin_config.remove_input_padding = True
    net.plugin_config.enable_paged_kv_cache(tpb)
    shapes = {
        "sequence_length": ((batch,), i32),
        "host_past_key_value_lengths": ((batch,), i32),
        "host_max_attention_window_sizes": ((1,), i32),
        "host_sink_token_length": ((1,), i32),
        "context_lengths": ((batch,), i32),
        "host_context_lengths": ((batch,), i32),
        "cache_indirection": ((batch, 1, total), i32),
        "host_request_types": ((batch,), i32),
        "host_runtime_perf_knobs": ((16,), i64),
        "host_context_progress": ((1,), i64),
        "kv_cache_block_offsets": ((1, batch, 2, pages), i32),
        "host_kv_cache_block_offsets": ((1, batch, 2, pages), i32),
        "host_kv_cache_pool_pointers": ((1, 2), i64),
        "host_kv_cache_pool_mapping": ((1, 2), i32),
        "spec_decoding_generation_lengths": ((batch,), i32),
        "spec_decoding_position_offsets": ((batch, queries), i32),
        "spec_decoding_packed_mask": ((tokens, 1), i32),
        "spec_decoding_use": ((1,), i32),
    }
    with tensorrt_llm.net_guard(net):
        qkv = Tensor(
            name="qkv",
            shape=(tokens, (heads + 2 * kv_heads) * head_dim),
            dtype=tensorrt_llm.str_dtype_to_trt("bfloat16"),
        )
        named = {name: Tensor(name=name, shape=shape, dtype=kind) for name, (shape, kind) in shapes.items()}
        inv_freq, cos_sin = RopeEmbeddingUtils.create_sinusoidal_positions_for_attention_plugin(
            total, head_dim, theta, 1.0
        )
        output, _ = gpt_attention(
            qkv=qkv,
            past_key_value=None,
            layer_idx=0,
            num_heads=heads,
            num_kv_heads=kv_heads,
            hidden_size_per_head=head_dim,
            q_scaling=1.0,
            rotary_embedding_dim=head_dim,
            rotary_embedding_base=theta,
            rotary_embedding_max_positions=total,
            position_embedding_type=PositionEmbeddingType.rope_gpt_neox,
            rotary_inv_freq=constant(inv_freq),
            rotary_cos_sin=constant(cos_sin),
            kv_cache_quant_mode=QuantMode(0),
            max_context_length=total,
            spec_decoding_is_generation_length_variable=True,
            spec_decoding_max_generation_length=queries,
            **named,
        )
        net._mark_output(output, "output", dtype=tensorrt_llm.str_dtype_to_trt("bfloat16"))
    engine = builder.build_engine(net, builder.create_builder_config(name="stock_spec_decoding", precision="bfloat16"))
    return tensorrt_llm.runtime.Session.from_serialized_engine(engine)


def spec_decoding_session(
    p: dict, batch: int, queries: int, heads: int, kv_heads: int, head_dim: int, tpb: int, theta: float
):
    """(session, inputs, outputs) for the benchmark's problem `p` (see bench_dflash_attention_gpu.problem)."""
    cuda, total = torch.device("cuda"), p["total"]
    context = total - queries
    knobs = torch.full((16,), -1, dtype=torch.int64)
    knobs[0] = 1  # multi-block mode
    causal = [(1 << (i + 1)) - 1 for i in range(queries)]
    inputs = {
        "qkv": p["qkv"],
        "sequence_length": p["seq_lens"],
        "host_past_key_value_lengths": torch.full((batch,), total, dtype=torch.int32),
        "host_max_attention_window_sizes": torch.tensor([total], dtype=torch.int32),
        "host_sink_token_length": torch.zeros(1, dtype=torch.int32),
        "context_lengths": torch.full((batch,), context, dtype=torch.int32, device=cuda),
        "host_context_lengths": torch.full((batch,), context, dtype=torch.int32),
        "cache_indirection": torch.zeros(batch, 1, total, dtype=torch.int32, device=cuda),
        "host_request_types": torch.ones(batch, dtype=torch.int32),
        "host_runtime_perf_knobs": knobs,
        "host_context_progress": torch.zeros(1, dtype=torch.int64),
        "kv_cache_block_offsets": p["offsets"][None],
        "host_kv_cache_block_offsets": p["offsets"][None].cpu(),
        "host_kv_cache_pool_pointers": torch.tensor([[p["pool"].data_ptr(), 0]], dtype=torch.int64),
        "host_kv_cache_pool_mapping": torch.zeros(1, 2, dtype=torch.int32),
        "spec_decoding_generation_lengths": p["gen_lens"],
        "spec_decoding_position_offsets": torch.arange(queries, dtype=torch.int32, device=cuda).repeat(batch, 1),
        "spec_decoding_packed_mask": torch.tensor(causal * batch, dtype=torch.int32, device=cuda).view(-1, 1),
        "spec_decoding_use": torch.ones(1, dtype=torch.int32),
    }
    output = torch.empty(batch * queries, heads * head_dim, dtype=torch.bfloat16, device=cuda)
    session = _network(batch, queries, heads, kv_heads, head_dim, tpb, theta, total)
    return session, inputs, {"output": output}
