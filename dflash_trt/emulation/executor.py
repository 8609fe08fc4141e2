"""The emulated EAGLE runtime: in-flight batching over the network, fed as docs/engine.md §3-§4 says 1.2.x does.

Requests are added and cancelled at any time; each `step` admits waiting requests into free slots (up to
`max_batch_size`), runs one network forward and answers every request that produced tokens with what it produced,
as the executor's per-iteration responses do. The scheduler takes the generation requests (each costs `K+1` tokens
of `max_num_tokens`) and as many context tokens as remain, chunking a prompt at a multiple of `tokens_per_block`
when it does not fit. Inputs (packed, context requests first):
`input_ids` (a chunk, or `[anchor, d1..dK]`), `position_ids` (one per context token, one per generation request:
its anchor's), `last_token_ids` (a context request's last row, every row of a generation request, 1-based),
`context_lengths` (chunk size; prompt + draft length for generation requests), `sequence_length` (past + rows),
`host_past_key_value_lengths` (a context chunk's end; a generation request's past), as runtimeBuffers.cpp
`setFromInputs` sets them [read], the spec-decoding
inputs from the chain `draft_paths` (generation lengths K+1, position offsets = path depth, packed mask =
ancestors), `draft_tokens` / `draft_lens` from the previous step's `next_draft_*` outputs, the
`host_gen_eagle_net_*` bounds (a new request: its prompt length; after a step with `S` tokens: `S + K + 1` and
`S + K`, `unpackEagleData`), and one paged pool for target + draft layers with `host_kv_cache_pool_mapping`
row `l` = (pool 0, layer l). Sampling inputs (docs/engine.md §6): `eagle_temperature` is the request's temperature
(0 = greedy); each request owns a random state seeded from its seed, which draws `rand_data_sample` once when the
request is set up and a fresh `rand_data_validation` row of K+1 uniforms before each of its generation steps, into
the rows of the request's batch slot; a context request's validation row is whatever its slot last held (NaN for a
slot never used), as the runtime leaves it stale. The draws are torch's, made in the golden loop's order (one
uniform for the first token, then K+1 per verify step), not the runtime's curand: the emulation shows the network
computes the rule from the uniforms it is given. After a step: the accepted tokens (clipped at `max_new_tokens`
and at a stop token), the EAGLE KV rewind along the accepted path, the next drafts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.functional import Tensor
from dflash_trt.emulation.kv_pool import BlockManager, KVPool
from dflash_trt.emulation.layers import AttentionParams, KeyValueCacheParams, SpecDecodingParams
from dflash_trt.errors import DFlashTrtError
from dflash_trt.inputs import check_fits_in_memory
from dflash_trt.reference.decode import StepTrace
from dflash_trt.reference.loop_rules import check_request, keep_tokens, longest_request
from dflash_trt.sampling_rules import sampling_refusal
from dflash_trt.trtllm.build_plan import EngineBuildSettings, check_sliding_window, pack_mask_rows

CONTEXT_REQUEST, GENERATION_REQUEST = 0, 1  # host_request_types values (RequestType in the C++ runtime)


def _i32(values: Any) -> Tensor:
    return Tensor(data=torch.as_tensor(values, dtype=torch.int32))


def _host_i32(values: Any) -> Tensor:
    return Tensor(data=torch.as_tensor(values, dtype=torch.int32), host=True)


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    # This request's own stop sequences (token ids), on top of the executor's stop tokens; the output keeps them.
    stop_words: tuple[tuple[int, ...], ...] = ()
    output: list[int] = field(default_factory=list)
    acceptance: list[int] = field(default_factory=list)
    steps: list[StepTrace] = field(default_factory=list)
    prefilled: int = 0
    drafts: list[int] = field(default_factory=list)
    draft_len: int = 0
    finished: bool = False
    bound: int = 0  # host_gen_eagle_net past-length bound for the next step
    slot: int = -1  # batch slot while in flight: the row of the runtime's per-request sampling buffers
    random: torch.Generator = field(default_factory=torch.Generator)

    def __post_init__(self) -> None:
        self.bound = len(self.prompt)

    @property
    def generating(self) -> bool:
        return self.prefilled == len(self.prompt)

    @property
    def anchor_position(self) -> int:
        return len(self.prompt) + len(self.output) - 1


@dataclass
class StepOutput:
    """One response: the tokens one iteration produced for request `index`, and whether the request ended (with
    `error` when the engine failed on it)."""

    index: int
    tokens: list[int]
    finished: bool
    error: str | None = None


class EngineStepFailed(Exception):
    """The engine raised `engine_error` during a step; the requests' state is as before the step."""

    def __init__(self, engine_error: Exception):
        super().__init__(f"{type(engine_error).__name__}: {engine_error}")
        self.engine_error = engine_error


