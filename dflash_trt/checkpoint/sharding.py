"""Tensor-parallel split and merge rules of TensorRT-LLM's decoder layers.

`shard` cuts a full tensor into one rank's piece; `merge` is its exact inverse, used by the golden model and
`verify` to reassemble any TP checkpoint. Both follow TensorRT-LLM 1.2.x: column-parallel linears (qkv, mlp.fc,
mlp.gate, lm_head) split on dim 0, row-parallel ones (dense, mlp.proj) on dim 1, KV heads replicated when there are
fewer of them than ranks, and the vocabulary padded to a multiple of tp.

Mixture-of-experts tensors (stacked `[experts, ...]`) split over `moe_ep_size` expert groups times `moe_tp_size`
slices of each expert (`tp = moe_tp * moe_ep`; rank r holds expert group `r % moe_ep` and slice `r // moe_ep`, as
TensorRT-LLM's `Mapping` numbers them): the experts of a group are a contiguous range, the up and gate halves of
the stacked fc are each cut by rows, the stacked proj by columns, the router is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from dflash_trt.errors import DFlashTrtError

if TYPE_CHECKING:
    import torch

    from dflash_trt.spec import DraftSpec, TargetSpec

Ranges = tuple[tuple[int, int], ...]  # [start, stop) of each leading dimension; the rest are whole


class Split(str, Enum):
    REPLICATE = "replicate"
    ROWS = "rows"  # dim 0: column-parallel weight, or its bias
    COLUMNS = "columns"  # dim 1: row-parallel weight
    QKV = "qkv"  # fused q|k|v rows, split per head group
    VOCAB = "vocab"  # rows padded to a multiple of tp, then split
    EXPERT_FC = "expert_fc"  # [experts, up|gate rows, in]: expert group, then each half's rows
    EXPERT_PROJ = "expert_proj"  # [experts, out, in]: expert group, then columns
    EXPERTS = "experts"  # [experts, ...] per-expert values: expert group only


@dataclass(frozen=True)
class HeadLayout:
    """Attention geometry a fused qkv tensor needs to be split or merged."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class ExpertLayout:
    """How stacked expert tensors spread over ranks: `ep_size` expert groups (moe_ep_size), the rest of tp slices
    each expert (moe_tp_size)."""

    num_experts: int
    ep_size: int = 1

    def ranks(self, tp_size: int, rank: int) -> tuple[int, int, int]:
        """(expert group, slice index, slice count) of `rank`."""
        return rank % self.ep_size, rank // self.ep_size, tp_size // self.ep_size

    def experts_of(self, group: int) -> range:
        per_group = self.num_experts // self.ep_size
        return range(group * per_group, (group + 1) * per_group)


def check_moe_parallel(num_experts: int, intermediate_size: int, tp_size: int, ep_size: int) -> None:
    """Refuse expert parallelism TensorRT-LLM's MixtureOfExperts cannot lay out, with the reason."""
    if ep_size < 1 or tp_size % ep_size:
        raise DFlashTrtError(f"--moe_ep_size must divide tp_size {tp_size}, got {ep_size}")
    if num_experts % ep_size:
        raise DFlashTrtError(f"{num_experts} experts cannot be split into {ep_size} expert-parallel groups")
    moe_tp = tp_size // ep_size
    if intermediate_size % moe_tp:
        raise DFlashTrtError(
            f"moe_intermediate_size {intermediate_size} is not divisible by moe_tp_size {moe_tp} (tp / moe_ep_size)"
        )


