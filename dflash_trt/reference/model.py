"""Torch golden model of a converted checkpoint: the target and the DFlash drafter exactly as the engine runs them.

Batched over sequences of different lengths with explicit positions, so one forward serves a ragged prefill, a
verify block per sequence, or a draft block per sequence. KV caches are contiguous per sequence; a rewind is just
a smaller length, because stale entries past it are overwritten before any query can see them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash_trt.checkpoint import names
from dflash_trt.checkpoint.layout import checkpoint_layout
from dflash_trt.checkpoint.safetensors_io import SafetensorsFile
from dflash_trt.checkpoint.sharding import merge
from dflash_trt.checkpoint.trtllm_config import specs_from_config
from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.kv_injection import injected_kv
from dflash_trt.reference.norm import rms_norm
from dflash_trt.reference.rope import apply_rope, rope_cos_sin
from dflash_trt.spec import DraftSpec, TargetSpec


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@dataclass
class LayerWeights:
    """One decoder layer under TensorRT-LLM names (qkv fused; mlp.fc = gate_proj, mlp.gate = up_proj)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    dense: torch.Tensor
    dense_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    fc: torch.Tensor
    gate: torch.Tensor
    proj: torch.Tensor
    fc_bias: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None
    proj_bias: torch.Tensor | None = None

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> LayerWeights:
        def get(module: str, leaf: str = names.WEIGHT) -> torch.Tensor | None:
            return tensors.get(names.tensor(prefix, module, leaf))

        return cls(
            input_norm=get(names.INPUT_LAYERNORM),
            qkv=get(names.QKV),
            qkv_bias=get(names.QKV, names.BIAS),
            dense=get(names.DENSE),
            dense_bias=get(names.DENSE, names.BIAS),
            q_norm=get(names.Q_LAYERNORM),
            k_norm=get(names.K_LAYERNORM),
            post_norm=get(names.POST_LAYERNORM),
            fc=get(names.MLP_FC),
            gate=get(names.MLP_GATE),
            proj=get(names.MLP_PROJ),
            fc_bias=get(names.MLP_FC, names.BIAS),
            gate_bias=get(names.MLP_GATE, names.BIAS),
            proj_bias=get(names.MLP_PROJ, names.BIAS),
        )

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        activated = F.silu(linear(x, self.fc, self.fc_bias)) * linear(x, self.gate, self.gate_bias)
        return linear(activated, self.proj, self.proj_bias)

    def split_qkv(self, x: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
        qkv = linear(x, self.qkv, self.qkv_bias)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        shape = x.shape[:-1]
        return q.view(*shape, heads, head_dim), k.view(*shape, kv_heads, head_dim), v.view(*shape, kv_heads, head_dim)

    def kv_weights(self, heads: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
        """k/v rows of the fused qkv (and biases): what KV injection multiplies the context features by."""
        q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
        k_w, v_w = self.qkv[q_rows : q_rows + kv_rows], self.qkv[q_rows + kv_rows :]
        if self.qkv_bias is None:
            return k_w, v_w, None, None
        return k_w, v_w, self.qkv_bias[q_rows : q_rows + kv_rows], self.qkv_bias[q_rows + kv_rows :]


class KVCache:
    """Per-layer K/V `[batch, kv_heads, capacity, head_dim]`; position p of a sequence lives at slot p."""

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype):
        self.k = [torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype) for _ in range(layers)]
        self.capacity = capacity

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor):
        """k/v `[batch, tokens, kv_heads, head_dim]` at `positions [batch, tokens]`; invalid tokens are dropped."""
        batch_index, token_index = valid.nonzero(as_tuple=True)
        slots = positions[batch_index, token_index]
        if slots.numel() and int(slots.max()) >= self.capacity:
            raise DFlashTrtError(f"sequence longer than the KV cache capacity ({self.capacity} tokens)")
        self.k[layer][batch_index, :, slots] = k[batch_index, token_index].to(self.k[layer].dtype)
        self.v[layer][batch_index, :, slots] = v[batch_index, token_index].to(self.v[layer].dtype)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """q `[b, t, h, d]`, k/v `[b, kv, n, d]`, visible `[b, t, n]` → `[b, t, h*d]` (GQA by head groups)."""
    groups = q.shape[2] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible[:, None], scale=scale)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


