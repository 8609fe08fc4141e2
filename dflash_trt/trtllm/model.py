"""DFlashForCausalLM: target + DFlash drafter as one TensorRT-LLM 1.2.x network under the EAGLE engine contract.

`trtllm-build --model_cls_file <this file> --model_cls_name DFlashForCausalLM` loads it; importing it registers the
class in `tensorrt_llm.models.MODEL_MAP` so `PretrainedConfig.from_dict` finds the checkpoint's architecture. Per
step (docs/engine.md §2): stock target decoder layers with our own loop keeping the tap outputs; verification,
greedy or exactly sampled per request (`verify.py`); in-graph bookkeeping with static shapes and validity masks;
KV injection of the accepted tokens' context K/V into the draft layers' pages (our plugin); the draft block as one
spec-decoding generation step; next drafts from the target's lm_head. Which attention plugin serves each
generation pass depends on the GPU the engine is built for (`attention_route.py`): on Blackwell the target's
generation requests and the draft block run on our DFlashAttention, and sliding-window draft layers do on every GPU
(`generation_attention.py`). Imports TensorRT-LLM, so GPU hosts only.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np
import tensorrt as trt
from tensorrt_llm._common import default_net
from tensorrt_llm._utils import pad_vocab_size
from tensorrt_llm.bindings import KVCacheType
from tensorrt_llm.functional import (
    LayerNormType,
    Tensor,
    arange,
    argmax,
    cast,
    concat,
    cumsum,
    eq,
    expand,
    gather,
    gather_last_token_logits,
    index_select,
    shape,
    slice,
    sum,
    tanh,
    unsqueeze,
    where,
)
from tensorrt_llm.layers import (
    Attention,
    AttentionMaskType,
    ColumnLinear,
    Embedding,
    GatedMLP,
    KeyValueCacheParams,
    RmsNorm,
    SpecDecodingParams,
)
from tensorrt_llm.models import MODEL_MAP
from tensorrt_llm.models.generation_mixin import GenerationMixin
from tensorrt_llm.models.llama.config import LLaMAConfig
from tensorrt_llm.models.llama.model import LLaMADecoderLayer
from tensorrt_llm.models.modeling_utils import DecoderModelForCausalLM, PretrainedConfig
from tensorrt_llm.models.qwen.config import QWenConfig
from tensorrt_llm.models.qwen.model import QWenDecoderLayer
from tensorrt_llm.module import Module, ModuleList
from tensorrt_llm.parameter import Parameter

from dflash_trt.checkpoint.trtllm_config import ARCHITECTURE, draft_spec_from_config, rotary_scaling
from dflash_trt.draft_schedule import DraftLenSchedule
from dflash_trt.spec import EMBEDDING_TAP, SLIDING_ATTENTION, DraftSpec
from dflash_trt.trtllm.attention_route import OURS, AttentionRoute, route_for_build
from dflash_trt.trtllm.drafting import (
    AFTER,
    BEFORE,
    CandidateSelector,
    GroupedDynamicConv,
    draft_vocabulary_map,
    replicated_linear,
)
from dflash_trt.trtllm.eagle_layout import block_packed_mask, chain_draft_paths
from dflash_trt.trtllm.generation_attention import BlockAttention, dflash_attention
from dflash_trt.trtllm.network_environment import engine_schedule, engine_tree_nodes
from dflash_trt.trtllm.plugin import KVInjectionGeometry, kv_injection_layer
from dflash_trt.trtllm.tree import EngineTree, TreeShape, TreeVerdict, best_trees, path_depths, verify_tree
from dflash_trt.trtllm.verify import i32, verify_drafts

# Keys only DFlash reads; the target's TensorRT-LLM config class must not see them.
DFLASH_KEYS = (
    "architecture",
    "base_architecture",
    "dflash_config",
    "dflash_format_version",
    "eos_token_ids",
    "vocab_size_padded",
    "max_draft_len",
    "num_eagle_layers",
    "max_non_leaves_per_layer",
    "eagle_net_config",
    "mapping",
    "quantization",
    "draft_len_schedule",
    "draft_tree",
)
EAGLE_INPUTS = (
    "draft_tokens",
    "draft_lens",
    "eagle_temperature",
    "rand_data_validation",
    "rand_data_sample",
    "host_gen_eagle_net_request_types",
    "host_gen_eagle_net_context_lengths",
    "host_gen_eagle_net_past_key_value_lengths",
)


@dataclass(frozen=True)
class StepBook:
    """What the bookkeeping derives once per step (docs/engine.md §2.3), as network tensors."""

    request: Tensor  # int32 [tokens]: the request (batch row) of each packed row
    valid: Tensor  # int32 [tokens]: 1 where the row's target features are final and get injected
    positions: Tensor  # int32 [tokens]: absolute position of each packed row
    ctx_len: Tensor  # int32 [batch]: drafter context length after this step
    anchor: Tensor  # int32 [batch, 1]: the newest token, first of the next draft block
    batch: Tensor  # 0-D: number of requests
    draft_lens: Tensor  # int32 [batch]: the step's draft_lens input
    # A draft tree's rows: each row's cache slot (anchor slot + node index) and which valid rows sit at a slot apart
    # from their position (an accepted node deeper than its index): the runtime's rewind moves those (§6.1).
    slots: Tensor | None = None
    moved: Tensor | None = None


class DFlashConfig(PretrainedConfig):
    """The converted checkpoint's config plus the EAGLE keys the C++ runtime reads from the engine's config.json."""

    def __init__(
        self,
        *,
        base_architecture: str,
        dflash_config: dict,
        draft_len_schedule: str | None = None,
        draft_tree: int | None = None,
        **kwargs,
    ):
        for derived in ("num_eagle_layers", "max_non_leaves_per_layer", "eagle_net_config"):
            kwargs.pop(derived, None)
        # The drafter exactly as the converter and the golden model parse it (the key spelling lives there).
        draft = draft_spec_from_config({**kwargs, "dflash_config": dflash_config})
        super().__init__(**kwargs)
        self.base_architecture = base_architecture
        self.dflash_config = dict(dflash_config)
        self.draft: DraftSpec = draft
        k = draft.num_drafts
        # A draft tree of N nodes (0: the chain) verifies N drafts per request: the EAGLE max_draft_len.
        self.tree_nodes = engine_tree_nodes(draft_tree, k, draft.dflash2 is not None)
        self.draft_tree = self.tree_nodes or None
        self.max_draft_len = self.tree_nodes or k
        # GptJsonConfig: num_eagle_layers = tree depth, eagle_net_config.num_hidden_layers = extra pool layers.
        self.num_eagle_layers = k
        self.max_non_leaves_per_layer = 1
        self.eagle_net_config = {"num_hidden_layers": draft.num_hidden_layers}
        # How many drafts each request verifies in the next step (a tree's node budget), by the step's load
        # (draft_schedule.py); the engine's config.json keeps its text, so a runner sees what the network computes.
        self.schedule: DraftLenSchedule = engine_schedule(draft_len_schedule, self.max_draft_len)
        self.draft_len_schedule = self.schedule.text()

    def to_dict(self) -> dict:
        """The engine's config.json: the checkpoint's keys (the typed spec is derived from `dflash_config`) and the
        draft-length schedule's text."""
        output = super().to_dict()
        output.pop("draft", None)
        output.pop("tree_nodes", None)
        output.pop("schedule", None)
        return output

    def target_config(self) -> PretrainedConfig:
        """The stock Qwen/Llama config the target's decoder layers are built from (same mapping and quantization)."""
        fields = {key: value for key, value in self.to_dict().items() if key not in DFLASH_KEYS}
        fields.update(architecture=self.base_architecture, mapping=self.mapping, quantization=self.quantization)
        if self.base_architecture == "Qwen3ForCausalLM":
            return QWenConfig(qwen_type="qwen3", seq_length=8192, **fields)
        if self.base_architecture == "Qwen3MoeForCausalLM":
            # `moe` (a MoeConfig dict) and `moe_intermediate_size` come from the checkpoint; every layer is sparse.
            # MixtureOfExperts fuses up|gate into one GEMM only for a gated activation, hence swiglu (as
            # QWenConfig.from_hugging_face sets it for qwen3_moe).
            fields["hidden_act"] = "swiglu"
            return QWenConfig(qwen_type="qwen3_moe", seq_length=8192, **fields)
        return LLaMAConfig(**fields)


