"""Torch golden model of a converted checkpoint: the target and the DFlash drafter exactly as the engine runs them.

Batched over sequences of different lengths with explicit positions, so one forward serves a ragged prefill, a
verify block per sequence, or a draft block per sequence. KV caches are contiguous per sequence; a rewind is just
a smaller length, because stale entries past it are overwritten before any query can see them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash_trt import tensor_names as names
from dflash_trt.checkpoint.draft_vocabulary import check_target_ids, target_ids
from dflash_trt.checkpoint.integrity import check_integrity
from dflash_trt.checkpoint.layout import checkpoint_layout, stored_split
from dflash_trt.checkpoint.safetensors_io import SafetensorsFile, tensor_has_nonfinite
from dflash_trt.checkpoint.sharding import merge
from dflash_trt.checkpoint.trtllm_config import specs_from_config
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import NONE, checkpoint_fp8_context_fmha
from dflash_trt.jsonfile import read_json_object
from dflash_trt.reference.conv import AFTER, BEFORE, GroupedDynamicConv
from dflash_trt.reference.kv_injection import injected_kv
from dflash_trt.reference.norm import rms_norm
from dflash_trt.reference.proposal import CandidateSelector, DraftChoice, DraftHead
from dflash_trt.reference.quantized import (
    attention_output_orig_quant_scale,
    dequantized_weight,
    fake_quantize_fp8,
    fake_quantize_input,
    fp8_attention_rows,
    fp8_context_attention,
    weight_format,
)
from dflash_trt.rope import apply_rope, rope_cos_sin
from dflash_trt.spec import EMBEDDING_TAP, DraftSpec, MoeSpec, TargetSpec

Observer = Callable[[str, torch.Tensor], None]


@dataclass
class Linear:
    """One linear as the engine runs it: dequantized weight, and its input rounded the way the engine rounds it."""

    name: str
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    input_format: str = NONE
    input_scale: torch.Tensor | None = None
    observer: Observer | None = None  # calibration sees every input before rounding

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.observer is not None:
            self.observer(self.name, x)
        return F.linear(fake_quantize_input(x, self.input_scale, self.input_format), self.weight, self.bias)

    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], module: str, dtype: torch.dtype) -> Linear:
        weight = tensors[f"{module}.{names.WEIGHT}"]
        bias = tensors.get(f"{module}.{names.BIAS}")
        scale = tensors.get(f"{module}.{names.ACTIVATION_SCALING_FACTOR}")
        return cls(
            module,
            dequantized_weight(tensors, module).to(dtype),
            None if bias is None else bias.to(dtype),
            weight_format(weight),
            scale,
        )


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights and indices `[tokens, top_k]` from fp32 router logits, as TensorRT-LLM's MixtureOfExperts
    routes: RENORMALIZE takes the top-k logits and softmaxes over them (Qwen3-MoE's norm_topk_prob), NONE softmaxes
    over all experts and keeps the top-k probabilities as they are."""
    if renormalize:
        top, chosen = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1), chosen
    return torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)


