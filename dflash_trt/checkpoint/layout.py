"""Where every tensor of the converted checkpoint comes from (HF / z-lab names) and how it is split over ranks.

One list of `OutputTensor` drives the writer, `verify` and the golden model's shard merge, so the HF → TensorRT-LLM
mapping (q|k|v fused, gate_proj → mlp.fc, up_proj → mlp.gate, down_proj → mlp.proj, tied lm_head) exists once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_trt import tensor_names as names
from dflash_trt.checkpoint.sharding import ExpertLayout, HeadLayout, Split, heads_of
from dflash_trt.spec import (
    CONV_BASE_KERNEL,
    CONV_KERNEL_PROJECTION,
    DRAFT_LM_HEAD,
    DRAFT_TO_TARGET,
    SELECTOR_HIDDEN_PROJECTION,
    SELECTOR_PREDECESSOR,
    SELECTOR_SUCCESSOR,
    DraftSpec,
    MoeSpec,
    TargetSpec,
    conv_tensor,
    draft_tensor_shapes,
    hf_expert,
    hf_router,
)

if TYPE_CHECKING:
    import torch

TARGET = "target"
DRAFT = "draft"


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the TensorRT-LLM checkpoint: the concatenation (dim 0) of its sources, then split over ranks."""

    name: str
    sources: tuple[tuple[str, str], ...]  # (TARGET | DRAFT, source tensor name)
    shape: tuple[int, ...]  # unsharded
    split: Split = Split.REPLICATE
    heads: HeadLayout | None = None
    experts: ExpertLayout | None = None
    dtype: str | None = None  # a torch dtype name stored whatever --dtype says (MoE router "float32", d2t "int32")

    def stored_torch_dtype(self, default: torch.dtype | None) -> torch.dtype | None:
        """The dtype this tensor is stored in when `--dtype` is `default` (None: unknown, unless it has its own)."""
        import torch

        return getattr(torch, self.dtype) if self.dtype else default

    def assemble(self, loaded: list[torch.Tensor]) -> torch.Tensor:
        """Sources concatenated by rows; a stacked expert tensor is its experts' row blocks in order."""
        import torch

        full = loaded[0] if len(loaded) == 1 else torch.cat(loaded, dim=0)
        return full.view(self.shape) if len(self.shape) == 3 else full


def _layer_tensors(
    out_prefix: str,
    model: str,
    src_prefix: str,
    hidden: int,
    intermediate: int,
    heads: HeadLayout,
    attention_bias: bool,
    mlp_bias: bool,
    qk_norm: bool,
) -> list[OutputTensor]:
    q_size, kv_size = heads.num_heads * heads.head_dim, heads.num_kv_heads * heads.head_dim
    attn = f"{src_prefix}self_attn."
    mlp = f"{src_prefix}mlp."

    def src(*leaf: str) -> tuple[tuple[str, str], ...]:
        return tuple((model, name) for name in leaf)

    out = [
        OutputTensor(
            names.tensor(out_prefix, names.INPUT_LAYERNORM), src(f"{src_prefix}input_layernorm.weight"), (hidden,)
        ),
        OutputTensor(
            names.tensor(out_prefix, names.QKV),
            src(f"{attn}q_proj.weight", f"{attn}k_proj.weight", f"{attn}v_proj.weight"),
            (q_size + 2 * kv_size, hidden),
            Split.QKV,
            heads,
        ),
        OutputTensor(
            names.tensor(out_prefix, names.DENSE), src(f"{attn}o_proj.weight"), (hidden, q_size), Split.COLUMNS
        ),
        OutputTensor(
            names.tensor(out_prefix, names.POST_LAYERNORM),
            src(f"{src_prefix}post_attention_layernorm.weight"),
            (hidden,),
        ),
        OutputTensor(
            names.tensor(out_prefix, names.MLP_FC), src(f"{mlp}gate_proj.weight"), (intermediate, hidden), Split.ROWS
        ),
        OutputTensor(
            names.tensor(out_prefix, names.MLP_GATE), src(f"{mlp}up_proj.weight"), (intermediate, hidden), Split.ROWS
        ),
        OutputTensor(
            names.tensor(out_prefix, names.MLP_PROJ),
            src(f"{mlp}down_proj.weight"),
            (hidden, intermediate),
            Split.COLUMNS,
        ),
    ]
    if qk_norm:
        out.append(
            OutputTensor(names.tensor(out_prefix, names.Q_LAYERNORM), src(f"{attn}q_norm.weight"), (heads.head_dim,))
        )
        out.append(
            OutputTensor(names.tensor(out_prefix, names.K_LAYERNORM), src(f"{attn}k_norm.weight"), (heads.head_dim,))
        )
    if attention_bias:
        out += _attention_bias_tensors(out_prefix, src, attn, hidden, heads)
    if mlp_bias:
        out += _mlp_bias_tensors(out_prefix, src, mlp, hidden, intermediate)
    return out