class DFlashDraftLayer(Module):
    """One DFlash draft layer: Qwen3-style block whose attention K/V also hold the injected context."""

    def __init__(self, config: DFlashConfig, index: int):
        super().__init__()
        d = config.draft
        mapping = config.mapping
        self.input_layernorm = RmsNorm(normalized_shape=d.hidden_size, eps=d.rms_norm_eps, dtype=config.dtype)
        # Causal mask type: spec-decoding generation runs on XQA, which needs it; the block mask does the rest.
        self.attention = Attention(
            local_layer_idx=config.num_hidden_layers + index,
            hidden_size=d.hidden_size,
            attention_head_size=d.head_dim,
            num_attention_heads=d.num_attention_heads,
            num_kv_heads=d.num_key_value_heads,
            max_position_embeddings=config.max_position_embeddings,
            dtype=config.dtype,
            attention_mask_type=AttentionMaskType.causal,
            bias=d.attention_bias,
            dense_bias=d.attention_bias,
            position_embedding_type=config.position_embedding_type,
            rotary_embedding_base=d.rope.theta,
            rotary_embedding_scaling=rotary_scaling(d.rope),
            tp_group=mapping.tp_group,
            tp_size=mapping.tp_size,
            tp_rank=mapping.tp_rank,
            quant_mode=config.quant_mode,
            qk_layernorm=True,
            layernorm_type=LayerNormType.RmsNorm,
            eps=d.rms_norm_eps,
        )
        self.post_layernorm = RmsNorm(normalized_shape=d.hidden_size, eps=d.rms_norm_eps, dtype=config.dtype)
        self.mlp = GatedMLP(
            hidden_size=d.hidden_size,
            ffn_hidden_size=d.intermediate_size,
            hidden_act=d.hidden_act,
            dtype=config.dtype,
            bias=False,
            tp_group=mapping.tp_group,
            tp_size=mapping.tp_size,
            quant_mode=config.quant_mode,
        )
        # DFlash2: a grouped dynamic causal convolution around attention and around the MLP.
        self.attention_conv = self.mlp_conv = None
        if d.dflash2 is not None:
            conv = (d.hidden_size, d.dflash2.conv_kernel_size, d.dflash2.conv_group_size, d.block_size, config.dtype)
            self.attention_conv = GroupedDynamicConv(*conv)
            self.mlp_conv = GroupedDynamicConv(*conv)

    def context_kv(self, feature: Tensor) -> Tensor:
        """K|V columns of this layer's qkv projection of the fused target feature (no input_layernorm)."""
        attn = self.attention
        q_cols = attn.num_attention_heads * attn.attention_head_size
        kv_cols = 2 * attn.num_attention_kv_heads * attn.attention_head_size
        qkv = attn.qkv(feature)
        return slice(qkv, [0, q_cols], concat([shape(qkv, 0), kv_cols]))

    def forward(self, hidden_states, spec_decoding_params, kv_cache_params, attention_params, batch):
        """The block rows `[requests * B, hidden]` through the layer (`batch`: the request count, for DFlash2's
        convolutions along each request's slots)."""
        x = self.input_layernorm(hidden_states)
        attention_conv = self.attention_conv
        if attention_conv is not None:
            coefficients = attention_conv.coefficients(x, batch)
            x = attention_conv.convolve(x, coefficients, BEFORE, batch)
        attention_output, _ = self.attention(
            x,
            use_cache=True,
            spec_decoding_params=spec_decoding_params,
            kv_cache_params=kv_cache_params,
            attention_params=attention_params,
        )
        if attention_conv is not None:
            attention_output = attention_conv.convolve(attention_output, coefficients, AFTER, batch)
        hidden_states = hidden_states + attention_output
        x = self.post_layernorm(hidden_states)
        mlp_conv = self.mlp_conv
        if mlp_conv is None:
            return hidden_states + self.mlp(x)
        coefficients = mlp_conv.coefficients(x, batch)
        return hidden_states + mlp_conv.convolve(
            self.mlp(mlp_conv.convolve(x, coefficients, BEFORE, batch)), coefficients, AFTER, batch
        )