@dataclass
class SparseMlp:
    """A mixture-of-experts MLP as TensorRT-LLM's MoE plugin runs it: float32 router on the unrounded input, top-k
    SwiGLU experts, routing-weighted sum. With quantized experts the fc input and the experts' intermediate are
    rounded with one static scale each (shared by all experts), the weights dequantized per expert."""

    prefix: str
    router: torch.Tensor  # float32 [experts, hidden]
    fc: torch.Tensor  # [experts, 2 * inter, hidden]: up_proj rows, then gate_proj rows
    proj: torch.Tensor  # [experts, hidden, inter]
    top_k: int
    renormalize: bool
    input_format: str = NONE
    fc_input_scale: torch.Tensor | None = None
    proj_input_scale: torch.Tensor | None = None
    observer: Observer | None = None  # calibration sees the fc input and every expert's intermediate

    @property
    def fc_name(self) -> str:
        return f"{self.prefix}.{names.MOE_FC}"

    @property
    def proj_name(self) -> str:
        return f"{self.prefix}.{names.MOE_PROJ}"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        observer = self.observer
        if observer is not None:
            observer(self.fc_name, x)
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = route(F.linear(flat.float(), self.router), self.top_k, self.renormalize)
        rounded = fake_quantize_input(flat, self.fc_input_scale, self.input_format)
        out = torch.zeros_like(flat)
        inter = self.fc.shape[1] // 2
        seen = flat.new_zeros(*chosen.shape, inter) if observer is not None else None
        for expert in chosen.unique().tolist():
            token, slot = (chosen == expert).nonzero(as_tuple=True)
            up, gate = F.linear(rounded[token], self.fc[expert]).split(inter, dim=-1)
            hidden = F.silu(gate) * up
            if seen is not None:
                seen[token, slot] = hidden
            y = F.linear(fake_quantize_input(hidden, self.proj_input_scale, self.input_format), self.proj[expert])
            out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
        if observer is not None and seen is not None:  # shaped like x, so the observer can drop padding rows
            observer(self.proj_name, seen.view(*x.shape[:-1], -1))
        return out.view(x.shape)

    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype, moe: MoeSpec) -> SparseMlp:
        fc, proj = f"{prefix}.{names.MOE_FC}", f"{prefix}.{names.MOE_PROJ}"
        return cls(
            prefix=prefix,
            router=tensors[names.tensor(prefix, names.MOE_ROUTER)].float(),
            fc=dequantized_weight(tensors, fc).to(dtype),
            proj=dequantized_weight(tensors, proj).to(dtype),
            top_k=moe.top_k,
            renormalize=moe.norm_topk_prob,
            input_format=weight_format(tensors[f"{fc}.{names.WEIGHT}"]),
            fc_input_scale=tensors.get(f"{fc}.{names.ACTIVATION_SCALING_FACTOR}"),
            proj_input_scale=tensors.get(f"{proj}.{names.ACTIVATION_SCALING_FACTOR}"),
        )


