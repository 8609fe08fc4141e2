"""The paged KV pool and block manager of the emulated runtime, addressed the way the attention kernels read it.

`kv_cache_block_offsets[pool][seq][k|v][page]` holds `block * layers_in_pool * 2 + k|v` (bit 31: secondary pool),
layer `l` of a pool is `2 * l` blocks further, a block holds `[kv_heads, tokens_per_block, head_dim]` values
(cpp/tensorrt_llm/kernels/kvCacheUtils.h `KVBlockArray`, read). `host_kv_cache_pool_pointers` carry addresses; here
an address names a pool in a registry, so a wrong pointer or a wrong layer of `host_kv_cache_pool_mapping` reads
the wrong pages exactly as it would on a GPU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_trt.emulation.functional import EmulationError

SECONDARY_POOL_FLAG = 1 << 31
_POOLS: dict[int, KVPool] = {}
_ADDRESSES = itertools.count(0x10000, 0x10000)


@dataclass
class KVPool:
    """One pool: `num_blocks * layers * 2` blocks of `[kv_heads, tokens_per_block, head_dim]`."""

    num_blocks: int
    layers: int
    kv_heads: int
    tokens_per_block: int
    head_dim: int
    dtype: torch.dtype
    data: torch.Tensor = field(init=False)
    address: int = field(init=False)
    # The same blocks on the other tensor-parallel ranks (each rank's pool holds its own KV heads): the block
    # manager hands out blocks of this pool, and the runtime's rewind moves tokens in every rank's pool.
    rank_pools: list[KVPool] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.data = torch.zeros(
            self.num_blocks * self.layers * 2, self.kv_heads, self.tokens_per_block, self.head_dim, dtype=self.dtype
        )
        self.address = next(_ADDRESSES)
        _POOLS[self.address] = self

    def pool_of_rank(self, rank: int, tp_size: int) -> KVPool:
        """Rank `rank`'s pool of this geometry (rank 0's is this one; the others are made on first use)."""
        while len(self.rank_pools) < tp_size - 1:
            self.rank_pools.append(
                KVPool(self.num_blocks, self.layers, self.kv_heads, self.tokens_per_block, self.head_dim, self.dtype)
            )
        return self if rank == 0 else self.rank_pools[rank - 1]

    def release(self) -> None:
        for pool in self.rank_pools:
            pool.release()
        _POOLS.pop(self.address, None)


def pool_at(address: int) -> KVPool | None:
    return _POOLS.get(address) if address else None


@dataclass
class SequencePages:
    """One sequence's pages of one layer, as the attention kernel addresses them."""

    offsets: torch.Tensor  # [2, max_blocks] raw block offsets
    layer_in_pool: int
    primary: KVPool

    @property
    def dtype(self) -> torch.dtype:
        return self.primary.dtype

    def _locate(self, kind: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tpb = self.primary.tokens_per_block
        pages = positions.long() // tpb
        if int(pages.max()) >= self.offsets.shape[1]:
            raise EmulationError("a position beyond the sequence's block offsets")
        raw = self.offsets[kind, pages].long() & 0xFFFFFFFF
        if bool(((raw & SECONDARY_POOL_FLAG) != 0).any()):
            raise EmulationError("the emulated runtime allocates every block in the primary pool")
        blocks = (raw & (SECONDARY_POOL_FLAG - 1)) + 2 * self.layer_in_pool
        if int(blocks.max()) >= self.primary.data.shape[0]:
            raise EmulationError("a block offset beyond the pool")
        return blocks, positions.long() % tpb

    def write(self, kind: int, positions: torch.Tensor, values: torch.Tensor) -> None:
        """values [n, kv_heads, head_dim] at `positions`."""
        blocks, rows = self._locate(kind, positions)
        self.primary.data[blocks, :, rows] = values

    def read(self, kind: int, positions: torch.Tensor) -> torch.Tensor:
        blocks, rows = self._locate(kind, positions)
        return self.primary.data[blocks, :, rows]


def resolve_pool(mapping_t: Any, pointers_t: Any, offsets_t: Any, layer_idx: int, batch_index: int) -> SequencePages:
    """What an attention plugin derives from host_kv_cache_pool_mapping / _pointers and kv_cache_block_offsets for
    layer `layer_idx` and the batch row `batch_index`."""
    if not (mapping_t.host and pointers_t.host):
        raise EmulationError("the KV pool pointers and mapping must be host tensors")
    mapping = mapping_t.data
    if mapping.dtype != torch.int32 or mapping.dim() != 2 or layer_idx >= mapping.shape[0]:
        raise EmulationError(f"host_kv_cache_pool_mapping has no row for layer {layer_idx}")
    pool_index, layer_in_pool = (int(x) for x in mapping[layer_idx])
    pointers = pointers_t.data
    if pointers.dtype != torch.int64:
        raise EmulationError("host_kv_cache_pool_pointers must be int64")
    primary = pool_at(int(pointers[pool_index, 0]))
    if primary is None:
        raise EmulationError(f"no KV pool at the pointer of pool {pool_index}")
    offsets = offsets_t.data
    if offsets.dtype != torch.int32 or offsets.dim() != 4:
        raise EmulationError("kv_cache_block_offsets must be int32 [pools, batch, 2, max_blocks]")
    if layer_in_pool >= primary.layers:
        raise EmulationError(f"layer {layer_idx} maps to slot {layer_in_pool} of a {primary.layers}-layer pool")
    return SequencePages(offsets[pool_index, batch_index], layer_in_pool, primary)


class BlockManager:
    """Blocks per sequence, handed out from the top of the pool: a sequence's pages run backwards through the pool
    and interleave with other sequences', so only the block offsets locate them."""

    def __init__(self, pool: KVPool, max_blocks_per_seq: int):
        self.pool = pool
        self.max_blocks_per_seq = max_blocks_per_seq
        self.free = list(range(pool.num_blocks))
        self.blocks: dict[int, list[int]] = {}

    def ensure(self, seq: int, tokens: int) -> None:
        needed = -(-tokens // self.pool.tokens_per_block)
        if needed > self.max_blocks_per_seq:
            raise EmulationError(f"a sequence needs {needed} blocks, max_blocks_per_seq is {self.max_blocks_per_seq}")
        held = self.blocks.setdefault(seq, [])
        while len(held) < needed:
            if not self.free:
                raise EmulationError("the KV pool is out of blocks")
            held.append(self.free.pop())

    def release(self, seq: int) -> None:
        self.free.extend(reversed(self.blocks.pop(seq, [])))

    def offsets(self, seqs: list[int]) -> torch.Tensor:
        """int32 [1 pool, batch, 2, max_blocks] for these sequences in batch order."""
        table = torch.zeros(1, len(seqs), 2, self.max_blocks_per_seq, dtype=torch.int32)
        for b, seq in enumerate(seqs):
            for page, block in enumerate(self.blocks[seq]):
                for kind in (0, 1):
                    table[0, b, kind, page] = block * self.pool.layers * 2 + kind
        return table

    def move_tokens(self, seq: int, sources: list[int], targets: list[int]) -> None:
        """The EAGLE rewind: every layer's K/V of positions `sources` copied to `targets` (in order)."""
        if sources == targets:
            return
        offsets = self.offsets([seq])[0, 0]
        for pool in (self.pool, *self.pool.rank_pools):
            for layer in range(pool.layers):
                pages = SequencePages(offsets, layer, pool)
                for kind in (0, 1):
                    values = pages.read(kind, torch.tensor(sources))
                    pages.write(kind, torch.tensor(targets), values)
