"""The emulated runtime's per-request state and the input tensors of one engine step, as 1.2.x's runtime sets them.

Inputs (packed, context requests first):
`input_ids` (a chunk, or `[anchor, d1..dK]`), `position_ids` (one per context token, one per generation request:
its anchor's), `last_token_ids` (a context request's last row, every row of a generation request, 1-based),
`context_lengths` (chunk size; prompt + draft length for generation requests), `sequence_length` (past + rows),
`host_past_key_value_lengths` (a context chunk's end; a generation request's past), as runtimeBuffers.cpp
`setFromInputs` sets them [read], the spec-decoding
inputs from each request's `draft_paths` (the previous step's `next_draft_paths`; generation length = its
`draft_lens` + 1, position offset of node `paths[p][l]` = `l`, packed mask = the nodes before it on its rows,
`emulation/paths.py`), `draft_tokens` / `draft_lens` from the previous step's `next_draft_*` outputs (and
`draft_paths` itself for a draft-tree engine, which reads the verified tree from it), the
`host_gen_eagle_net_*` bounds (a new request: its prompt length; after a step with `S` tokens: `S + K + 1` and
`S + K`, `unpackEagleData`), `input_gen_tokens` shaped to the step's generation tokens, and one paged pool for
target + draft layers with `host_kv_cache_pool_mapping`
row `l` = (pool 0, layer l). K is the engine's max_draft_len: the chain's length or a draft tree's nodes.
Sampling inputs (docs/engine.md §6): `eagle_temperature` is the request's temperature
(0 = greedy); each request owns a random state seeded from its seed, which draws `rand_data_sample` once when the
request is set up and a fresh `rand_data_validation` row of K+1 uniforms before each of its generation steps, into
the rows of the request's batch slot; a context request's validation row is whatever its slot last held (NaN for a
slot never used), as the runtime leaves it stale. The draws are torch's, made in the golden loop's order (one
uniform for the first token, then K+1 per verify step), not the runtime's curand: the emulation shows the network
computes the rule from the uniforms it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_trt.emulation.engine import CONTEXT_REQUEST, GENERATION_REQUEST, EmulatedEngine
from dflash_trt.emulation.functional import Tensor
from dflash_trt.emulation.kv_pool import BlockManager, KVPool
from dflash_trt.emulation.layers import AttentionParams, KeyValueCacheParams, SpecDecodingParams
from dflash_trt.emulation.paths import path_geometry
from dflash_trt.executors.contract import Request
from dflash_trt.reference.decode import StepTrace
from dflash_trt.trtllm.eagle_layout import pack_mask_rows


def _i32(values: Any) -> Tensor:
    return Tensor(data=torch.as_tensor(values, dtype=torch.int32))


def _host_i32(values: Any) -> Tensor:
    return Tensor(data=torch.as_tensor(values, dtype=torch.int32), host=True)


@dataclass
class Decoding:
    """One request as the runtime decodes it: the request, what it produced so far, and its runtime state."""

    request_id: int
    request: Request
    output: list[int] = field(default_factory=list)
    acceptance: list[int] = field(default_factory=list)
    steps: list[StepTrace] = field(default_factory=list)
    prefilled: int = 0
    drafts: list[int] = field(default_factory=list)  # the engine's next_draft_tokens row (K columns)
    draft_len: int = 0
    paths: list[list[int]] = field(default_factory=list)  # the engine's next_draft_paths rows for these drafts
    finished: bool = False
    bound: int = 0  # host_gen_eagle_net past-length bound for the next step
    slot: int = -1  # batch slot while in flight: the row of the runtime's per-request sampling buffers
    random: torch.Generator = field(default_factory=torch.Generator)

    def __post_init__(self) -> None:
        self.bound = len(self.prompt)

    @property
    def prompt(self) -> list[int]:
        return self.request.input_ids

    @property
    def generating(self) -> bool:
        return self.prefilled == len(self.prompt)

    @property
    def anchor_position(self) -> int:
        return len(self.prompt) + len(self.output) - 1


class SamplingSlots:
    """The runtime's per-slot sampling buffers, `rand_data_sample [slots]` and `rand_data_validation [slots, K+1]`.

    Only the slot's current request draws into its rows, from its own random state; the rows keep their values
    when the request leaves, so the next occupant's context steps see its predecessor's uniforms.
    """

    def __init__(self, slots: int, width: int):
        self.sample = torch.full((slots,), float("nan"))
        self.validation = torch.full((slots, width), float("nan"))
        self.free = list(range(slots))

    def join(self, r: Decoding) -> None:
        """Set the request up: the lowest free slot, its random state seeded, its first token's uniform drawn."""
        r.slot = min(self.free)
        self.free.remove(r.slot)
        r.random.manual_seed(r.request.sampling.runtime_seed)
        self.sample[r.slot] = torch.rand(1, generator=r.random)

    def draw_validation(self, r: Decoding) -> None:
        """Fresh uniforms for the K+1 positions a generation step verifies."""
        self.validation[r.slot] = torch.rand(self.validation.shape[1], generator=r.random)

    def leave(self, r: Decoding) -> None:
        self.free.append(r.slot)