class SamplingSlots:
    """The runtime's per-slot sampling buffers, `rand_data_sample [slots]` and `rand_data_validation [slots, K+1]`.

    Only the slot's current request draws into its rows, from its own random state; the rows keep their values
    when the request leaves, so the next occupant's context steps see its predecessor's uniforms.
    """

    def __init__(self, slots: int, width: int):
        self.sample = torch.full((slots,), float("nan"))
        self.validation = torch.full((slots, width), float("nan"))
        self.free = list(range(slots))

    def join(self, r: Request) -> None:
        """Set the request up: the lowest free slot, its random state seeded, its first token's uniform drawn."""
        r.slot = min(self.free)
        self.free.remove(r.slot)
        r.random.manual_seed(r.seed)
        self.sample[r.slot] = torch.rand(1, generator=r.random)

    def draw_validation(self, r: Request) -> None:
        """Fresh uniforms for the K+1 positions a generation step verifies."""
        self.validation[r.slot] = torch.rand(self.validation.shape[1], generator=r.random)

    def leave(self, r: Request) -> None:
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
    bounds: list[int] = field(default_factory=list)
    filled: int = 0  # token rows packed so far

    def add_generation(self, r: Request, count: int) -> None:
        first = r.anchor_position
        self.positions.append(first)
        self.last.extend(range(self.filled + 1, self.filled + count + 1))
        self.ctx_lengths.append(len(r.prompt) + r.draft_len)
        self.past_lengths.append(first)
        self.draft_tokens.append(r.drafts)
        self.draft_lens.append(r.draft_len)
        self.types.append(GENERATION_REQUEST)
        self._add(r, [r.output[-1], *r.drafts], first + count, count)

    def add_context(self, r: Request, count: int, k: int) -> None:
        first = r.prefilled
        self.positions.extend(range(first, first + count))
        self.last.append(self.filled + count)
        self.ctx_lengths.append(count)
        self.past_lengths.append(first + count)
        self.draft_tokens.append([0] * k)
        self.draft_lens.append(0)
        self.types.append(CONTEXT_REQUEST)
        self._add(r, r.prompt[r.prefilled : r.prefilled + count], first + count, count)

    def _add(self, r: Request, tokens: list[int], seq_length: int, count: int) -> None:
        self.ids.extend(tokens)
        self.filled += count
        self.seq_lengths.append(seq_length)
        self.bounds.append(r.bound)