Sources = Callable[..., tuple[tuple[str, str], ...]]


def _attention_bias_tensors(
    out_prefix: str, src: Sources, attn: str, hidden: int, heads: HeadLayout
) -> list[OutputTensor]:
    qkv_size = (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim
    return [
        OutputTensor(
            names.tensor(out_prefix, names.QKV, names.BIAS),
            src(f"{attn}q_proj.bias", f"{attn}k_proj.bias", f"{attn}v_proj.bias"),
            (qkv_size,),
            Split.QKV,
            heads,
        ),
        # Row-parallel biases are added once after the all-reduce, so every rank holds the full bias.
        OutputTensor(names.tensor(out_prefix, names.DENSE, names.BIAS), src(f"{attn}o_proj.bias"), (hidden,)),
    ]


def _mlp_bias_tensors(out_prefix: str, src: Sources, mlp: str, hidden: int, intermediate: int) -> list[OutputTensor]:
    return [
        OutputTensor(
            names.tensor(out_prefix, names.MLP_FC, names.BIAS),
            src(f"{mlp}gate_proj.bias"),
            (intermediate,),
            Split.ROWS,
        ),
        OutputTensor(
            names.tensor(out_prefix, names.MLP_GATE, names.BIAS),
            src(f"{mlp}up_proj.bias"),
            (intermediate,),
            Split.ROWS,
        ),
        OutputTensor(names.tensor(out_prefix, names.MLP_PROJ, names.BIAS), src(f"{mlp}down_proj.bias"), (hidden,)),
    ]


def _moe_tensors(out_prefix: str, src_prefix: str, hidden: int, moe: MoeSpec, ep_size: int) -> list[OutputTensor]:
    """A sparse layer's router and stacked experts: expert e's fc block is its up_proj rows then its gate_proj rows."""
    experts = ExpertLayout(moe.num_experts, ep_size)
    inter, count = moe.intermediate_size, moe.num_experts
    fc_sources = tuple(
        (TARGET, hf_expert(src_prefix, e, leaf)) for e in range(count) for leaf in ("up_proj", "gate_proj")
    )
    proj_sources = tuple((TARGET, hf_expert(src_prefix, e, "down_proj")) for e in range(count))
    return [
        OutputTensor(
            names.tensor(out_prefix, names.MOE_ROUTER),
            ((TARGET, hf_router(src_prefix)),),
            (count, hidden),
            dtype="float32",
        ),
        OutputTensor(
            names.tensor(out_prefix, names.MOE_FC),
            fc_sources,
            (count, 2 * inter, hidden),
            Split.EXPERT_FC,
            experts=experts,
        ),
        OutputTensor(
            names.tensor(out_prefix, names.MOE_PROJ),
            proj_sources,
            (count, hidden, inter),
            Split.EXPERT_PROJ,
            experts=experts,
        ),
    ]


def checkpoint_layout(target: TargetSpec, draft: DraftSpec, moe_ep_size: int = 1) -> list[OutputTensor]:
    """Every output tensor, target first, in the order they are written (`moe_ep_size`: expert-parallel groups)."""
    h, vocab = target.hidden_size, target.vocab_size
    out = [OutputTensor(names.VOCAB_EMBEDDING, ((TARGET, "model.embed_tokens.weight"),), (vocab, h))]
    for i in range(target.num_hidden_layers):
        prefix, src_prefix = names.target_layer(i), f"model.layers.{i}."
        layer = _layer_tensors(
            prefix,
            TARGET,
            src_prefix,
            h,
            target.intermediate_size,
            heads_of(target),
            target.attention_bias,
            target.mlp_bias,
            target.qk_norm,
        )
        if target.moe is not None and target.moe.is_sparse(i):
            dense_mlp = {names.tensor(prefix, m) for m in (names.MLP_FC, names.MLP_GATE, names.MLP_PROJ)}
            moe = _moe_tensors(prefix, src_prefix, h, target.moe, moe_ep_size)
            at = next(k for k, t in enumerate(layer) if t.name in dense_mlp)
            layer = [t for t in layer if t.name not in dense_mlp]
            layer[at:at] = moe
        out += layer
    out.append(OutputTensor(names.TARGET_FINAL_NORM, ((TARGET, "model.norm.weight"),), (h,)))
    head_source = "model.embed_tokens.weight" if target.tie_word_embeddings else "lm_head.weight"
    out.append(OutputTensor(names.LM_HEAD, ((TARGET, head_source),), (vocab, h), Split.VOCAB))

    taps = len(draft.target_layer_ids)
    out.append(OutputTensor(names.DRAFT_FC, ((DRAFT, "fc.weight"),), (h, taps * h)))
    out.append(OutputTensor(names.DRAFT_HIDDEN_NORM, ((DRAFT, "hidden_norm.weight"),), (h,)))
    for i in range(draft.num_hidden_layers):
        out += _layer_tensors(
            names.draft_layer(i),
            DRAFT,
            f"layers.{i}.",
            h,
            draft.intermediate_size,
            heads_of(draft),
            draft.attention_bias,
            False,
            True,
        )
        if draft.dflash2 is not None:
            out += _conv_tensors(draft, i)
    out.append(OutputTensor(names.DRAFT_FINAL_NORM, ((DRAFT, "norm.weight"),), (h,)))
    return out + _draft_head_tensors(draft)


def _conv_tensors(draft: DraftSpec, layer: int) -> list[OutputTensor]:
    """A DFlash2 layer's two convolutions: small, and replicated on every rank (each rank convolves whole hidden
    states, which the row-parallel dense and mlp.proj give it after their all-reduce)."""
    shapes = draft_tensor_shapes(draft)
    out = []
    for module in (names.ATTENTION_CONV, names.MLP_CONV):
        for source_leaf, output_module, output_leaf in (
            (CONV_BASE_KERNEL, module, names.CONV_BASE_KERNEL),
            (CONV_KERNEL_PROJECTION, f"{module}.{names.CONV_KERNEL_PROJECTION}", names.WEIGHT),
        ):
            source = conv_tensor(layer, module, source_leaf)
            name = names.tensor(names.draft_layer(layer), output_module, output_leaf)
            out.append(OutputTensor(name, ((DRAFT, source),), shapes[source]))
    return out


def _draft_head_tensors(draft: DraftSpec) -> list[OutputTensor]:
    """DFlash2's candidate selector, and a reduced draft vocabulary's own head and id map: replicated (the
    drafter's extra modules are small next to the target, like dflash.fc)."""
    shapes = draft_tensor_shapes(draft)
    sources: list[tuple[str, str, str | None]] = []
    if draft.dflash2 is not None:
        sources += [
            (names.SELECTOR_PREDECESSOR_CODEBOOK, SELECTOR_PREDECESSOR, None),
            (names.SELECTOR_SUCCESSOR_CODEBOOK, SELECTOR_SUCCESSOR, None),
            (names.SELECTOR_HIDDEN_PROJECTION, SELECTOR_HIDDEN_PROJECTION, None),
        ]
    if draft.draft_vocab_size is not None:
        sources += [(names.DRAFT_LM_HEAD, DRAFT_LM_HEAD, None), (names.DRAFT_TO_TARGET, DRAFT_TO_TARGET, "int32")]
    return [OutputTensor(name, ((DRAFT, source),), shapes[source], dtype=dtype) for name, source, dtype in sources]


def stored_split(layout: dict[str, OutputTensor], name: str, ndim: int) -> tuple[Split, OutputTensor | None]:
    """How any stored tensor splits over ranks, quantization tensors included.

    A layout tensor splits by its own rule; a tensor hanging off a linear (`<module>.weights_scaling_factor`, ...)
    splits like that linear's weight when it has per-row data (NVFP4 block scales), goes with its expert when it is a
    per-expert scale of stacked experts, and is replicated when it is a per-tensor scale; anything else is
    replicated.
    """
    out = layout.get(name)
    if out is not None:
        return out.split, out
    parent = layout.get(f"{name.rsplit('.', 1)[0]}.{names.WEIGHT}")
    if parent is not None and parent.experts is not None and ndim == 2:
        return Split.EXPERTS, parent  # one scale per expert: it goes where its expert goes
    if parent is not None and ndim >= 2:
        return parent.split, parent
    return Split.REPLICATE, None
