"""The emulated EAGLE runtime: in-flight batching over the network, fed as docs/engine.md §3-§4 says 1.2.x does.

Per step the scheduler takes the generation requests (each costs `K+1` tokens of `max_num_tokens`) and as many
context tokens as remain, chunking a prompt at a multiple of `tokens_per_block` when it does not fit; requests join
when they arrive and a slot is free, and leave when they finish. Inputs (packed, context requests first):
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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_trt.checkpoint.trtllm_config import specs_from_config
from dflash_trt.emulation.aliasing import load_engine_module, stand_ins_installed
from dflash_trt.emulation.functional import EmulationError, Network, PluginConfig, Tensor, net_guard
from dflash_trt.emulation.kv_pool import BlockManager, KVPool
from dflash_trt.emulation.layers import AttentionParams, KeyValueCacheParams, SpecDecodingParams
from dflash_trt.errors import DFlashTrtError
from dflash_trt.inputs import check_fits_in_memory
from dflash_trt.jsonfile import read_json_object
from dflash_trt.reference.decode import SequenceResult, StepTrace
from dflash_trt.sampling_rules import sampling_refusal
from dflash_trt.trtllm.build_plan import (
    EngineBuildSettings,
    chain_draft_paths,
    check_kv_geometry,
    check_moe_layers,
    check_quantization,
    check_rope,
    check_sliding_window,
    pack_mask_rows,
    read_checkpoint_facts,
)

ACCEPT_OUTPUTS = (
    "accepted_tokens",
    "num_accepted_tokens",
    "accepted_paths",
    "next_draft_tokens",
    "next_draft_lens",
    "next_draft_paths",
    "logits",
)


def _i32(values: Any) -> Tensor:
    return Tensor(data=torch.as_tensor(values, dtype=torch.int32))


def _host_i32(values: Any) -> Tensor:
    return Tensor(data=torch.as_tensor(values, dtype=torch.int32), host=True)


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0
    temperature: float = 0.0
    seed: int = 0
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
class StepStats:
    steps: int = 0
    context_chunks: int = 0
    max_batch: int = 0
    largest_cumsum_square: int = 0


class EmulatedRuntime:
    """One engine (the network from `model.py`) and its runtime loop over a converted checkpoint."""

    def __init__(
        self,
        checkpoint_dir: str | Path,
        max_batch_size: int = 8,
        max_num_tokens: int | None = None,
        tokens_per_block: int = 32,
    ):
        checkpoint_dir = Path(checkpoint_dir)
        raw = read_json_object(
            checkpoint_dir / "config.json", f"{checkpoint_dir} is not a converted checkpoint (no config.json)"
        )
        target, _ = specs_from_config(raw)
        # What `dflash-trt build` refuses, the emulated engine refuses too.
        self.facts = read_checkpoint_facts(checkpoint_dir)
        for check in (check_kv_geometry, check_rope, check_quantization, check_moe_layers):
            check(self.facts)
        if raw["mapping"].get("tp_size", 1) != 1 or raw["mapping"].get("pp_size", 1) != 1:
            raise DFlashTrtError("the emulation runs one rank: convert with --tp_size 1")
        if not (checkpoint_dir / "rank0.safetensors").is_file():
            raise DFlashTrtError(f"{checkpoint_dir} has no rank0.safetensors")
        self.vocab_size, self.eos_token_ids = target.vocab_size, target.eos_token_ids
        engine = load_engine_module()
        self.model = engine.DFlashForCausalLM.from_checkpoint(checkpoint_dir)
        config = self.model.config
        self.k = self.model.max_draft_len
        self.block = self.k + 1
        if max_batch_size < 1:
            raise DFlashTrtError(f"--max_batch_size must be >= 1, got {max_batch_size}")
        if tokens_per_block <= 0 or tokens_per_block & (tokens_per_block - 1):
            raise DFlashTrtError(f"--tokens_per_block must be a power of two, got {tokens_per_block}")
        # builder.build() raises max_num_tokens to max_batch_size * (K + 1) for EAGLE engines.
        floor = max_batch_size * self.block
        self.max_num_tokens = max(max_num_tokens or 8192, floor)
        if max_num_tokens is not None and max_num_tokens < floor:
            raise DFlashTrtError(f"--max_num_tokens must be at least max_batch_size * block_size = {floor}")
        self.max_batch_size = max_batch_size
        self.tokens_per_block = tokens_per_block
        self.num_target_layers = config.num_hidden_layers
        self.num_layers = config.num_hidden_layers + config.eagle_net_config["num_hidden_layers"]
        self.kv_heads, self.head_dim = config.num_key_value_heads, config.head_size
        fp8_cache = config.quantization.kv_cache_quant_algo == "FP8"
        self.cache_dtype = torch.float8_e4m3fn if fp8_cache else torch.float32
        self.paths = torch.tensor(chain_draft_paths(self.k), dtype=torch.int32)
        self.stats = StepStats()

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | list[int],
        stop_token_ids: list[int] | None = None,
        arrivals: list[int] | None = None,
        temperature: float | list[float] = 0.0,
        seed: int = 0,
        seeds: list[int] | None = None,
    ) -> list[SequenceResult]:
        """Decode every prompt. Request i samples at `temperature` (or its own entry of the list; 0 = greedy) with a
        random state seeded `seed + i`, or `seeds[i]`: the per-sequence seeds of `speculative_generate`."""
        count = len(prompts)
        news = [max_new_tokens] * count if isinstance(max_new_tokens, int) else list(max_new_tokens)
        arrivals = arrivals or [0] * count
        temperatures = [temperature] * count if isinstance(temperature, (int, float)) else list(temperature)
        seeds = list(seeds) if seeds is not None else [seed + i for i in range(count)]
        if len(temperatures) != count or len(seeds) != count:
            raise DFlashTrtError(f"got {len(temperatures)} temperatures and {len(seeds)} seeds for {count} prompts")
        for t in temperatures:
            refusal = sampling_refusal({"temperature": t})
            if refusal is not None:
                raise DFlashTrtError(refusal)
        requests = [
            Request(i, list(p), n, a, float(t), s, bound=len(p))
            for i, (p, n, a, t, s) in enumerate(zip(prompts, news, arrivals, temperatures, seeds, strict=True))
        ]
        for r in requests:
            if not r.prompt or r.max_new_tokens < 1:
                raise DFlashTrtError(f"request {r.index}: empty prompt or max_new_tokens < 1")
            if min(r.prompt) < 0 or max(r.prompt) >= self.vocab_size:
                raise DFlashTrtError(
                    f"prompt {r.index} has token ids outside the vocabulary (0..{self.vocab_size - 1})"
                )
        stops = set(stop_token_ids or [])
        max_seq_len = max(len(r.prompt) + r.max_new_tokens for r in requests)
        check_sliding_window(self.facts, EngineBuildSettings(max_seq_len=max_seq_len))
        longest = max_seq_len + 2 * self.block
        max_blocks = -(-longest // self.tokens_per_block)
        element = torch.empty((), dtype=self.cache_dtype).element_size()
        check_fits_in_memory(
            max_blocks * self.max_batch_size * self.num_layers * 2 * self.kv_heads * self.tokens_per_block
            * self.head_dim * element,
            f"the emulated KV pool ({self.max_batch_size} sequences x {max_blocks} blocks of {self.tokens_per_block})",
            "lower --max_batch_size or ask for fewer tokens",
        )  # fmt: skip
        pool = KVPool(
            max_blocks * self.max_batch_size,
            self.num_layers,
            self.kv_heads,
            self.tokens_per_block,
            self.head_dim,
            self.cache_dtype,
        )
        try:
            self._loop(requests, BlockManager(pool, max_blocks), SamplingSlots(self.max_batch_size, self.block), stops)
        finally:
            pool.release()
        return [SequenceResult(r.prompt, r.output, r.acceptance, r.steps) for r in requests]

    def _loop(self, requests: list[Request], blocks: BlockManager, slots: SamplingSlots, stops: set[int]) -> None:
        waiting = sorted(requests, key=lambda r: (r.arrival, r.index))
        active: list[Request] = []
        step = 0
        while waiting or active:
            while waiting and waiting[0].arrival <= step and len(active) < self.max_batch_size:
                active.append(waiting.pop(0))
                slots.join(active[-1])
            batch = self._schedule(active)
            if batch:
                self._step(batch, blocks, slots, stops)
                for r in [r for r in active if r.finished]:
                    blocks.release(r.index)
                    slots.leave(r)
                    active.remove(r)
            step += 1

    def _schedule(self, active: list[Request]) -> list[tuple[Request, int]]:
        generation = [r for r in active if r.generating]
        budget = self.max_num_tokens - self.block * len(generation)
        context = []
        for r in active:
            if r.generating:
                continue
            remaining = len(r.prompt) - r.prefilled
            chunk = min(remaining, budget)
            if chunk < remaining:
                chunk -= chunk % self.tokens_per_block
            if chunk <= 0:
                continue
            context.append((r, chunk))
            budget -= chunk
        return context + [(r, self.block) for r in generation]

    def _step(
        self, batch: list[tuple[Request, int]], blocks: BlockManager, slots: SamplingSlots, stops: set[int]
    ) -> None:
        for r, rows in batch:
            # The target writes the step's rows, the draft pass a block right after the drafter context.
            end = r.prefilled + rows if not r.generating else r.anchor_position + rows
            blocks.ensure(r.index, end + self.block)
            if r.generating:
                slots.draw_validation(r)
        inputs = self._inputs(batch, blocks, slots)
        network = Network(PluginConfig(tokens_per_block=self.tokens_per_block))
        with stand_ins_installed(), net_guard(network), torch.no_grad():
            self.model.forward(**inputs)
        outputs = {}
        for name in ACCEPT_OUTPUTS:
            if name not in network.outputs:
                raise EmulationError(f"the network did not mark output '{name}'")
            outputs[name] = network.outputs[name].data
            if name != "logits" and outputs[name].dtype != torch.int32:
                raise EmulationError(f"output '{name}' is {outputs[name].dtype}, the runtime binds int32")
        self.stats.steps += 1
        self.stats.max_batch = max(self.stats.max_batch, len(batch))
        self.stats.largest_cumsum_square = max([self.stats.largest_cumsum_square, *network.cumsum_square_elements])
        for b, (r, rows) in enumerate(batch):
            self._advance(r, rows, b, outputs, blocks, stops)

    def _advance(
        self, r: Request, rows: int, b: int, out: dict[str, torch.Tensor], blocks: BlockManager, stops: set[int]
    ) -> None:
        next_drafts = out["next_draft_tokens"][b].tolist()
        next_len = int(out["next_draft_lens"][b])
        if not r.generating:
            r.prefilled += rows
            self.stats.context_chunks += 1
            if not r.generating:
                return  # a non-last chunk: the runtime ignores this step's tokens
            produced = self._append(r, [int(out["accepted_tokens"][b, 0])], stops)
        else:
            n = int(out["num_accepted_tokens"][b])
            path = self.paths[int(out["accepted_paths"][b])].tolist()
            start = r.anchor_position
            blocks.move_tokens(r.index, [start + path[i] for i in range(n)], [start + i for i in range(n)])
            r.steps.append(StepTrace(list(r.drafts), n - 1))
            produced = self._append(r, out["accepted_tokens"][b, :n].tolist(), stops)
            r.acceptance.append(produced)
        r.drafts, r.draft_len = next_drafts, next_len
        r.bound = len(r.prompt) + len(r.output) + self.k

    @staticmethod
    def _append(r: Request, tokens: list[int], stops: set[int]) -> int:
        room = r.max_new_tokens - len(r.output)
        kept = tokens[:room]
        for i, token in enumerate(kept):
            if token in stops:
                kept = kept[: i + 1]
                r.finished = True
                break
        r.output.extend(kept)
        if len(r.output) >= r.max_new_tokens:
            r.finished = True
        return len(kept)

    def _inputs(self, batch: list[tuple[Request, int]], blocks: BlockManager, slots: SamplingSlots) -> dict[str, Any]:
        k, width = self.k, self.block
        ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        ctx_lengths: list[int] = []
        seq_lengths: list[int] = []
        past_lengths: list[int] = []
        types: list[int] = []
        draft_tokens: list[list[int]] = []
        draft_lens: list[int] = []
        bounds: list[int] = []
        row = 0
        for r, rows in batch:
            if r.generating:
                tokens = [r.output[-1], *r.drafts]
                first = r.anchor_position
                positions.append(first)
                last.extend(range(row + 1, row + rows + 1))
                ctx_lengths.append(len(r.prompt) + r.draft_len)
                past_lengths.append(first)
                draft_tokens.append(r.drafts)
                draft_lens.append(r.draft_len)
                types.append(1)
            else:
                tokens = r.prompt[r.prefilled : r.prefilled + rows]
                first = r.prefilled
                positions.extend(range(first, first + rows))
                last.append(row + rows)
                ctx_lengths.append(rows)
                past_lengths.append(first + rows)
                draft_tokens.append([0] * k)
                draft_lens.append(0)
                types.append(0)
            ids.extend(tokens)
            seq_lengths.append(first + rows)
            bounds.append(r.bound)
            row += rows
        batch_size = len(batch)
        num_gen = sum(types)
        depth, ancestors = self._chain_geometry()
        mask_rows = pack_mask_rows(ancestors)
        words = len(mask_rows[0])
        spec = SpecDecodingParams(
            True,
            width,
            _i32([width] * num_gen),
            Tensor(data=torch.tensor([depth] * num_gen, dtype=torch.int32).reshape(num_gen, width)),
            Tensor(data=torch.tensor(mask_rows * num_gen, dtype=torch.int32).reshape(num_gen * width, words)),
            _i32([1]),
        )
        seqs = [r.index for r, _ in batch]
        offsets = blocks.offsets(seqs)
        kv = KeyValueCacheParams(
            past_key_value=[None],
            host_past_key_value_lengths=_host_i32(past_lengths),
            host_max_attention_window_sizes=_host_i32(
                [blocks.max_blocks_per_seq * self.tokens_per_block] * self.num_layers
            ),
            host_sink_token_length=_host_i32([0]),
            kv_cache_block_offsets=Tensor(data=offsets),
            host_kv_cache_block_offsets=Tensor(data=offsets.clone(), host=True),
            host_kv_cache_pool_pointers=Tensor(
                data=torch.tensor([[blocks.pool.address, 0]], dtype=torch.int64), host=True
            ),
            host_kv_cache_pool_mapping=_host_i32([[0, layer] for layer in range(self.num_layers)]),
            cache_indirection=_i32(torch.zeros(batch_size, 1, 1)),
        )
        attention = AttentionParams(
            sequence_length=_i32(seq_lengths),
            context_lengths=_i32(ctx_lengths),
            host_context_lengths=_host_i32(ctx_lengths),
            max_context_length=max(ctx_lengths),
            host_request_types=_host_i32(types),
        )
        rows_of_slots = torch.tensor([r.slot for r, _ in batch])
        return {
            "input_ids": _i32(ids),
            "position_ids": _i32(positions),
            "use_cache": True,
            "last_token_ids": _i32(last),
            "kv_cache_params": kv,
            "attention_params": attention,
            "spec_decoding_params": spec,
            "draft_tokens": Tensor(data=torch.tensor(draft_tokens, dtype=torch.int32).reshape(batch_size, k)),
            "draft_lens": _i32(draft_lens),
            "eagle_temperature": Tensor(data=torch.tensor([r.temperature for r, _ in batch], dtype=torch.float32)),
            "rand_data_validation": Tensor(data=slots.validation[rows_of_slots]),
            "rand_data_sample": Tensor(data=slots.sample[rows_of_slots]),
            "host_gen_eagle_net_request_types": _host_i32([1] * batch_size),
            "host_gen_eagle_net_context_lengths": _host_i32(
                [b + 1 if t else b for b, t in zip(bounds, types, strict=True)]
            ),
            "host_gen_eagle_net_past_key_value_lengths": _host_i32(bounds),
        }

    def _chain_geometry(self) -> tuple[list[int], list[list[bool]]]:
        """Per node of the draft tree: its depth (position offset) and which nodes it may attend (ancestors)."""
        width = self.block
        depth = [0] * width
        ancestors = [[False] * width for _ in range(width)]
        for path in self.paths.tolist():
            for i, node in enumerate(path):
                if node < 0:
                    break
                depth[node] = i
                for a in path[: i + 1]:
                    ancestors[node][a] = True
        return depth, ancestors