class DFlashDrafter(Module):
    """`dflash.*`: fc + hidden_norm fuse the taps; the layers; ln_f. Embeddings and lm_head are the target's."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        d = config.draft
        hidden = d.hidden_size
        # Replicated on every rank, as the converter writes dflash.fc (unsplit): its output feeds every rank's
        # context K/V, and the GEMM is small next to the target's.
        self.fc = ColumnLinear(
            len(d.target_layer_ids) * config.hidden_size,
            hidden,
            bias=False,
            dtype=config.dtype,
            tp_group=None,
            tp_size=1,
            gather_output=True,
        )
        self.hidden_norm = RmsNorm(normalized_shape=hidden, eps=d.rms_norm_eps, dtype=config.dtype)
        self.layers = ModuleList([DFlashDraftLayer(config, i) for i in range(d.num_hidden_layers)])
        self.ln_f = RmsNorm(normalized_shape=hidden, eps=d.rms_norm_eps, dtype=config.dtype)
        if d.dflash2 is not None:
            selector = d.dflash2
            self.selector = CandidateSelector(
                config.vocab_size, hidden, selector.selector_rank, selector.selector_top_k, config.dtype
            )
        if d.draft_vocab_size is not None:  # a reduced vocabulary's own head and id map
            self.lm_head = replicated_linear(hidden, d.draft_vocab_size, config.dtype)
            self.d2t = Parameter(shape=(d.draft_vocab_size,), dtype="int32")
        # The drafter's own RoPE tables (the attention plugin takes them per call from AttentionParams, and its
        # RoPE fields per layer), built the way the model-wide ones are, from the drafter's RoPE parameters.
        rope = copy.copy(config)
        rope.rotary_base, rope.rotary_scaling = d.rope.theta, rotary_scaling(d.rope)
        Attention.create_attention_const_params(self, rope)
        self.position_embedding_type = config.position_embedding_type


class DFlashTarget(Module):
    """`transformer.*`: stock embedding, decoder layers and ln_f, with a layer loop that keeps the taps."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        target = config.target_config()
        layer_cls = LLaMADecoderLayer if config.base_architecture == "LlamaForCausalLM" else QWenDecoderLayer
        self.vocab_embedding = Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype)
        self.layers = ModuleList([layer_cls(target, i) for i in range(config.num_hidden_layers)])
        for layer in self.layers:
            # QWenDecoderLayer builds its q/k RmsNorm without eps (Attention's default 1e-5); the config's is exact.
            for norm in (getattr(layer.attention, "q_layernorm", None), getattr(layer.attention, "k_layernorm", None)):
                if norm is not None:
                    norm.eps = config.norm_epsilon
        self.ln_f = RmsNorm(normalized_shape=config.hidden_size, eps=config.norm_epsilon, dtype=config.dtype)
        self.taps = config.draft.target_layer_ids

    def forward(self, input_ids, spec_decoding_params, kv_cache_params, attention_params, generation=None):
        """Returns (ln_f output, concat of tap layer outputs): tap i = output of layer i = HF hidden_states[i+1].
        With `generation` (a BlockAttention), each layer's generation requests run on DFlashAttention."""
        hidden_states = self.vocab_embedding(input_ids)
        taps = {EMBEDDING_TAP: hidden_states}  # tap -1: the embedding output, HF hidden_states[0]
        for index, layer in enumerate(self.layers):
            with dflash_attention(layer.attention, generation):
                hidden_states, _ = layer(
                    hidden_states,
                    use_cache=True,
                    spec_decoding_params=spec_decoding_params,
                    kv_cache_params=layer_kv_params(kv_cache_params),
                    attention_params=attention_params,
                )
            if index in self.taps:
                taps[index] = hidden_states
        final = self.ln_f(hidden_states)
        if index in self.taps:  # HF's hidden_states[-1], the reference's tap of the last layer, is after ln_f
            taps[index] = final
        return final, concat([taps[i] for i in self.taps], dim=-1)


