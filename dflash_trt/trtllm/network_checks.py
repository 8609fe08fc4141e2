"""The checks on a converted checkpoint alone (`check_network`): the limits of TensorRT-LLM 1.2.x's layers, KV pool
and quantization that a pair which converts and decodes in the golden model can still meet."""

from __future__ import annotations

from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import FP8, FP8_CONTEXT_FMHA_WEIGHTS
from dflash_trt.trtllm.checkpoint_facts import CheckpointFacts, kv_cache_format, weights_qformat


def check_network(facts: CheckpointFacts) -> None:
    """What the network of model.py cannot be built for, whatever the settings (the emulated engine applies these
    too)."""
    check_kv_geometry(facts)
    check_qk_norm_heads(facts)
    check_rope(facts)
    check_quantization(facts)
    check_moe_layers(facts)
    check_kv_cache_format(weights_qformat(facts), kv_cache_format(facts))


def check_kv_geometry(facts: CheckpointFacts) -> None:
    """Refuse drafters whose K/V pages cannot share the target's paged pool.

    The engine config carries one `head_size` for every layer of the pool, and the runtime's EAGLE KV rewind walks
    all layers with one per-layer stride, so draft layers must match the target's kv heads and head size.
    """
    if facts.draft_head_size != facts.target_head_size or facts.draft_kv_heads != facts.target_kv_heads:
        raise DFlashTrtError(
            f"the drafter's KV geometry ({facts.draft_kv_heads} kv heads x {facts.draft_head_size}) differs from the "
            f"target's ({facts.target_kv_heads} x {facts.target_head_size}); the TensorRT-LLM 1.2.x shared KV pool "
            "cannot hold it, so this pair can be converted and verified but not built into an engine. Building it "
            "would need one head_size for every layer (the engine config has one), per-layer kv heads "
            "(1.2.x's num_kv_heads_per_layer, one pool per head count behind host_kv_cache_pool_mapping) and an "
            "EAGLE KV rewind that walks each pool with its own stride (1.2.x's rewind takes one)"
        )


def rank_heads(heads: int, kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) of one tensor-parallel rank: KV heads are replicated below tp [read: layers/attention.py
    `Attention.__init__`, ceil division]."""
    return heads // tp_size, -(-kv_heads // tp_size)


def check_qk_norm_heads(facts: CheckpointFacts) -> None:
    """Refuse q/k-normed attention whose rank holds as many query heads as KV heads, more than one.

    1.2.x's `Attention.forward` reads the fused qkv rows of such a layer interleaved per head ([q_h, k_h, v_h] for
    each head h) before its q/k norms, and as [Q | K | V] otherwise [read: layers/attention.py `Attention.forward`,
    qk_layernorm branch]; the checkpoint holds [Q | K | V] (one head per rank reads the same either way). Every DFlash
    draft layer has q/k norms, and so do Qwen3 targets; Llama targets have none.
    """
    layers = [("drafter", facts.draft_heads, facts.draft_kv_heads)]
    if facts.base_architecture != "LlamaForCausalLM":
        layers.append(("target", facts.target_heads, facts.target_kv_heads))
    for who, heads, kv_heads in layers:
        per_rank = rank_heads(heads, kv_heads, facts.tp_size)
        if per_rank[0] == per_rank[1] > 1:
            raise DFlashTrtError(
                f"the {who}'s attention holds {per_rank[0]} query and {per_rank[1]} KV heads per rank (tp_size "
                f"{facts.tp_size}) with q/k norms: TensorRT-LLM 1.2.x's Attention then reads the fused qkv rows "
                "interleaved per head, not in the [Q | K | V] order the checkpoint holds, so this pair can be "
                "converted and verified but not built"
            )


def check_rope(facts: CheckpointFacts) -> None:
    """Target and drafter each get their own RoPE tables (model.py builds the drafter's from its parameters), but
    both through TensorRT-LLM 1.2.x's table builder, which reads a subset of yarn's parameters."""
    for who, rope in (("target", facts.target_rope), ("drafter", facts.draft_rope)):
        if rope.rope_type == "yarn" and (rope.attention_factor is not None or not rope.truncate):
            raise DFlashTrtError(
                f"the {who}'s yarn RoPE sets attention_factor or truncate=false, which TensorRT-LLM 1.2.x's yarn "
                "tables do not read (they take factor, original_max_position_embeddings, beta_fast/slow and "
                "mscale/_all_dim)"
            )


def check_quantization(facts: CheckpointFacts) -> None:
    """TensorRT-LLM quantizes every Linear and attention KV of the model from one QuantConfig, and the KV pool has
    one dtype, so the drafter must use the target's weight and KV-cache formats."""
    target = (facts.quant_algo, facts.kv_cache_quant_algo)
    draft = (facts.draft_quant_algo, facts.draft_kv_cache_quant_algo)
    if draft != target:

        def spelled(algos: tuple) -> str:
            return f"weights {algos[0] or 'unquantized'}, KV cache {algos[1] or 'unquantized'}"

        raise DFlashTrtError(
            f"the drafter is quantized as {spelled(draft)} but the target as {spelled(target)}; one engine applies "
            "one quantization (weights, KV cache) to both, so convert them with the same formats"
        )


def check_moe_layers(facts: CheckpointFacts) -> None:
    """TensorRT-LLM 1.2.x's QWenDecoderLayer builds every layer of a qwen3_moe config as MixtureOfExperts (it reads
    no per-layer sparsity), so a target that keeps dense MLPs on some layers converts and decodes in the golden
    model but cannot be built."""
    if facts.sparse_layers and len(facts.sparse_layers) != facts.num_target_layers:
        dense = sorted(set(range(facts.num_target_layers)) - set(facts.sparse_layers))
        raise DFlashTrtError(
            f"the target keeps dense MLPs on layers {dense} among its mixture-of-experts layers; TensorRT-LLM 1.2.x's "
            "Qwen3-MoE decoder layers are all sparse, so this pair can be converted and verified but not built"
        )


def check_kv_cache_format(weights: str, kv_cache: str) -> None:
    """Unquantized weights with an FP8 KV cache cannot run: the builder turns paged context FMHA off for them (no FP8
    context FMHA without FP8 weights), its EAGLE branch turns it back on, and the attention plugin then has 16-bit
    queries over an e4m3 paged cache, which 1.2.x's FMHA dispatcher refuses when the engine loads off the SM100
    family [read: fmhaDispatcher.cpp `FmhaDispatcher`, "KV cache data type ... is not the same as input data type"]
    and for which B200 / B300 need a context kernel not reported to exist (docs/engine.md §1.1)."""
    if kv_cache == FP8 and weights not in FP8_CONTEXT_FMHA_WEIGHTS:
        raise DFlashTrtError(
            f"an FP8 KV cache needs fp8 or nvfp4 weights in a TensorRT-LLM 1.2.x EAGLE engine, but they are {weights}: "
            "the builder re-enables paged context FMHA (EAGLE needs it) without FP8 context FMHA, leaving 16-bit "
            "queries over an FP8 paged cache, which the attention plugin's context kernels do not take (refused when "
            "the engine loads on H100 / H200); convert with --qformat fp8 or nvfp4, or with --kv_cache_dtype none "
            "(the golden model still decodes this checkpoint)"
        )