class EmulatedExecutor:
    """Requests in, per-iteration responses out, over one emulated engine and a KV pool sized for `max_seq_len`."""

    def __init__(
        self,
        engine: EmulatedEngine,
        max_seq_len: int,
        stop_token_ids: list[int] | None = None,
        isolate_failures: bool = True,
    ):
        holds = longest_request(engine.max_position_embeddings, engine.k)
        if not 2 <= max_seq_len <= holds:
            raise DFlashTrtError(
                f"max_seq_len must be in 2..{holds} (the target's {engine.max_position_embeddings} positions less "
                f"the two blocks of {engine.k} drafts the last step reaches past a request's last token), got "
                f"{max_seq_len}"
            )
        check_sliding_window(engine.facts, EngineBuildSettings(max_seq_len=max_seq_len))
        self.engine = engine
        self.max_seq_len = max_seq_len
        self.stops = set(stop_token_ids or [])
        self.isolate_failures = isolate_failures  # False: an engine error ends the step with it, as raised
        longest = max_seq_len + 2 * engine.block
        max_blocks = -(-longest // engine.tokens_per_block)
        element = torch.empty((), dtype=engine.cache_dtype).element_size()
        check_fits_in_memory(
            engine.tp_size * max_blocks * engine.max_batch_size * engine.num_layers * 2 * engine.kv_heads
            * engine.tokens_per_block * engine.head_dim * element,
            f"the emulated KV pool ({engine.max_batch_size} sequences x {max_blocks} blocks of "
            f"{engine.tokens_per_block})",
            "lower --max_batch_size or ask for fewer tokens",
        )  # fmt: skip
        self.pool = KVPool(
            max_blocks * engine.max_batch_size,
            engine.num_layers,
            engine.kv_heads,
            engine.tokens_per_block,
            engine.head_dim,
            engine.cache_dtype,
        )
        self.blocks = BlockManager(self.pool, max_blocks)
        self.slots = SamplingSlots(engine.max_batch_size, engine.block)
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []

    def check(self, r: Request) -> None:
        """Refuse what the engine refuses, in one line naming the request."""
        check_request(r.index, r.prompt, r.max_new_tokens, self.engine.vocab_size, self.max_seq_len)
        refusal = sampling_refusal({"temperature": r.temperature})
        if refusal is not None:
            raise DFlashTrtError(refusal)

    def add(self, r: Request) -> None:
        """Queue a request; it joins a free batch slot at the next step."""
        self.check(r)
        self.waiting.append(r)

    def cancel(self, index: int) -> bool:
        """Drop request `index` wherever it is, freeing its slot and pages; False when it is not known."""
        for r in self.waiting:
            if r.index == index:
                self.waiting.remove(r)
                return True
        for r in self.active:
            if r.index == index:
                r.finished = True
                self._leave(r)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    def close(self) -> None:
        """Give the KV pool back (the pool registry holds it until then)."""
        self.pool.release()

    def step(self) -> list[StepOutput]:
        """Admit waiting requests into free slots, then one network step over everything scheduled.

        A failing request fails alone: when the engine raises, the step is rerun request by request, and a request
        that fails on its own ends with the error (its slot and pages freed) while the others go on as if nothing
        happened (their random states are restored, and K/V past a request's length is rewritten before it is read).
        Without `isolate_failures` the engine's error is raised as is.
        """
        while self.waiting and len(self.active) < self.engine.max_batch_size:
            self.active.append(self.waiting.popleft())
            self.slots.join(self.active[-1])
        batch = self._schedule()
        if not batch:
            return []
        try:
            responses = self._run(batch)
        except EngineStepFailed as failed:
            if not self.isolate_failures:
                raise failed.engine_error from None
            responses = [out for item in batch for out in self._run_alone(item)]
        for r in [r for r in self.active if r.finished]:
            self._leave(r)
        return responses

    def _run(self, batch: list[tuple[Request, int]]) -> list[StepOutput]:
        """One engine step over `batch`; EngineStepFailed, with every request as before, when the engine raises."""
        restore = [(r, r.random.get_state(), self.slots.validation[r.slot].clone()) for r, _ in batch if r.generating]
        for r, rows in batch:
            # The target writes the step's rows, the draft pass a block right after the drafter context.
            end = r.prefilled + rows if not r.generating else r.anchor_position + rows
            self.blocks.ensure(r.index, end + self.engine.block)
            if r.generating:
                self.slots.draw_validation(r)
        try:
            outputs = self.engine.run(self._inputs(batch), len(batch))
        except Exception as exc:  # whatever the network raised: the caller isolates the request that caused it
            for r, state, row in restore:
                r.random.set_state(state)
                self.slots.validation[r.slot] = row
            raise EngineStepFailed(exc) from exc
        responses = []
        for b, (r, rows) in enumerate(batch):
            produced = self._advance(r, rows, b, outputs)
            if produced is not None:
                responses.append(StepOutput(r.index, produced, r.finished))
        return responses

    def _run_alone(self, item: tuple[Request, int]) -> list[StepOutput]:
        """`item`'s step on its own; if the engine fails on it alone, the request ends with the engine's error."""
        try:
            return self._run([item])
        except EngineStepFailed as failure:
            r = item[0]
            r.finished = True
            return [StepOutput(r.index, [], True, f"the engine failed on this request: {failure}")]

    def _leave(self, r: Request) -> None:
        self.blocks.release(r.index)
        self.slots.leave(r)
        self.active.remove(r)

    def _schedule(self) -> list[tuple[Request, int]]:
        block = self.engine.block
        generation = [r for r in self.active if r.generating]
        budget = self.engine.max_num_tokens - block * len(generation)
        context = []
        for r in self.active:
            if r.generating:
                continue
            remaining = len(r.prompt) - r.prefilled
            chunk = min(remaining, budget)
            if chunk < remaining:
                chunk -= chunk % self.engine.tokens_per_block
            if chunk <= 0:
                continue
            context.append((r, chunk))
            budget -= chunk
        return context + [(r, block) for r in generation]

    def _advance(self, r: Request, rows: int, b: int, out: dict[str, torch.Tensor]) -> list[int] | None:
        """Apply one step's outputs to request `r`: the tokens it produced, or None for a non-last prompt chunk."""
        next_drafts = out["next_draft_tokens"][b].tolist()
        next_len = int(out["next_draft_lens"][b])
        if not r.generating:
            r.prefilled += rows
            self.engine.stats.context_chunks += 1
            if not r.generating:
                return None  # a non-last chunk: the runtime ignores this step's tokens
            produced = self._append(r, [int(out["accepted_tokens"][b, 0])])
        else:
            n = int(out["num_accepted_tokens"][b])
            path = self.engine.paths[int(out["accepted_paths"][b])].tolist()
            start = r.anchor_position
            self.blocks.move_tokens(r.index, [start + path[i] for i in range(n)], [start + i for i in range(n)])
            r.steps.append(StepTrace(list(r.drafts), n - 1))
            produced = self._append(r, out["accepted_tokens"][b, :n].tolist())
            r.acceptance.append(len(produced))
        r.drafts, r.draft_len = next_drafts, next_len
        r.bound = len(r.prompt) + len(r.output) + self.engine.k
        return produced

    def _append(self, r: Request, tokens: list[int]) -> list[int]:
        kept = keep_tokens(
            tokens, r.max_new_tokens - len(r.output), self.stops, lambda new: self._ends_a_stop_word(r, new)
        )
        r.output.extend(kept.tokens)
        if kept.stopped or len(r.output) >= r.max_new_tokens:
            r.finished = True
        return kept.tokens

    @staticmethod
    def _ends_a_stop_word(r: Request, new: list[int]) -> bool:
        if not r.stop_words:
            return False
        tail = r.output[-max((len(w) for w in r.stop_words), default=0) :] + new
        return any(len(tail) >= len(w) and tuple(tail[-len(w) :]) == w for w in r.stop_words)

    def _inputs(self, batch: list[tuple[Request, int]]) -> dict[str, Any]:
        engine = self.engine
        packed = _PackedRows()
        for r, count in batch:
            if r.generating:
                packed.add_generation(r, count)
            else:
                packed.add_context(r, count, engine.k)
        batch_size = len(batch)
        ctx_lengths, types, bounds = packed.ctx_lengths, packed.types, packed.bounds
        attention = AttentionParams(
            sequence_length=_i32(packed.seq_lengths),
            context_lengths=_i32(ctx_lengths),
            host_context_lengths=_host_i32(ctx_lengths),
            max_context_length=max(ctx_lengths),
            host_request_types=_host_i32(types),
        )
        rows_of_slots = torch.tensor([r.slot for r, _ in batch])
        return {
            "input_ids": _i32(packed.ids),
            "position_ids": _i32(packed.positions),
            "use_cache": True,
            "last_token_ids": _i32(packed.last),
            "kv_cache_params": self._kv_params(batch, packed.past_lengths),
            "attention_params": attention,
            "spec_decoding_params": self._spec_params(types.count(GENERATION_REQUEST)),
            "draft_tokens": Tensor(
                data=torch.tensor(packed.draft_tokens, dtype=torch.int32).reshape(batch_size, engine.k)
            ),
            "draft_lens": _i32(packed.draft_lens),
            "eagle_temperature": Tensor(data=torch.tensor([r.temperature for r, _ in batch], dtype=torch.float32)),
            "rand_data_validation": Tensor(data=self.slots.validation[rows_of_slots]),
            "rand_data_sample": Tensor(data=self.slots.sample[rows_of_slots]),
            "host_gen_eagle_net_request_types": _host_i32([GENERATION_REQUEST] * batch_size),
            "host_gen_eagle_net_context_lengths": _host_i32(
                [b + 1 if t == GENERATION_REQUEST else b for b, t in zip(bounds, types, strict=True)]
            ),
            "host_gen_eagle_net_past_key_value_lengths": _host_i32(bounds),
        }

    def _spec_params(self, num_gen: int) -> SpecDecodingParams:
        """Every generation row verifies the whole chain of `block` positions under the chain's packed mask."""
        width = self.engine.block
        depth, ancestors = self._chain_geometry()
        mask_rows = pack_mask_rows(ancestors)
        words = len(mask_rows[0])
        return SpecDecodingParams(
            spec_decoding_is_generation_length_variable=True,
            spec_decoding_max_generation_length=width,
            spec_decoding_generation_lengths=_i32([width] * num_gen),
            spec_decoding_position_offsets=Tensor(
                data=torch.tensor([depth] * num_gen, dtype=torch.int32).reshape(num_gen, width)
            ),
            spec_decoding_packed_mask=Tensor(
                data=torch.tensor(mask_rows * num_gen, dtype=torch.int32).reshape(num_gen * width, words)
            ),
            spec_decoding_use=_i32([1]),
        )

    def _kv_params(self, batch: list[tuple[Request, int]], past_lengths: list[int]) -> KeyValueCacheParams:
        """The paged cache as the runtime hands it over: block offsets per request, one pool, every layer mapped."""
        engine = self.engine
        offsets = self.blocks.offsets([r.index for r, _ in batch])
        return KeyValueCacheParams(
            past_key_value=[None],
            host_past_key_value_lengths=_host_i32(past_lengths),
            host_max_attention_window_sizes=_host_i32(
                [self.blocks.max_blocks_per_seq * engine.tokens_per_block] * engine.num_layers
            ),
            host_sink_token_length=_host_i32([0]),
            kv_cache_block_offsets=Tensor(data=offsets),
            host_kv_cache_block_offsets=Tensor(data=offsets.clone(), host=True),
            host_kv_cache_pool_pointers=Tensor(
                data=torch.tensor([[self.pool.address, 0]], dtype=torch.int64), host=True
            ),
            host_kv_cache_pool_mapping=_host_i32([[0, layer] for layer in range(engine.num_layers)]),
            cache_indirection=_i32(torch.zeros(len(batch), 1, 1)),
        )

    def _chain_geometry(self) -> tuple[list[int], list[list[bool]]]:
        """Per node of the draft tree: its depth (position offset) and which nodes it may attend (ancestors)."""
        width = self.engine.block
        depth = [0] * width
        ancestors = [[False] * width for _ in range(width)]
        for path in self.engine.paths.tolist():
            for i, node in enumerate(path):
                if node < 0:
                    break
                depth[node] = i
                for a in path[: i + 1]:
                    ancestors[node][a] = True
        return depth, ancestors