class TargetModel:
    """The target decoder; returns logits and the concatenated tap features the drafter conditions on."""

    def __init__(self, spec: TargetSpec, tensors: dict[str, torch.Tensor], tap_layers: tuple[int, ...]):
        self.spec = spec
        self.embedding = tensors[names.VOCAB_EMBEDDING]
        self.layers = [LayerWeights.from_tensors(tensors, names.target_layer(i)) for i in range(spec.num_hidden_layers)]
        self.final_norm = tensors[names.TARGET_FINAL_NORM]
        self.lm_head = tensors[names.LM_HEAD]
        self.tap_layers = tap_layers

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        s = self.spec
        return KVCache(s.num_hidden_layers, batch, s.num_key_value_heads, capacity, s.head_dim, self.embedding.dtype)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens/positions/valid `[b, t]` → logits `[b, t, vocab]` (fp32), taps `[b, t, n_taps * hidden]`."""
        s = self.spec
        hidden = F.embedding(tokens, self.embedding)
        cos, sin = rope_cos_sin(positions, s.rope)
        cos, sin = cos[:, :, None].to(hidden.dtype), sin[:, :, None].to(hidden.dtype)
        key_count = int(positions.max()) + 1
        key_positions = torch.arange(key_count)
        visible = key_positions[None, None, :] <= positions[:, :, None]
        taps = {}
        for index, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, s.rms_norm_eps)
            q, k, v = layer.split_qkv(x, s.num_attention_heads, s.num_key_value_heads, s.head_dim)
            if layer.q_norm is not None:
                q, k = rms_norm(q, layer.q_norm, s.rms_norm_eps), rms_norm(k, layer.k_norm, s.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            cache.write(index, k, v, positions, valid)
            keys, values = cache.k[index][:, :, :key_count], cache.v[index][:, :, :key_count]
            attn = attend(q, keys, values, visible, s.head_dim**-0.5)
            hidden = hidden + linear(attn, layer.dense, layer.dense_bias)
            hidden = hidden + layer.mlp(rms_norm(hidden, layer.post_norm, s.rms_norm_eps))
            if index in self.tap_layers:
                taps[index] = hidden
        normed = rms_norm(hidden, self.final_norm, s.rms_norm_eps)
        # HF's hidden_states[-1] (what the reference taps for the last layer) is taken after the final norm.
        taps[s.num_hidden_layers - 1] = normed
        logits = linear(normed, self.lm_head)[..., : s.vocab_size]
        return logits.float(), torch.cat([taps[i] for i in self.tap_layers], dim=-1)


class DraftModel:
    """The DFlash drafter: block queries over injected context K/V plus the block's own K/V."""

    def __init__(self, spec: DraftSpec, tensors: dict[str, torch.Tensor], target: TargetModel):
        self.spec = spec
        self.target = target
        self.fc = tensors[names.DRAFT_FC]
        self.hidden_norm = tensors[names.DRAFT_HIDDEN_NORM]
        self.final_norm = tensors[names.DRAFT_FINAL_NORM]
        self.layers = [LayerWeights.from_tensors(tensors, names.draft_layer(i)) for i in range(spec.num_hidden_layers)]
        geometry = (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim)
        kv = [layer.kv_weights(*geometry) for layer in self.layers]
        self.stacked_kv = torch.cat([torch.cat([k_w, v_w]) for k_w, v_w, _, _ in kv])
        self.stacked_kv_bias = None
        if spec.attention_bias:
            self.stacked_kv_bias = torch.cat([torch.cat([k_b, v_b]) for _, _, k_b, v_b in kv])
        self.k_norms = torch.stack([layer.k_norm for layer in self.layers])

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        s = self.spec
        return KVCache(s.num_hidden_layers, batch, s.num_key_value_heads, capacity, s.head_dim, self.fc.dtype)

    def inject(self, taps: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, cache: KVCache) -> None:
        """KV injection: accepted tokens' tap features → one GEMM for all draft layers' K/V → k_norm, RoPE → cache.

        The same dataflow as the engine: `ctx_kv [tokens, layers, 2, kv_heads, head_dim]` from the stacked k/v rows
        of every draft layer's qkv, then `injected_kv`, the definition the KV-injection plugin is tested against.
        """
        s = self.spec
        features = rms_norm(linear(taps, self.fc), self.hidden_norm, s.rms_norm_eps)
        batch, tokens = features.shape[:2]
        ctx_kv = linear(features, self.stacked_kv, self.stacked_kv_bias)
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
        B = block.shape[1]
        positions = start[:, None] + torch.arange(B)
        hidden = F.embedding(block, self.target.embedding) * s.input_embedding_scale
        cos, sin = rope_cos_sin(positions, s.rope)
        cos, sin = cos[:, :, None].to(hidden.dtype), sin[:, :, None].to(hidden.dtype)
        context = int(start.max())
        ctx_positions = torch.arange(context)[None, :].expand(len(start), -1)
        key_positions = torch.cat([ctx_positions, positions], dim=1)
        key_valid = torch.cat([ctx_positions < start[:, None], block_valid], dim=1)
        for index, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, s.rms_norm_eps)
            q, k, v = layer.split_qkv(x, s.num_attention_heads, s.num_key_value_heads, s.head_dim)
            q, k = rms_norm(q, layer.q_norm, s.rms_norm_eps), rms_norm(k, layer.k_norm, s.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            keys = torch.cat([cache.k[index][:, :, :context], k.transpose(1, 2).to(cache.k[index].dtype)], dim=2)
            values = torch.cat([cache.v[index][:, :, :context], v.transpose(1, 2).to(cache.v[index].dtype)], dim=2)
            visible = draft_visibility(positions, key_positions, key_valid, s.causal[index], s.layer_window(index))
            attn = attend(q, keys.to(q.dtype), values.to(q.dtype), visible, s.head_dim**-0.5)
            hidden = hidden + linear(attn, layer.dense, layer.dense_bias)
            hidden = hidden + layer.mlp(rms_norm(hidden, layer.post_norm, s.rms_norm_eps))
        return rms_norm(hidden, self.final_norm, s.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Shared target lm_head, then the drafter's output multiplier and optional tanh softcap."""
        logits = linear(hidden, self.target.lm_head)[..., : self.target.spec.vocab_size].float()
        logits = logits * self.spec.output_multiplier
        cap = self.spec.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def draft_visibility(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor,
    causal: bool,
    window: int | None,
) -> torch.Tensor:
    """Which keys each block query sees: all valid ones, minus the future (causal) and the far (window) ones."""
    q = query_positions[:, :, None]
    k = key_positions[:, None, :]
    visible = key_valid[:, None, :].expand(-1, q.shape[1], -1)
    if causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & (q - k < window)
        if not causal:
            visible = visible & (k - q < window)
    return visible


@dataclass
class GoldenModel:
    target: TargetModel
    draft: DraftModel
    config: dict


def load_rank_tensors(checkpoint_dir: Path, tp_size: int, target: TargetSpec, draft: DraftSpec) -> dict:
    """All tensors of a checkpoint, shards merged back into full tensors."""
    layout = {out.name: out for out in checkpoint_layout(target, draft)}
    files = []
    try:
        for rank in range(tp_size):
            path = checkpoint_dir / f"rank{rank}.safetensors"
            if not path.is_file():
                raise DFlashTrtError(f"checkpoint {checkpoint_dir} is missing {path.name} (tp_size {tp_size})")
            files.append(SafetensorsFile(path))
        tensors = {}
        for name in files[0].names():
            out = layout.get(name)
            pieces = [f.get(name, copy=True) for f in files]
            if out is None or len(pieces) == 1:
                tensors[name] = pieces[0]
            else:
                tensors[name] = merge(pieces, out.split, out.heads, out.shape[0])
        missing = sorted(set(layout) - set(tensors))
        if missing:
            raise DFlashTrtError(f"checkpoint {checkpoint_dir} is missing tensor '{missing[0]}'")
        return tensors
    finally:
        for f in files:
            f.close()


def load_golden_model(checkpoint_dir: str | Path, compute_dtype: torch.dtype = torch.float32) -> GoldenModel:
    checkpoint_dir = Path(checkpoint_dir)
    config_path = checkpoint_dir / "config.json"
    if not config_path.is_file():
        raise DFlashTrtError(f"{checkpoint_dir} is not a converted checkpoint (no config.json)")
    config = json.loads(config_path.read_text())
    target_spec, draft_spec = specs_from_config(config)
    tensors = load_rank_tensors(checkpoint_dir, config["mapping"]["tp_size"], target_spec, draft_spec)
    tensors = {name: t.to(compute_dtype) if t.is_floating_point() else t for name, t in tensors.items()}
    target = TargetModel(target_spec, tensors, draft_spec.target_layer_ids)
    return GoldenModel(target, DraftModel(draft_spec, tensors, target), config)
