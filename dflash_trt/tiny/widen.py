"""The tiny pair at a production head size: every attention head widened from 32 to 128 (or any multiple) elements,
computing what the trained pair computes.

Kernels choose their code paths by head size (XQA and the FMHA kernels are specialised per head size), and production
Qwen3 / Llama models use 128 while the tiny pair uses 32; the self-test builds the widened pair so that an engine runs
the kernels those models run. Head element j of the narrow pair lands on element `embedded_index(j)` of the wide one,
the others stay zero: GPT-NeoX RoPE rotates element i with i + d/2 at frequency theta^(-2i/d), so narrow pair
(i, i + d/2) maps to wide pair (r*i, r*i + r*d/2) with the same frequency (r = wide / narrow). RMS-normalising q and k
over r times more elements (the rest zero) scales each by sqrt(r), their product by r, and softmax's 1/sqrt(head_dim)
shrinks by sqrt(r): q-norm weights are divided by sqrt(r) and k-norm weights kept, so every attention logit is
unchanged. Only the norms' epsilon acts r times stronger (1e-6 -> 4e-6 relative to the mean square), well below
float16 resolution.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Files copied unchanged next to the widened weights (the tokenizer and generation settings of the target).
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")


def embedded_index(j: int, narrow: int, wide: int) -> int:
    """Where narrow head element j sits in a wide head (RoPE pairs kept together at their frequency)."""
    ratio, half = wide // narrow, narrow // 2
    return ratio * j if j < half else ratio * (j - half) + wide // 2


def _rows(heads: int, narrow: int, wide: int) -> torch.Tensor:
    """For each narrow row (head h, element j) of a per-head projection, its row in the widened projection."""
    within = torch.tensor([embedded_index(j, narrow, wide) for j in range(narrow)])
    return (torch.arange(heads)[:, None] * wide + within[None, :]).reshape(-1)


def _widen_attention(tensors: dict[str, torch.Tensor], prefix: str, config: dict, wide: int) -> None:
    narrow = config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, count in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
        for kind in ("weight", "bias"):
            key = f"{prefix}.{name}.{kind}"
            if key in tensors:
                old = tensors[key]
                new = old.new_zeros((count * wide, *old.shape[1:]))
                new[_rows(count, narrow, wide)] = old
                tensors[key] = new
    dense = tensors[f"{prefix}.o_proj.weight"]
    widened = dense.new_zeros((dense.shape[0], heads * wide))
    widened[:, _rows(heads, narrow, wide)] = dense
    tensors[f"{prefix}.o_proj.weight"] = widened
    for name, scale in (("q_norm", (narrow / wide) ** 0.5), ("k_norm", 1.0)):
        old = tensors[f"{prefix}.{name}.weight"]
        new = old.new_ones(wide)
        new[_rows(1, narrow, wide)] = old * scale
        tensors[f"{prefix}.{name}.weight"] = new


def widen_model(source: Path, destination: Path, head_dim: int, layer_prefix: str) -> None:
    """One HF folder (config.json + model.safetensors) with every attention head widened to `head_dim`."""
    config = json.loads((source / "config.json").read_text())
    if head_dim % config["head_dim"] or head_dim < config["head_dim"]:
        raise ValueError(f"head_dim {head_dim} is not a multiple of {config['head_dim']}")
    tensors = load_file(source / "model.safetensors")
    for layer in range(config["num_hidden_layers"]):
        _widen_attention(tensors, f"{layer_prefix}{layer}.self_attn", config, head_dim)
    destination.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, destination / "model.safetensors")
    (destination / "config.json").write_text(json.dumps({**config, "head_dim": head_dim}, indent=2) + "\n")
    for name in COPIED:
        if (source / name).is_file():
            shutil.copyfile(source / name, destination / name)


def widen_pair(target: Path, draft: Path, destination: Path, head_dim: int) -> tuple[Path, Path]:
    """The tiny target (`model.layers.N`) and drafter (`layers.N`) widened into `destination/{target,draft}`."""
    widen_model(target, destination / "target", head_dim, "model.layers.")
    widen_model(draft, destination / "draft", head_dim, "layers.")
    return destination / "target", destination / "draft"