@dataclass
class LayerWeights:
    """One decoder layer under TensorRT-LLM names (qkv fused; mlp.fc = gate_proj, mlp.gate = up_proj), or with a
    mixture-of-experts MLP (`sparse`) in place of fc / gate / proj."""

    prefix: str
    input_norm: torch.Tensor
    qkv: Linear
    dense: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    fc: Linear | None
    gate: Linear | None
    proj: Linear | None
    kv_scale: torch.Tensor | None
    kv_observer: Observer | None = None  # calibration sees every K and V this layer stores
    sparse: SparseMlp | None = None

    def qk_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The q/k norm weights of a layer that has them (every draft layer, Qwen3 target layers)."""
        if self.q_norm is None or self.k_norm is None:
            raise DFlashTrtError(f"{self.prefix} has no q/k norm weights")
        return self.q_norm, self.k_norm

    @classmethod
    def load(
        cls, tensors: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype, moe: MoeSpec | None = None
    ) -> LayerWeights:
        def norm(module: str) -> torch.Tensor | None:
            weight = tensors.get(names.tensor(prefix, module))
            return None if weight is None else weight.to(dtype)

        def lin(module: str) -> Linear:
            return Linear.load(tensors, f"{prefix}.{module}", dtype)

        return cls(
            prefix=prefix,
            input_norm=tensors[names.tensor(prefix, names.INPUT_LAYERNORM)].to(dtype),
            qkv=lin(names.QKV),
            dense=lin(names.DENSE),
            q_norm=norm(names.Q_LAYERNORM),
            k_norm=norm(names.K_LAYERNORM),
            post_norm=tensors[names.tensor(prefix, names.POST_LAYERNORM)].to(dtype),
            fc=None if moe else lin(names.MLP_FC),
            gate=None if moe else lin(names.MLP_GATE),
            proj=None if moe else lin(names.MLP_PROJ),
            kv_scale=tensors.get(names.kv_cache_scale(prefix)),
            sparse=SparseMlp.load(tensors, prefix, dtype, moe) if moe else None,
        )

    def linears(self) -> tuple[Linear, ...]:
        return tuple(lin for lin in (self.qkv, self.dense, self.fc, self.gate, self.proj) if lin is not None)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.sparse is not None:
            return self.sparse(x)
        assert self.fc and self.gate and self.proj  # a dense layer loads all three
        return self.proj(F.silu(self.fc(x)) * self.gate(x))

    def split_qkv(self, x: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
        q, k, v = self.qkv(x).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        shape = x.shape[:-1]
        return q.view(*shape, heads, head_dim), k.view(*shape, kv_heads, head_dim), v.view(*shape, kv_heads, head_dim)


class KVCache:
    """Per-layer K/V `[batch, kv_heads, capacity, head_dim]`; position p of a sequence lives at slot p.

    With an FP8 cache each layer's values are stored rounded by its `kv_cache_scaling_factor`.
    """

    def __init__(
        self, layers: list[LayerWeights], batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype
    ):
        self.layers = layers
        self.k = [torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype) for _ in layers]
        self.v = [torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype) for _ in layers]
        self.capacity = capacity

    def stored(self, layer: int, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """K or V as the cache holds it; calibration observes the `valid` rows (all when None) first."""
        weights = self.layers[layer]
        if weights.kv_observer is not None:
            weights.kv_observer(weights.prefix, x if valid is None else x[valid])
        scale = weights.kv_scale
        return x if scale is None else fake_quantize_fp8(x, scale)

    def move(self, batch: int, sources: list[int], targets: list[int]) -> None:
        """Sequence `batch`'s entries at slots `sources` copied to `targets` in every layer (all read first): the
        runtime's rewind along an accepted tree path."""
        for k, v in zip(self.k, self.v, strict=True):
            k[batch, :, targets] = k[batch, :, sources].clone()
            v[batch, :, targets] = v[batch, :, sources].clone()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor):
        """k/v `[batch, tokens, kv_heads, head_dim]` at `positions [batch, tokens]`; invalid tokens are dropped."""
        batch_index, token_index = valid.nonzero(as_tuple=True)
        slots = positions[batch_index, token_index]
        if slots.numel() and int(slots.max()) >= self.capacity:
            raise DFlashTrtError(f"sequence longer than the KV cache capacity ({self.capacity} tokens)")
        self.k[layer][batch_index, :, slots] = self.stored(layer, k[batch_index, token_index]).to(self.k[layer].dtype)
        self.v[layer][batch_index, :, slots] = self.stored(layer, v[batch_index, token_index]).to(self.v[layer].dtype)