def _merge_experts(shards: list[torch.Tensor], split: Split, experts: ExpertLayout) -> torch.Tensor:
    import torch

    tp_size = len(shards)
    groups = []
    for group in range(experts.ep_size):
        pieces = [shards[index * experts.ep_size + group] for index in range(tp_size // experts.ep_size)]
        if split is Split.EXPERT_FC:
            halves = [piece.chunk(2, dim=1) for piece in pieces]
            groups.append(
                torch.cat([torch.cat([h[0] for h in halves], dim=1), torch.cat([h[1] for h in halves], dim=1)], dim=1)
            )
        elif split is Split.EXPERT_PROJ:
            groups.append(torch.cat(pieces, dim=2))
        else:
            groups.append(pieces[0])
    return torch.cat(groups, dim=0)


_EXPERT_SPLITS = (Split.EXPERT_FC, Split.EXPERT_PROJ, Split.EXPERTS)


def pad_vocab_size(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


def tp_refusal(num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int) -> str | None:
    """Why TensorRT-LLM cannot split a decoder stack over `tp_size` ranks (attention heads split, KV heads split or
    replicated, MLP rows split), or None. The one TP rule: conversion, build profiles and the planner all ask it."""
    if tp_size < 1:
        return f"tp_size must be >= 1, got {tp_size}"
    if num_heads % tp_size:
        return f"{num_heads} attention heads cannot be split over tp_size {tp_size}"
    kv = num_kv_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        return f"{kv} KV heads cannot be split or replicated over tp_size {tp_size}"
    if intermediate_size % tp_size:
        return f"intermediate_size {intermediate_size} is not divisible by tp_size {tp_size}"
    return None


def heads_of(spec: TargetSpec | DraftSpec) -> HeadLayout:
    return HeadLayout(spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim)


def check_tp(heads: HeadLayout, intermediate_size: int, tp_size: int, what: str) -> None:
    """Refuse tp sizes TensorRT-LLM cannot split this model by, with the reason."""
    refusal = tp_refusal(heads.num_heads, heads.num_kv_heads, intermediate_size, tp_size)
    if refusal is not None:
        raise DFlashTrtError(f"{what}: {refusal}")


def check_parallel(target: TargetSpec, draft: DraftSpec, tp_size: int, moe_ep_size: int) -> None:
    """Refuse tp / moe_ep sizes TensorRT-LLM cannot split these models by (dense MLPs by tp, experts by both)."""
    has_dense_mlp = target.moe is None or len(target.moe.sparse_layers) < target.num_hidden_layers
    dense = target.intermediate_size if has_dense_mlp else tp_size
    check_tp(heads_of(target), dense, tp_size, "target")
    check_tp(heads_of(draft), draft.intermediate_size, tp_size, "drafter")
    if target.moe is not None:
        check_moe_parallel(target.moe.num_experts, target.moe.intermediate_size, tp_size, moe_ep_size)
    elif moe_ep_size != 1:
        raise DFlashTrtError("--moe_ep_size applies to mixture-of-experts targets only")


def _kv_heads_of_rank(heads: HeadLayout, tp_size: int, rank: int) -> range:
    if heads.num_kv_heads >= tp_size:
        per_rank = heads.num_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    replicas = tp_size // heads.num_kv_heads
    return range(rank // replicas, rank // replicas + 1)


def _qkv_sizes(heads: HeadLayout) -> tuple[int, int]:
    return heads.num_heads * heads.head_dim, heads.num_kv_heads * heads.head_dim


def _merge_qkv(shards: list[torch.Tensor], heads: HeadLayout) -> torch.Tensor:
    import torch

    tp_size = len(shards)
    q_size, kv_size = _qkv_sizes(heads)
    kv_per_rank = max(heads.num_kv_heads // tp_size, 1) * heads.head_dim
    qs, ks, vs, seen = [], [], [], set()
    for rank, shard in enumerate(shards):
        q, k, v = shard.split([q_size // tp_size, kv_per_rank, kv_per_rank], dim=0)
        qs.append(q)
        first_head = _kv_heads_of_rank(heads, tp_size, rank).start
        if first_head not in seen:
            seen.add(first_head)
            ks.append(k)
            vs.append(v)
    return torch.cat(qs + ks + vs, dim=0)


def _need_heads(heads: HeadLayout | None) -> HeadLayout:
    if heads is None:
        raise ValueError("a QKV split needs the head layout")
    return heads


@dataclass(frozen=True)
class Piece:
    """Where one rank's piece of a full tensor comes from: `parts` concatenated along `axis`, each a box of the full
    tensor (ranges of its leading dimensions) or, as an int, that many rows of zeros (vocabulary padding).

    The split rules exist only here: `shard` cuts a tensor by them, and a conversion that only moves bytes reads
    each part straight from the source files."""

    axis: int
    parts: tuple[Ranges | int, ...]


def _chunk(size: int, count: int, index: int) -> tuple[int, int]:
    """Range of the `index`-th of `count` chunks of `size` (torch.chunk's sizes)."""
    step = -(-size // count)
    start = min(index * step, size)
    return start, min(start + step, size)


def rank_piece(
    shape: tuple[int, ...],
    split: Split,
    tp_size: int,
    rank: int,
    heads: HeadLayout | None = None,
    experts: ExpertLayout | None = None,
) -> Piece:
    """The parts of a tensor of `shape` that rank `rank` holds, in order."""
    whole = (0, shape[0]) if shape else (0, 1)
    if tp_size == 1 or split is Split.REPLICATE:
        return Piece(0, ((whole,),))
    if split in _EXPERT_SPLITS:
        spread = experts or ExpertLayout(shape[0])
        group, index, count = spread.ranks(tp_size, rank)
        chosen = spread.experts_of(group)
        mine = (chosen.start, chosen.stop)
        if split is Split.EXPERT_FC:  # the same slice of the up half and of the gate half
            half = shape[1] // 2
            first, stop = _chunk(half, count, index)
            return Piece(1, ((mine, (first, stop)), (mine, (half + first, half + stop))))
        if split is Split.EXPERT_PROJ:
            return Piece(0, ((mine, (0, shape[1]), _chunk(shape[2], count, index)),))
        return Piece(0, ((mine,),))
    if split is Split.QKV:
        layout = _need_heads(heads)
        q_size, kv_size = _qkv_sizes(layout)
        q_rows = q_size // tp_size
        kv_heads = _kv_heads_of_rank(layout, tp_size, rank)
        k_first, k_stop = q_size + kv_heads.start * layout.head_dim, q_size + kv_heads.stop * layout.head_dim
        return Piece(
            0, (((rank * q_rows, (rank + 1) * q_rows),), ((k_first, k_stop),), ((k_first + kv_size, k_stop + kv_size),))
        )
    if split is Split.VOCAB:
        rows = pad_vocab_size(shape[0], tp_size) // tp_size
        start, stop = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
        padding = rows - (stop - start)
        # only the last ranks hold padding rows; a rank wholly past the vocabulary holds nothing else
        return Piece(0, (((start, stop),),) * (stop > start) + (padding,) * (padding > 0))
    if split is Split.ROWS:
        return Piece(0, ((_chunk(shape[0], tp_size, rank),),))
    return Piece(0, ((whole, _chunk(shape[1], tp_size, rank)),))


def shard(
    full: torch.Tensor,
    split: Split,
    tp_size: int,
    rank: int,
    heads: HeadLayout | None = None,
    experts: ExpertLayout | None = None,
) -> torch.Tensor:
    """This rank's piece of `full` (a view where it is one part)."""
    import torch

    if tp_size == 1 or split is Split.REPLICATE:
        return full  # whatever its rank, a 0-d scale included
    piece = rank_piece(tuple(full.shape), split, tp_size, rank, heads, experts)
    parts = [
        full.new_zeros((part, *full.shape[1:])) if isinstance(part, int) else full[tuple(slice(*r) for r in part)]
        for part in piece.parts
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=piece.axis)


def piece_shape(piece: Piece, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the rank piece `piece` of a tensor of `shape`."""
    sizes = []
    for part in piece.parts:
        if isinstance(part, int):
            sizes.append((part, *shape[1:]))
        else:
            sizes.append(tuple(stop - start for start, stop in part) + tuple(shape[len(part) :]))
    joined = list(sizes[0])
    joined[piece.axis] = sum(size[piece.axis] for size in sizes)
    return tuple(joined) if shape else ()


def sharded_shape(
    shape: tuple[int, ...],
    split: Split,
    tp_size: int,
    heads: HeadLayout | None = None,
    experts: ExpertLayout | None = None,
) -> tuple[int, ...]:
    """Shape of every rank's piece (rank 0's: they are all alike)."""
    return piece_shape(rank_piece(shape, split, tp_size, 0, heads, experts), shape)


def merge(
    shards: list[torch.Tensor],
    split: Split,
    heads: HeadLayout | None = None,
    vocab_size: int | None = None,
    experts: ExpertLayout | None = None,
) -> torch.Tensor:
    """Inverse of `shard` over all ranks."""
    import torch

    if len(shards) == 1 or split is Split.REPLICATE:
        return shards[0]
    if split in _EXPERT_SPLITS:
        return _merge_experts(shards, split, experts or ExpertLayout(shards[0].shape[0]))
    if split is Split.QKV:
        return _merge_qkv(shards, _need_heads(heads))
    if split is Split.VOCAB:
        return torch.cat(shards, dim=0)[:vocab_size]
    return torch.cat(shards, dim=0 if split is Split.ROWS else 1)