@dataclass
class _PackedRows:
    """The per-request columns of one engine step, in batch order: generation rows carry `[anchor, drafts...]`,
    context rows a chunk of their prompt."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)
    ctx_lengths: list[int] = field(default_factory=list)
    seq_lengths: list[int] = field(default_factory=list)
    past_lengths: list[int] = field(default_factory=list)
    types: list[int] = field(default_factory=list)
    draft_tokens: list[list[int]] = field(default_factory=list)
    draft_lens: list[int] = field(default_factory=list)
    draft_paths: list[list[list[int]]] = field(default_factory=list)
    bounds: list[int] = field(default_factory=list)
    filled: int = 0  # token rows packed so far
    generation_rows: int = 0  # of which generation requests' rows

    def add_generation(self, r: Decoding, count: int) -> None:
        first = r.anchor_position
        self.positions.append(first)
        self.last.extend(range(self.filled + 1, self.filled + count + 1))
        self.ctx_lengths.append(len(r.prompt) + r.draft_len)
        self.past_lengths.append(first)
        self.draft_tokens.append(r.drafts)
        self.draft_lens.append(r.draft_len)
        self.types.append(GENERATION_REQUEST)
        self.generation_rows += count
        self._add(r, [r.output[-1], *r.drafts[: r.draft_len]], first + count, count)

    def add_context(self, r: Decoding, count: int, k: int) -> None:
        first = r.prefilled
        self.positions.extend(range(first, first + count))
        self.last.append(self.filled + count)
        self.ctx_lengths.append(count)
        self.past_lengths.append(first + count)
        self.draft_tokens.append([0] * k)
        self.draft_lens.append(0)
        self.types.append(CONTEXT_REQUEST)
        self._add(r, r.prompt[r.prefilled : r.prefilled + count], first + count, count)

    def _add(self, r: Decoding, tokens: list[int], seq_length: int, count: int) -> None:
        self.draft_paths.append(r.paths)
        self.ids.extend(tokens)
        self.filled += count
        self.seq_lengths.append(seq_length)
        self.bounds.append(r.bound)


def step_inputs(
    engine: EmulatedEngine, batch: list[tuple[Decoding, int]], slots: SamplingSlots, blocks: BlockManager, pool: KVPool
) -> dict[str, Any]:
    """The inputs of one engine step over `batch` (each request with the rows it runs), as the runtime binds them."""
    packed = _PackedRows()
    for d, count in batch:
        if d.generating:
            packed.add_generation(d, count)
        else:
            packed.add_context(d, count, engine.k)
    batch_size = len(batch)
    ctx_lengths, types, bounds = packed.ctx_lengths, packed.types, packed.bounds
    attention = AttentionParams(
        sequence_length=_i32(packed.seq_lengths),
        context_lengths=_i32(ctx_lengths),
        host_context_lengths=_host_i32(ctx_lengths),
        max_context_length=max(ctx_lengths),
        host_request_types=_host_i32(types),
    )
    rows_of_slots = torch.tensor([d.slot for d, _ in batch])
    generation = [(d.paths, count) for d, count in batch if d.generating]
    inputs = {
        "input_ids": _i32(packed.ids),
        "position_ids": _i32(packed.positions),
        "use_cache": True,
        "last_token_ids": _i32(packed.last),
        "kv_cache_params": _kv_params(engine, [d.request_id for d, _ in batch], packed.past_lengths, blocks, pool),
        "attention_params": attention,
        "spec_decoding_params": _spec_params(engine, generation),
        "draft_tokens": Tensor(data=torch.tensor(packed.draft_tokens, dtype=torch.int32).reshape(batch_size, engine.k)),
        "draft_lens": _i32(packed.draft_lens),
        "eagle_temperature": Tensor(
            data=torch.tensor([d.request.sampling.temperature for d, _ in batch], dtype=torch.float32)
        ),
        "rand_data_validation": Tensor(data=slots.validation[rows_of_slots]),
        "rand_data_sample": Tensor(data=slots.sample[rows_of_slots]),
        "host_gen_eagle_net_request_types": _host_i32([GENERATION_REQUEST] * batch_size),
        "host_gen_eagle_net_context_lengths": _host_i32(
            [b + 1 if t == GENERATION_REQUEST else b for b, t in zip(bounds, types, strict=True)]
        ),
        "host_gen_eagle_net_past_key_value_lengths": _host_i32(bounds),
        # Only its shape carries information: the step's generation tokens (EagleBuffers::setFromInputs).
        "input_gen_tokens": _host_i32([0] * packed.generation_rows),
    }
    if engine.tree:  # a draft-tree engine declares the verified tree's paths as an input
        inputs["draft_paths"] = _i32(packed.draft_paths)
    return inputs


def _spec_params(engine: EmulatedEngine, generation: list[tuple[list[list[int]], int]]) -> SpecDecodingParams:
    """Each generation request verifies its `rows` nodes (anchor + drafts): position offsets and the packed mask
    from its paths, as `unpackEagleData` and `getPackedMaskFromPath` derive them [read]; mask rows follow one
    another request by request (packEagleTensors copies them at cumulative offsets), each
    `spec_decoding_max_generation_length` bits wide."""
    width = engine.block
    offsets = torch.zeros(len(generation), width, dtype=torch.int32)
    mask: list[list[bool]] = []
    for g, (paths, rows) in enumerate(generation):
        depth, sees = path_geometry(paths, rows)
        offsets[g, :rows] = torch.tensor(depth, dtype=torch.int32)
        mask.extend(row + [False] * (width - rows) for row in sees)
    words = -(-width // 32)
    packed = pack_mask_rows(mask) if mask else []
    return SpecDecodingParams(
        spec_decoding_is_generation_length_variable=True,
        spec_decoding_max_generation_length=width,
        spec_decoding_generation_lengths=_i32([rows for _, rows in generation]),
        spec_decoding_position_offsets=Tensor(data=offsets),
        spec_decoding_packed_mask=Tensor(data=torch.tensor(packed, dtype=torch.int32).reshape(len(mask), words)),
        spec_decoding_use=_i32([1]),
    )


def _kv_params(
    engine: EmulatedEngine, request_ids: list[int], past_lengths: list[int], blocks: BlockManager, pool: KVPool
) -> KeyValueCacheParams:
    """The paged cache as the runtime hands it over: block offsets per request, one pool, every layer mapped."""
    offsets = blocks.offsets(request_ids)
    return KeyValueCacheParams(
        past_key_value=[None],
        host_past_key_value_lengths=_host_i32(past_lengths),
        host_max_attention_window_sizes=_host_i32(
            [blocks.max_blocks_per_seq * engine.tokens_per_block] * engine.num_layers
        ),
        host_sink_token_length=_host_i32([0]),
        kv_cache_block_offsets=Tensor(data=offsets),
        host_kv_cache_block_offsets=Tensor(data=offsets.clone(), host=True),
        host_kv_cache_pool_pointers=Tensor(data=torch.tensor([[pool.address, 0]], dtype=torch.int64), host=True),
        host_kv_cache_pool_mapping=_host_i32([[0, layer] for layer in range(engine.num_layers)]),
        cache_indirection=_i32(torch.zeros(len(request_ids), 1, 1)),
    )