@dataclass(frozen=True)
class TreeBlock:
    """Verify rows laid out as draft trees, as the runtime lays them out: row `t` of sequence `b` (node `t`, the anchor
    first) is stored at cache slot `slots[b, t]` = anchor slot + `t` and sees every slot before the anchor's plus the
    rows `visible[b, t]` marks (its path from the anchor)."""

    slots: torch.Tensor  # int64 [b, t]
    visible: torch.Tensor  # bool [b, t, t]

    def keys(self, key_count: int) -> torch.Tensor:
        """bool `[b, t, key_count]`: which cache slots each row attends."""
        start = self.slots[:, :1]
        keys = torch.arange(key_count)[None, :]
        visible = (keys < start)[:, None, :].expand(-1, self.slots.shape[1], -1).clone()
        rows = torch.arange(self.slots.shape[1])
        for b in range(self.slots.shape[0]):
            visible[b][:, self.slots[b, rows]] |= self.visible[b]
        return visible


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[b, t, h, d]`, k/v `[b, kv, n, d]`, visible `[b, t, n]` → `[b, t, h*d]` (GQA by head groups)."""
    groups = q.shape[2] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible[:, None], scale=scale)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


def attend_fp8_context(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, kv_scale: torch.Tensor
) -> torch.Tensor:
    """`attend` as FP8 context FMHA computes it (`fp8_context_attention`), same shapes."""
    groups = q.shape[2] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = fp8_context_attention(q.transpose(1, 2), k, v, visible[:, None], scale, kv_scale)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


class TargetModel:
    """The target decoder; returns logits and the concatenated tap features the drafter conditions on.

    `fp8_context` (FP8 / NVFP4 weights with an FP8 KV cache) makes the rows of context requests attend as the
    engine's FP8 context FMHA does; generation rows (a verified block) attend as before.
    """

    def __init__(
        self, spec: TargetSpec, tensors: dict[str, torch.Tensor], tap_layers: tuple[int, ...], dtype: torch.dtype
    ):
        self.spec = spec
        self.embedding = tensors[names.VOCAB_EMBEDDING].to(dtype)
        self.layers = [
            LayerWeights.load(tensors, names.target_layer(i), dtype, spec.moe if spec.is_sparse(i) else None)
            for i in range(spec.num_hidden_layers)
        ]
        self.final_norm = tensors[names.TARGET_FINAL_NORM].to(dtype)
        self.lm_head = Linear.load(tensors, names.LM_HEAD.removesuffix("." + names.WEIGHT), dtype)
        self.tap_layers = tap_layers
        self.fp8_context = False
        self.current_valid: torch.Tensor | None = None  # rows of the running call that are real (for observers)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        s = self.spec
        return KVCache(self.layers, batch, s.num_key_value_heads, capacity, s.head_dim, self.embedding.dtype)

    def _attention(
        self, layer: LayerWeights, q, keys, values, visible, context_rows: torch.Tensor | None
    ) -> torch.Tensor:
        """`attend`, with the context rows as FP8 context FMHA computes them when the engine runs it: in FP8, and
        written as e4m3 with the output scale the engine derives from the dense layer's input scale."""
        scale = self.spec.head_dim**-0.5
        out = attend(q, keys, values, visible, scale)
        if self.fp8_context and context_rows is not None and context_rows.any() and layer.kv_scale is not None:
            rows = context_rows
            fp8 = attend_fp8_context(q[rows], keys[rows], values[rows], visible[rows], scale, layer.kv_scale)
            dense = layer.dense
            if dense.input_scale is not None:
                orig_quant = attention_output_orig_quant_scale(dense.input_scale, dense.input_format)
                fp8 = fp8_attention_rows(fp8, orig_quant, q.dtype)
            out[rows] = fp8.to(q.dtype)
        return out

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        cache: KVCache,
        context_rows: torch.Tensor | None = None,
        tree: TreeBlock | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens/positions/valid `[b, t]` → logits `[b, t, vocab]` (fp32), taps `[b, t, n_taps * hidden]`;
        `context_rows [b]` marks the sequences this call prefills (the engine's context requests). Row `t` is stored at
        cache slot `positions[:, t]` and sees the slots up to it, unless `tree` lays the rows out as a draft tree (its
        own slots and visibility; RoPE stays at `positions`)."""
        s = self.spec
        self.current_valid = valid
        hidden = F.embedding(tokens, self.embedding)
        cos, sin = rope_cos_sin(positions, s.rope)
        cos, sin = cos[:, :, None].to(hidden.dtype), sin[:, :, None].to(hidden.dtype)
        slots = positions if tree is None else tree.slots
        key_count = int(slots.max()) + 1
        key_positions = torch.arange(key_count)
        visible = key_positions[None, None, :] <= positions[:, :, None] if tree is None else tree.keys(key_count)
        taps = {EMBEDDING_TAP: hidden}
        for index, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, s.rms_norm_eps)
            q, k, v = layer.split_qkv(x, s.num_attention_heads, s.num_key_value_heads, s.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = rms_norm(q, layer.q_norm, s.rms_norm_eps), rms_norm(k, layer.k_norm, s.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            cache.write(index, k, v, slots, valid)
            keys, values = cache.k[index][:, :, :key_count], cache.v[index][:, :, :key_count]
            hidden = hidden + layer.dense(self._attention(layer, q, keys, values, visible, context_rows))
            hidden = hidden + layer.mlp(rms_norm(hidden, layer.post_norm, s.rms_norm_eps))
            if index in self.tap_layers:
                taps[index] = hidden
        normed = rms_norm(hidden, self.final_norm, s.rms_norm_eps)
        # HF's hidden_states[-1] (what the reference taps for the last layer) is taken after the final norm.
        taps[s.num_hidden_layers - 1] = normed
        logits = self.lm_head(normed)[..., : s.vocab_size]
        return logits.float(), torch.cat([taps[i] for i in self.tap_layers], dim=-1)


class DraftModel:
    """The DFlash drafter: block queries over injected context K/V plus the block's own K/V."""

    def __init__(self, spec: DraftSpec, tensors: dict[str, torch.Tensor], target: TargetModel, dtype: torch.dtype):
        self.spec = spec
        self.target = target
        self.fc = Linear.load(tensors, names.DRAFT_FC.removesuffix("." + names.WEIGHT), dtype)
        self.hidden_norm = tensors[names.DRAFT_HIDDEN_NORM].to(dtype)
        self.final_norm = tensors[names.DRAFT_FINAL_NORM].to(dtype)
        self.layers = [LayerWeights.load(tensors, names.draft_layer(i), dtype) for i in range(spec.num_hidden_layers)]
        self.k_norms = torch.stack([layer.qk_norms()[1] for layer in self.layers])
        self.convs = _load_convs(spec, tensors, dtype)
        own_head = tensors.get(names.DRAFT_LM_HEAD) if spec.draft_vocab_size is not None else None
        self.draft_lm_head = None if own_head is None else own_head.to(dtype)
        self.head = _load_head(spec, tensors, dtype, self.unary_logits)
        self.current_valid: torch.Tensor | None = None  # rows of the running call that are real (for observers)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        s = self.spec
        return KVCache(self.layers, batch, s.num_key_value_heads, capacity, s.head_dim, self.hidden_norm.dtype)

    def inject(self, taps: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, cache: KVCache) -> None:
        """KV injection: accepted tokens' tap features → each draft layer's qkv (K|V kept) → k_norm, RoPE → cache.

        The engine's dataflow: the feature goes through every draft layer's own (possibly quantized) qkv GEMM,
        the K|V columns form `ctx_kv [tokens, layers, 2, kv_heads, head_dim]`, and `injected_kv` (the definition
        the KV-injection plugin is tested against) gives what lands in the cache.
        """
        s = self.spec
        self.current_valid = valid
        features = rms_norm(self.fc(taps), self.hidden_norm, s.rms_norm_eps)
        batch, tokens = features.shape[:2]
        q_columns = s.num_attention_heads * s.head_dim
        ctx_kv = torch.stack([layer.qkv(features)[..., q_columns:] for layer in self.layers], dim=2)
        ctx_kv = ctx_kv.reshape(batch * tokens, s.num_hidden_layers, 2, s.num_key_value_heads, s.head_dim)
        k, v = injected_kv(ctx_kv, self.k_norms, s.rms_norm_eps, positions.reshape(-1), s.rope)
        for index in range(s.num_hidden_layers):
            shape = (batch, tokens, s.num_key_value_heads, s.head_dim)
            cache.write(index, k[:, index].reshape(shape), v[:, index].reshape(shape), positions, valid)

    def forward(
        self, block: torch.Tensor, start: torch.Tensor, block_valid: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """block `[b, B]` at positions `start + arange(B)`, context = cache slots `< start` → hidden `[b, B, H]`."""
        s = self.spec
        self.current_valid = block_valid
        B = block.shape[1]
        positions = start[:, None] + torch.arange(B)
        hidden = F.embedding(block, self.target.embedding) * s.input_embedding_scale
        cos, sin = rope_cos_sin(positions, s.rope)
        cos, sin = cos[:, :, None].to(hidden.dtype), sin[:, :, None].to(hidden.dtype)
        context = int(start.max())
        ctx_positions = torch.arange(context)[None, :].expand(len(start), -1)
        key_positions = torch.cat([ctx_positions, positions], dim=1)
        key_valid = torch.cat([ctx_positions < start[:, None], block_valid], dim=1)
        anchor = start[:, None] if s.window_from_anchor else None
        for index, layer in enumerate(self.layers):
            attention_conv, mlp_conv = self.convs[index] if self.convs else (None, None)
            x = rms_norm(hidden, layer.input_norm, s.rms_norm_eps)
            if attention_conv is not None:
                coefficients = attention_conv.coefficients(x)
                x = attention_conv.convolve(x, coefficients, BEFORE)
            q, k, v = layer.split_qkv(x, s.num_attention_heads, s.num_key_value_heads, s.head_dim)
            q_norm, k_norm = layer.qk_norms()
            q, k = rms_norm(q, q_norm, s.rms_norm_eps), rms_norm(k, k_norm, s.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            # The engine writes the block's K/V into the (possibly FP8) cache before attending to it.
            block_k = cache.stored(index, k, block_valid).transpose(1, 2).to(cache.k[index].dtype)
            block_v = cache.stored(index, v, block_valid).transpose(1, 2).to(cache.v[index].dtype)
            keys = torch.cat([cache.k[index][:, :, :context], block_k], dim=2)
            values = torch.cat([cache.v[index][:, :, :context], block_v], dim=2)
            visible = draft_visibility(
                positions, key_positions, key_valid, s.causal[index], s.layer_window(index), anchor
            )
            attended = layer.dense(attend(q, keys.to(q.dtype), values.to(q.dtype), visible, s.head_dim**-0.5))
            if attention_conv is not None:
                attended = attention_conv.convolve(attended, coefficients, AFTER)
            hidden = hidden + attended
            x = rms_norm(hidden, layer.post_norm, s.rms_norm_eps)
            if mlp_conv is None:
                hidden = hidden + layer.mlp(x)
            else:
                coefficients = mlp_conv.coefficients(x)
                mlp_out = layer.mlp(mlp_conv.convolve(x, coefficients, BEFORE))
                hidden = hidden + mlp_conv.convolve(mlp_out, coefficients, AFTER)
        return rms_norm(hidden, self.final_norm, s.rms_norm_eps)

    def unary_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the draft vocabulary: the shared target lm_head with the drafter's output multiplier
        and optional tanh softcap, or a reduced vocabulary's own head."""
        if self.draft_lm_head is not None:
            return F.linear(hidden, self.draft_lm_head).float()
        logits = self.target.lm_head(hidden)[..., : self.target.spec.vocab_size].float()
        logits = logits * self.spec.output_multiplier
        cap = self.spec.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def draft_slots(self, hidden: torch.Tensor) -> torch.Tensor:
        """The block slots whose hidden states draft: 1.. (or 0.. when the anchor's slot drafts too)."""
        first = self.spec.first_draft_slot
        return hidden[:, first : first + self.spec.num_drafts]

    def choose(self, hidden: torch.Tensor, anchors: torch.Tensor) -> DraftChoice:
        """The engine's drafts from a block's hidden states `[b, B, H]` (the anchors are the block's first tokens)."""
        return self.head.choose(self.draft_slots(hidden), anchors)


def draft_visibility(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor,
    causal: bool,
    window: int | None,
    anchor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which keys each block query sees: all valid ones, minus the future (causal) and the far (window) ones.

    The window counts from each query (z-lab drafters: HF's sliding window), or, given the block's `anchor`
    positions `[b, 1]`, covers the `window` positions before the anchor and the whole block (speculators drafters).
    """
    q = query_positions[:, :, None]
    k = key_positions[:, None, :]
    visible = key_valid[:, None, :].expand(-1, q.shape[1], -1)
    if causal:
        visible = visible & (k <= q)
    if window is not None and anchor is not None:
        visible = visible & (k >= anchor[:, :, None] - window)
    elif window is not None:
        visible = visible & (q - k < window)
        if not causal:
            visible = visible & (k - q < window)
    return visible


def _load_convs(
    spec: DraftSpec, tensors: dict[str, torch.Tensor], dtype: torch.dtype
) -> list[tuple[GroupedDynamicConv, GroupedDynamicConv]]:
    """Each DFlash2 layer's convolutions around attention and around the MLP (none for v1)."""
    dflash2 = spec.dflash2
    if dflash2 is None:
        return []

    def conv(layer: int, module: str) -> GroupedDynamicConv:
        prefix = names.draft_layer(layer)
        return GroupedDynamicConv(
            base_kernel=tensors[names.tensor(prefix, module, names.CONV_BASE_KERNEL)].to(dtype),
            projection=tensors[names.tensor(prefix, f"{module}.{names.CONV_KERNEL_PROJECTION}")].to(dtype),
            group_size=dflash2.conv_group_size,
        )

    return [(conv(i, names.ATTENTION_CONV), conv(i, names.MLP_CONV)) for i in range(spec.num_hidden_layers)]


def _load_head(
    spec: DraftSpec,
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype,
    logits: Callable[[torch.Tensor], torch.Tensor],
) -> DraftHead:
    selector = None
    if spec.dflash2 is not None:
        selector = CandidateSelector(
            predecessor_codebook=tensors[names.SELECTOR_PREDECESSOR_CODEBOOK].to(dtype),
            successor_codebook=tensors[names.SELECTOR_SUCCESSOR_CODEBOOK].to(dtype),
            hidden_projection=tensors[names.SELECTOR_HIDDEN_PROJECTION].to(dtype),
            top_k=spec.dflash2.selector_top_k,
        )
    ids = None
    if spec.draft_vocab_size is not None:
        ids = target_ids(tensors[names.DRAFT_TO_TARGET].numpy())
        check_target_ids(ids, spec.vocab_size, f"checkpoint tensor '{names.DRAFT_TO_TARGET}'")
    return DraftHead(logits, None if ids is None else torch.from_numpy(ids), selector)


@dataclass
class GoldenModel:
    target: TargetModel
    draft: DraftModel
    config: dict

    def layers(self) -> list[LayerWeights]:
        return [*self.target.layers, *self.draft.layers]

    def linears(self) -> list[Linear]:
        """Every linear of target and drafter (lm_head and drafter fc included), for calibration observers."""
        return [*(lin for layer in self.layers() for lin in layer.linears()), self.target.lm_head, self.draft.fc]

    def sparse_mlps(self) -> list[SparseMlp]:
        """The target's mixture-of-experts MLPs (their experts are quantized and calibrated as stacks)."""
        return [layer.sparse for layer in self.target.layers if layer.sparse is not None]


def _belongs_to(layout: dict, name: str) -> bool:
    """A tensor of the layout, a quantization tensor of one of its linears, or a layer's KV-cache scale."""
    module = name.rsplit(".", 1)[0]
    if name in layout or f"{module}.{names.WEIGHT}" in layout:
        return True
    layer = module.rsplit(".", 1)[0]
    return name.endswith(f".{names.KV_CACHE_SCALING_FACTOR}") and f"{layer}.{names.QKV}.{names.WEIGHT}" in layout


def load_rank_tensors(
    checkpoint_dir: Path,
    tp_size: int,
    target: TargetSpec,
    draft: DraftSpec,
    dtype: torch.dtype | None = None,
    moe_ep_size: int = 1,
) -> dict:
    """All tensors of a checkpoint, shards merged back into full tensors; exactly the tensors its config promises
    (no layer silently ignored), every one finite, unquantized ones in the config's `dtype`."""
    layout = {out.name: out for out in checkpoint_layout(target, draft, moe_ep_size)}
    files = []
    try:
        for rank in range(tp_size):
            path = checkpoint_dir / f"rank{rank}.safetensors"
            if not path.is_file():
                raise DFlashTrtError(f"checkpoint {checkpoint_dir} is missing {path.name} (tp_size {tp_size})")
            files.append(SafetensorsFile(path))
        stored = sorted(files[0].names())
        for rank, f in enumerate(files[1:], start=1):
            if sorted(f.names()) != stored:
                raise DFlashTrtError(f"checkpoint {checkpoint_dir}: rank{rank} and rank0 hold different tensors")
        extra = [name for name in stored if not _belongs_to(layout, name)]
        if extra:
            raise DFlashTrtError(
                f"checkpoint {checkpoint_dir} holds tensor '{extra[0]}', which its config.json does not describe "
                "(was config.json edited?)"
            )
        tensors = {}
        for name in stored:
            pieces = [f.get(name, copy=True) for f in files]
            if any(tensor_has_nonfinite(piece) for piece in pieces):
                raise DFlashTrtError(f"checkpoint {checkpoint_dir} tensor '{name}' holds NaN or Inf")
            # a router or an id map keeps its own dtype
            expected = layout[name].stored_torch_dtype(dtype) if name in layout else None
            if expected is not None and pieces[0].element_size() > 1 and pieces[0].dtype != expected:
                raise DFlashTrtError(
                    f"checkpoint {checkpoint_dir} tensor '{name}' is {pieces[0].dtype}, but config.json says {expected}"
                )
            split, out = stored_split(layout, name, pieces[0].dim())
            tensors[name] = merge(
                pieces, split, out.heads if out else None, out.shape[0] if out else None, out.experts if out else None
            )
            if name in layout and pieces[0].element_size() > 1 and tuple(tensors[name].shape) != layout[name].shape:
                raise DFlashTrtError(
                    f"checkpoint {checkpoint_dir} tensor '{name}' has shape {tuple(tensors[name].shape)}, but "
                    f"config.json implies {layout[name].shape}"
                )
        missing = sorted(set(layout) - set(tensors))
        if missing:
            raise DFlashTrtError(f"checkpoint {checkpoint_dir} is missing tensor '{missing[0]}'")
        return tensors
    finally:
        for f in files:
            f.close()


def load_golden_model(checkpoint_dir: str | Path, compute_dtype: torch.dtype = torch.float32) -> GoldenModel:
    checkpoint_dir = Path(checkpoint_dir)
    config = read_json_object(
        checkpoint_dir / "config.json", f"{checkpoint_dir} is not a converted checkpoint (no config.json)"
    )
    target_spec, draft_spec = specs_from_config(config)
    check_integrity(checkpoint_dir)
    dtype = getattr(torch, str(config.get("dtype")), None)  # the converter's --dtype, a torch dtype name
    dtype = dtype if isinstance(dtype, torch.dtype) else None
    mapping = config["mapping"]
    tensors = load_rank_tensors(
        checkpoint_dir, mapping["tp_size"], target_spec, draft_spec, dtype, mapping.get("moe_ep_size", 1)
    )
    target = TargetModel(target_spec, tensors, draft_spec.target_layer_ids, compute_dtype)
    target.fp8_context = checkpoint_fp8_context_fmha(config)
    return GoldenModel(target, DraftModel(draft_spec, tensors, target, compute_dtype), config)