def layer_kv_params(
    params: KeyValueCacheParams, host_past_key_value_lengths: Tensor | None = None
) -> KeyValueCacheParams:
    """Per-layer KV params as DecoderLayerList builds them (paged pool: no per-layer past tensor)."""
    if host_past_key_value_lengths is None:
        host_past_key_value_lengths = params.host_past_key_value_lengths
    return KeyValueCacheParams(
        past_key_value=[None],
        host_past_key_value_lengths=host_past_key_value_lengths,
        host_max_attention_window_sizes=params.host_max_attention_window_sizes,
        host_sink_token_length=params.host_sink_token_length,
        kv_cache_block_offsets=params.kv_cache_block_offsets,
        host_kv_cache_block_offsets=params.host_kv_cache_block_offsets,
        host_kv_cache_pool_pointers=params.host_kv_cache_pool_pointers,
        host_kv_cache_pool_mapping=params.host_kv_cache_pool_mapping,
        cache_indirection=params.cache_indirection,
    )


def refuse_unsupported(config: DFlashConfig) -> None:
    """What dflash-trt build refuses, repeated because trtllm-build may be run by hand."""
    d = config.draft
    if config.mapping.pp_size != 1:
        raise ValueError("DFlash engines do not support pipeline parallelism")
    if (d.num_key_value_heads, d.head_dim) != (config.num_key_value_heads, config.head_size):
        raise ValueError("the drafter's KV geometry differs from the target's; the shared KV pool cannot hold it")
    sparse = getattr(config, "moe_sparse_layers", None)
    if sparse is not None and len(sparse) != config.num_hidden_layers:
        raise ValueError("the stock Qwen3-MoE decoder layers are all sparse; dense layers among them cannot be built")


class DFlashForCausalLM(DecoderModelForCausalLM):
    config_class = DFlashConfig

    def __init__(self, config: DFlashConfig):
        refuse_unsupported(config)
        lm_head = ColumnLinear(
            config.hidden_size,
            pad_vocab_size(config.vocab_size, config.mapping.tp_size),
            bias=False,
            dtype=config.dtype,
            tp_group=config.mapping.tp_group,
            tp_size=config.mapping.tp_size,
            gather_output=True,
        )
        super().__init__(config, DFlashTarget(config), lm_head)
        self.dflash = DFlashDrafter(config)
        self.block_size = config.draft.block_size
        self.max_draft_len = config.max_draft_len  # drafts verified per request: the chain's K or a tree's nodes
        self.num_drafts = config.draft.num_drafts  # draft slots of the block: the chain's length, a tree's depth
        self.mask_token_id = config.draft.mask_token_id
        self.draft_rope = config.draft.rope
        # Which attention serves each pass: the GPU the engine is built for (attention_route.py), read when the
        # network is built unless set first (the CPU emulation sets the one of the GPU it emulates).
        self.attention_route: AttentionRoute | None = None
        vocab = config.draft.draft_vocab_size or config.vocab_size
        self.tree = TreeShape(self.num_drafts, config.tree_nodes, vocab) if config.tree_nodes else None

    def route(self) -> AttentionRoute:
        if self.attention_route is None:
            self.attention_route = route_for_build()
        if self.tree is not None:
            self.attention_route.check_tree(f"SM{self.attention_route.sm}", self.tree.nodes)
        return self.attention_route

    def verify(
        self, logits, draft_tokens, draft_lens, draft_paths, temperature, rand_data_validation, rand_data_sample
    ) -> TreeVerdict:
        """The target's draw at every verified slot (§6; a tree's node i draws with uniform i), and what it accepts:
        the chain's longest matching prefix, or the tree's walk from the anchor (§6.1)."""
        drawn, num_accepted = verify_drafts(
            cast(logits, "float32"),
            draft_tokens,
            draft_lens,
            temperature,
            rand_data_validation,
            rand_data_sample,
            self.config.vocab_size,
            self.max_draft_len,
        )
        if self.tree is None:  # one chain: the accepted path is always path 0
            return TreeVerdict(drawn, num_accepted, expand(i32([0]), shape(draft_lens)), None)
        return verify_tree(drawn, draft_tokens, draft_lens, draft_paths, self.tree)

    def forward(
        self,
        input_ids,
        position_ids,
        use_cache,
        last_token_ids,
        kv_cache_params,
        attention_params,
        spec_decoding_params,
        draft_tokens,
        draft_lens,
        eagle_temperature,
        rand_data_validation,
        rand_data_sample,
        host_gen_eagle_net_request_types,
        host_gen_eagle_net_context_lengths,
        host_gen_eagle_net_past_key_value_lengths,
        input_gen_tokens=None,
        attention_mask=None,
        draft_paths=None,
    ):
        assert use_cache and default_net().plugin_config.paged_kv_cache
        attention_params = Attention.fill_attention_params(self, attention_params)
        generation = self.target_generation_attention(input_gen_tokens)
        hidden_states, taps = self.transformer(
            input_ids, spec_decoding_params, kv_cache_params, attention_params, generation
        )

        # Target logits, exactly as DecoderModelForCausalLM marks them.
        last = gather_last_token_logits(hidden_states, last_token_ids, default_net().plugin_config.remove_input_padding)
        logits = self.lm_head(last)
        logits.mark_output("logits", self.config.logits_dtype)

        verdict = self.verify(
            logits, draft_tokens, draft_lens, draft_paths, eagle_temperature, rand_data_validation, rand_data_sample
        )
        book = self.bookkeeping(
            input_ids,
            position_ids,
            attention_params.context_lengths,
            draft_lens,
            verdict.accepted_tokens,
            verdict.num_accepted,
            draft_paths,
            verdict.accepted_nodes,
        )
        context = self.context_kv(taps)
        written = self.write_context(context, book, kv_cache_params, book.positions, book.valid, book.ctx_len)
        drafts = self.draft_block(
            book,
            written,
            kv_cache_params,
            attention_params,
            spec_decoding_params,
            host_gen_eagle_net_request_types,
            host_gen_eagle_net_context_lengths,
            host_gen_eagle_net_past_key_value_lengths,
        )
        if self.tree is None:
            next_draft_tokens = self.choose_drafts(drafts, book.anchor, book.batch)
            next_draft_lens = self.next_draft_lens(draft_lens)
            # One chain: the next step's paths are the chain again.
            width = self.max_draft_len + 1
            paths = concat([shape(draft_lens, 0), width, width])
            next_draft_paths = expand(i32([chain_draft_paths(self.max_draft_len)]), paths)
        else:
            tree = self.draft_trees(drafts, self.next_draft_lens(draft_lens), book.batch)
            # Once the block pass has read the context: each moved node's K/V where the rewind takes it from.
            assert book.slots is not None and book.moved is not None
            next_draft_tokens = self.write_context(context, book, kv_cache_params, book.slots, book.moved, tree.tokens)
            next_draft_lens, next_draft_paths = tree.count, tree.paths

        verdict.accepted_tokens.mark_output("accepted_tokens")
        verdict.num_accepted.mark_output("num_accepted_tokens")
        verdict.accepted_path.mark_output("accepted_paths")
        next_draft_tokens.mark_output("next_draft_tokens")
        next_draft_lens.mark_output("next_draft_lens")
        next_draft_paths.mark_output("next_draft_paths")
        return next_draft_tokens

    def target_generation_attention(self, input_gen_tokens) -> BlockAttention | None:
        """How the target's generation requests attend: on our plugin where the route says so, else stock (None); a
        tree engine's with the runtime's packed tree mask and position offsets, a chain's with the causal mask."""
        if self.route().target_generation != OURS:
            return None
        if input_gen_tokens is None:
            raise ValueError("the target's DFlashAttention needs the input_gen_tokens input (prepare_inputs)")
        return BlockAttention(causal=True, generation_tokens=input_gen_tokens, tree=self.tree is not None)

    def next_draft_lens(self, draft_lens: Tensor) -> Tensor:
        """Every request's draft length for the next step, from this step's load (its number of requests) through
        the build's schedule: the full K below the first threshold. The drafter always drafts the whole block; the
        runtime keeps the first `next_draft_lens` drafts (trtGptModelInflightBatching `updateRequests`). On a tree
        engine this is each request's node budget (at most N; up to K the chain, §6.1)."""
        load = cast(shape(draft_lens, 0), "int32")
        lengths = expand(i32([self.max_draft_len]), shape(draft_lens))
        for min_requests, k in self.config.schedule.steps:
            lengths = where(load > min_requests - 1, i32([k]), lengths)
        return lengths

    def bookkeeping(
        self,
        input_ids,
        position_ids,
        context_lengths,
        draft_lens,
        accepted_tokens,
        num_accepted,
        draft_paths=None,
        accepted_nodes=None,
    ) -> StepBook:
        """Per-token request index, position and validity; per-request drafter context length and anchor (§2.3).

        The runtime gives a context request one position id per input token but a generation request a single one
        (the anchor's), since EAGLE mode does not update position ids (runtimeBuffers.cpp `setFromInputs`). A draft
        tree's rows (§6.1): row t of a generation request is node t, at the anchor's position plus its depth,
        injected when it is on the accepted path.
        """
        is_generation = draft_lens > 0
        in_len = where(is_generation, draft_lens + 1, context_lengths)
        valid_len = where(is_generation, num_accepted, in_len)
        # cumsum without the plugin builds [n, n] intermediates: only batch-length vectors go through it.
        ends = cumsum(in_len, 0, prefer_plugin=False)
        starts = ends - in_len
        position_rows = where(is_generation, 1, in_len)
        first_position = index_select(position_ids, 0, cumsum(position_rows, 0, prefer_plugin=False) - position_rows)
        # The request of packed row t is the number of requests ending at or before it: a [tokens, batch] compare.
        rows = arange(i32(0), shape(input_ids, 0), "int32")
        request = sum(cast(unsqueeze(ends, 0) < unsqueeze(rows, 1) + 1, "int32"), dim=1)
        local = rows - index_select(starts, 0, request)
        valid = cast(local < index_select(valid_len, 0, request), "int32")
        first = index_select(first_position, 0, request)
        anchor = gather(accepted_tokens, 1, unsqueeze(num_accepted - 1, 1))
        book = StepBook(
            request, valid, first + local, first_position + valid_len, anchor, shape(draft_lens, 0), draft_lens
        )
        if draft_paths is None:
            return book
        nodes = self.max_draft_len + 1
        node = where(local < nodes, local, 0)  # a context row's index may exceed the tree's
        depth = index_select(path_depths(draft_paths).view([-1]), 0, request * nodes + node)
        on_path = sum(cast(eq(index_select(accepted_nodes, 0, request), unsqueeze(local, 1)), "int32"), dim=1) > 0
        tree_row = index_select(cast(is_generation, "int32"), 0, request) > 0
        valid = where(tree_row, cast(on_path, "int32"), valid)
        moved = cast(tree_row, "int32") * cast(on_path, "int32") * (1 - cast(eq(depth, local), "int32"))
        positions = first + where(tree_row, depth, local)
        return replace(book, valid=valid, positions=positions, slots=first + local, moved=moved)

    def context_kv(self, taps) -> list[tuple[list[int], Tensor, Tensor, Tensor | None]]:
        """Per injection call (all draft layers, or one per layer with an FP8 cache): the layers, their fused K/V of
        `hidden_norm(fc(taps))`, their k_norm weights and KV scale."""
        feature = self.dflash.hidden_norm(self.dflash.fc(taps))
        layers = list(self.dflash.layers)
        # One plugin call for all layers, unless an FP8 cache needs each layer's own KV scale.
        fp8_cache = layers[0].attention.kv_cache_scaling_factor is not None
        groups = [[i] for i in range(len(layers))] if fp8_cache else [list(range(len(layers)))]
        return [
            (
                group,
                concat([layers[i].context_kv(feature) for i in group], dim=-1),
                concat([unsqueeze(layers[i].attention.k_layernorm.weight.value, 0) for i in group], dim=0),
                layers[group[0]].attention.kv_cache_rcp_scaling_factor.value if fp8_cache else None,
            )
            for group in groups
        ]

    def write_context(self, context, book: StepBook, kv_cache_params, slots, valid, passthrough) -> Tensor:
        """Write the `valid` rows' context K/V (rotated at their positions) at `slots` of every draft layer's pages;
        returns the copy of `passthrough` that orders what reads it after the write."""
        first = self.dflash.layers[0].attention
        geometry = {
            "num_kv_heads": first.num_attention_kv_heads,
            "head_dim": first.attention_head_size,
            "tokens_per_block": default_net().plugin_config.tokens_per_block,
            "rope": self.draft_rope,
            "eps": self.config.draft.rms_norm_eps,
        }
        token = passthrough
        for group, ctx_kv, k_norm, scale in context:
            token = kv_injection_layer(
                ctx_kv,
                k_norm,
                book.positions,
                slots,
                book.request,
                valid,
                kv_cache_params.kv_cache_block_offsets,
                kv_cache_params.host_kv_cache_pool_pointers,
                kv_cache_params.host_kv_cache_pool_mapping,
                passthrough=token,
                geometry=KVInjectionGeometry(
                    num_layers=len(group), layer_idx_offset=self.config.num_hidden_layers + group[0], **geometry
                ),
                kv_scale_orig_quant=scale,
            )
        return token

    def draft_block(
        self,
        book: StepBook,
        written,
        kv_cache_params,
        attention_params,
        spec_decoding_params,
        host_request_types,
        host_context_lengths,
        host_past_key_value_lengths,
    ) -> Tensor:
        """Run `[anchor, MASK x (B - 1)]` through the draft layers as one spec-decoding generation step; returns the
        hidden rows `[requests * K, H]` of its draft slots (1.., or 0.. when the anchor's slot drafts)."""
        b, k = self.block_size, self.num_drafts
        batch = book.batch
        masks = expand(i32([[self.mask_token_id]]), concat([batch, b - 1]))
        block_ids = concat([book.anchor, masks], dim=1).view(concat([batch * b]))
        ctx_len = written  # the injection's passthrough copy: the block pass cannot start before the cache write
        hidden = self.transformer.vocab_embedding(block_ids)
        scale = self.config.draft.input_embedding_scale
        if scale != 1.0:
            hidden = hidden * scale

        params = Attention.fill_attention_params(self.dflash, copy.copy(attention_params))
        params.sequence_length = ctx_len + b
        params.context_lengths = ctx_len
        params.host_request_types = host_request_types
        params.host_context_lengths = host_context_lengths
        kv_params = layer_kv_params(kv_cache_params, host_past_key_value_lengths)
        offsets = expand(i32([list(range(b))]), concat([batch, b]))
        lengths = expand(i32([b]), shape(book.draft_lens))
        draft = self.config.draft
        for index, layer in enumerate(self.dflash.layers):
            # [requests * B, words], the layout of the runtime's own spec_decoding_packed_mask input.
            packed = np.array([block_packed_mask(b, draft.causal[index])], dtype=np.int32)
            words = packed.shape[2]
            mask = expand(i32(packed), concat([batch, b, words])).view(concat([batch * b, words]))
            spec = SpecDecodingParams(True, b, lengths, offsets, mask, spec_decoding_params.spec_decoding_use)
            ours = self.route().draft_layer(draft.layer_types[index] == SLIDING_ATTENTION) == OURS
            block = None
            if ours:
                window, from_anchor = draft.layer_window(index), draft.window_from_anchor
                block = BlockAttention(causal=draft.causal[index], window=window, window_from_anchor=from_anchor)
            with dflash_attention(layer.attention, block):
                hidden = layer(hidden, spec, kv_params, params, batch)
        hidden = self.dflash.ln_f(hidden).view(concat([batch, b, shape(hidden, 1)]))
        first = self.config.draft.first_draft_slot
        drafts = slice(hidden, [0, first, 0], concat([batch, k, shape(hidden, 2)]))
        return drafts.view(concat([batch * k, shape(hidden, 2)]))

    def draft_logits(self, hidden: Tensor, batch: Tensor) -> tuple[Tensor, Tensor | None]:
        """float32 logits `[requests * K, V]` of the draft slots' hidden rows over the target's vocabulary
        (multiplier, softcap), or over a reduced one with its target ids `[V]`."""
        k, d = self.num_drafts, self.config.draft
        if d.draft_vocab_size is not None:
            logits = cast(self.dflash.lm_head(hidden), "float32")
            return logits, draft_vocabulary_map(self.dflash.d2t, d.draft_vocab_size)
        logits = cast(self.lm_head(hidden), "float32")
        logits = slice(logits, [0, 0], concat([batch * k, self.config.vocab_size]))
        if d.output_multiplier != 1.0:
            logits = logits * d.output_multiplier
        if d.final_logit_softcapping:
            logits = tanh(logits * (1.0 / d.final_logit_softcapping)) * d.final_logit_softcapping
        return logits, None

    def choose_drafts(self, hidden: Tensor, anchor: Tensor, batch: Tensor) -> Tensor:
        """int32 `[requests, K]` drafts from the draft slots' hidden rows: each slot's argmax over the target's
        vocabulary or a reduced one (mapped to target ids), or DFlash2's selector walk."""
        k = self.num_drafts
        logits, ids = self.draft_logits(hidden, batch)
        if ids is not None:
            picked = argmax(logits, -1, keepdim=True).view(concat([batch * k]))
            return index_select(ids, 0, picked).view(concat([batch, k]))
        if self.config.draft.dflash2 is not None:
            return self.dflash.selector.walk(logits, hidden, anchor, batch, k)
        return cast(argmax(logits, -1, keepdim=True), "int32").view(concat([batch, k]))

    def draft_trees(self, hidden: Tensor, budget: Tensor, batch: Tensor) -> EngineTree:
        """Each request's draft tree of at most `budget` nodes from the draft slots' hidden rows (§6.1)."""
        assert self.tree is not None
        logits, ids = self.draft_logits(hidden, batch)
        return best_trees(logits, ids, budget, self.tree, batch)

    def prepare_inputs(self, *args, **kwargs):
        """The standard GPT inputs for target + draft pool layers, plus the EAGLE inputs DFlash reads (§3)."""
        k = self.max_draft_len
        kwargs["speculative_decoding_draft_tokens_external"] = False
        kwargs["max_draft_len"] = k
        kwargs["spec_decoding_is_generation_length_variable"] = True
        kwargs["num_hidden_layers"] = self.config.num_hidden_layers + self.config.eagle_net_config["num_hidden_layers"]
        inputs = super().prepare_inputs(*args, **kwargs)
        assert inputs["spec_decoding_params"] is not None

        plugin_config = default_net().plugin_config
        kv_cache_type = KVCacheType.PAGED if plugin_config.paged_kv_cache else KVCacheType.CONTINUOUS
        ctx_gen_profiles = GenerationMixin.has_ctx_gen_opt_profiles(
            use_gpt_attention_plugin=plugin_config.gpt_attention_plugin,
            use_gemm_plugin=plugin_config.gemm_plugin,
            remove_input_padding=plugin_config.remove_input_padding,
            kv_cache_type=kv_cache_type,
        )
        _, ranges = GenerationMixin.get_profiles_ranges(
            max_batch_size=kwargs["max_batch_size"],
            max_beam_width=kwargs["max_beam_width"],
            max_input_len=kwargs["max_input_len"],
            max_num_tokens=kwargs["max_num_tokens"],
            max_draft_len=k,
            opt_batch_size=kwargs.get("opt_batch_size"),
            opt_num_tokens=kwargs.get("opt_num_tokens"),
            enable_ctx_gen_opt_profiles=ctx_gen_profiles,
            multiple_profiles=plugin_config.multiple_profiles,
            kv_cache_type=kv_cache_type,
        )
        bb_range = ranges["bb_range"]
        profiles = len(bb_range)

        def declare(name, dtype, dims):
            return Tensor(
                name=name,
                dtype=dtype,
                shape=[-1 if n == "batch_size" else v[0] for n, v in dims],
                dim_range=OrderedDict(dims),
            )

        batch = ("batch_size", bb_range)
        draft_len = ("draft_len", [k] * profiles)
        decoding_len = ("decoding_len", [k + 1] * profiles)
        if self.tree is not None:  # the verified tree's paths (§6.1): the previous step's next_draft_paths
            path_len = ("path_len", [self.num_drafts + 1] * profiles)
            inputs["draft_paths"] = declare("draft_paths", trt.int32, [batch, decoding_len, path_len])
        inputs["draft_tokens"] = declare("draft_tokens", trt.int32, [batch, draft_len])
        inputs["draft_lens"] = declare("draft_lens", trt.int32, [batch])
        inputs["eagle_temperature"] = declare("eagle_temperature", trt.float32, [batch])
        inputs["rand_data_validation"] = declare("rand_data_validation", trt.float32, [batch, decoding_len])
        inputs["rand_data_sample"] = declare("rand_data_sample", trt.float32, [batch])
        for name in EAGLE_INPUTS[-3:]:
            inputs[name] = declare(name, trt.int32, [batch])
        if self.route().target_generation == OURS:
            # Only its shape is read: the step's generation tokens, which split the batch (generation_attention.py).
            gen_tokens = GenerationMixin.default_range(kwargs["max_batch_size"] * (k + 1), min_range=0, opt_offset=1)
            inputs["input_gen_tokens"] = declare(
                "input_gen_tokens", trt.int32, [("gen_tokens", [gen_tokens] * profiles)]
            )
        return inputs


MODEL_MAP[ARCHITECTURE] = DFlashForCausalLM
