"""CPU executor: the golden model with in-flight batching, so benchmarks, sweeps and `serve` run anywhere.

Like TensorRT-LLM's batch manager, requests join and leave between steps: each step admits waiting requests into
free slots (context requests: prefill, first token, drafter context injected) and advances every running request by
one speculative iteration (draft a block, verify it, accept, inject), all rows in one target forward. Every step
answers each request it advanced with one response holding that iteration's tokens. The per-request arithmetic is
the reference loop's (`dflash_trt.reference.decode.speculative_generate`: greedy, the verify block shrinks near the
output budget, stop tokens end a request), so a request's tokens and acceptance lengths equal what the reference
loop gives for its prompt alone, whatever else is in flight; tests hold the two to that.

The stepper runs in the executor's worker thread (`worker.py`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from dflash_trt.decoding_modes import AR, DFLASH
from dflash_trt.draft_schedule import FIXED, DraftLenSchedule
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import Request, Response
from dflash_trt.executors.worker import WorkerExecutor
from dflash_trt.inputs import check_fits_in_memory
from dflash_trt.reference.decode import drafter_block
from dflash_trt.reference.loop_rules import check_request, keep_tokens
from dflash_trt.reference.model import GoldenModel
from dflash_trt.reference.sampling import exact_match_accept
from dflash_trt.sampling_rules import MIN_SAMPLING_TEMPERATURE


@dataclass
class _Running:
    request_id: int
    tokens: list[int]
    prompt_len: int
    max_length: int
    prefilled: bool = False
    draft_len: int = 0  # drafts its next step verifies: the schedule's for the load of its last step

    @property
    def start(self) -> int:
        """Position of the anchor: the newest token, not yet in the target's cache."""
        return len(self.tokens) - 1


@dataclass
class StepLog:
    """What one executor step batched: request ids in their context phase and in generation."""

    context: list[int] = field(default_factory=list)
    generation: list[int] = field(default_factory=list)


def cache_bytes(model: GoldenModel, batch: int, capacity: int) -> int:
    """What `new_cache` of the target and the drafter allocate together for `batch` sequences."""
    per_position = sum(
        2 * len(part.layers) * part.spec.num_key_value_heads * part.spec.head_dim
        for part in (model.target, model.draft)
    )
    return batch * capacity * per_position * model.target.embedding.element_size()


class GoldenStepper:
    """Greedy speculative decoding (block 1 = plain autoregressive) with requests joining and leaving per step."""

    def __init__(
        self,
        model: GoldenModel,
        max_batch_size: int,
        max_seq_len: int,
        block_size: int | None = None,
        stop_token_ids: list[int] | None = None,
        draft_len_schedule: DraftLenSchedule = FIXED,
    ):
        draft = model.draft
        self.model = model
        self.block = draft.spec.verify_width if block_size is None else block_size
        if not 1 <= self.block <= draft.spec.verify_width:
            raise DFlashTrtError(f"block size must be in 1..{draft.spec.verify_width}, got {self.block}")
        self.schedule = draft_len_schedule.fitted_to(self.block - 1) if self.block > 1 else FIXED
        if max_batch_size < 1:
            raise DFlashTrtError(f"max batch size must be >= 1, got {max_batch_size}")
        self.max_seq_len = max_seq_len
        capacity = max_seq_len + self.block + 1
        check_fits_in_memory(
            cache_bytes(model, max_batch_size, capacity),
            f"the CPU executor's KV caches ({max_batch_size} sequences x {capacity} positions)",
            "lower --max_batch_size or --concurrency, or shorten the requests",
        )
        self.target_cache = model.target.new_cache(max_batch_size, capacity)
        self.draft_cache = draft.new_cache(max_batch_size, capacity)
        self.slots: list[_Running | None] = [None] * max_batch_size
        self.waiting: deque[tuple[int, Request]] = deque()
        self.stops = set(stop_token_ids or [])
        self.log: list[StepLog] = []

    def add(self, request_id: int, request: Request) -> None:
        vocab = self.model.target.spec.vocab_size
        check_request(request_id, request.input_ids, request.max_new_tokens, vocab, self.max_seq_len)
        if request.sampling.temperature != 0:
            raise DFlashTrtError(
                f"the golden executor decodes greedily (temperature below {MIN_SAMPLING_TEMPERATURE:g}); the emulated "
                "engine samples"
            )
        if request.stop_words:
            raise DFlashTrtError(
                "the golden executor stops at its stop tokens only; the emulated engine takes stop words"
            )
        self.waiting.append((request_id, request))

    def cancel(self, request_id: int) -> None:
        """Forget `request_id`, queued or running; its slot takes the next request at the following step."""
        self.waiting = deque((i, r) for i, r in self.waiting if i != request_id)
        self.slots = [None if s is not None and s.request_id == request_id else s for s in self.slots]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def close(self) -> None:
        """Drop every request; the caches go with the executor."""
        self.waiting.clear()
        self.slots = [None] * len(self.slots)

    def _admit(self) -> None:
        for i, slot in enumerate(self.slots):
            if slot is None and self.waiting:
                request_id, request = self.waiting.popleft()
                tokens = list(request.input_ids)
                self.slots[i] = _Running(request_id, tokens, len(tokens), len(tokens) + request.max_new_tokens)

    @torch.no_grad()
    def step(self) -> list[Response]:
        """One iteration of every running request plus the prefill of newly admitted ones."""
        self._admit()
        running = {i: s for i, s in enumerate(self.slots) if s is not None}
        context = [i for i, s in running.items() if not s.prefilled]
        generation = [i for i, s in running.items() if s.prefilled]
        self.log.append(StepLog([running[i].request_id for i in context], [running[i].request_id for i in generation]))
        if not running:
            return []
        block_ids, start, verify = self._draft(running, generation)
        next_draft_len = self.schedule.draft_len(len(running), self.block - 1)
        # As wide as the longest verified block or prompt: a schedule's shorter drafts cost fewer target columns.
        width = max([int(verify.max())] + [running[i].prompt_len for i in context])
        offsets = torch.arange(width)
        tokens, positions, valid = self._target_inputs(running, context, generation, block_ids, start, verify, offsets)
        prefilling = torch.zeros(len(self.slots), dtype=torch.bool)
        prefilling[context] = True
        logits, taps = self.model.target.forward(tokens, positions, valid, self.target_cache, prefilling)

        produced = {i: [int(logits[i, running[i].prompt_len - 1].argmax())] for i in context}
        for i in generation:
            produced[i] = self._accept(block_ids[i], logits[i], int(verify[i]))
        injected = valid.clone()  # prompts whole; generation rows: the tokens produced this step (set below)
        responses = []
        for i, new in produced.items():
            s = running[i]
            kept = keep_tokens(new, s.max_length - len(s.tokens), self.stops)
            drafts = int(verify[i]) - 1 if s.prefilled else None
            if s.prefilled:
                injected[i] = offsets < len(kept.tokens)
            s.tokens.extend(kept.tokens)
            s.prefilled = True
            s.draft_len = next_draft_len
            final = kept.stopped or len(s.tokens) >= s.max_length
            responses.append(Response(request_id=s.request_id, tokens=kept.tokens, final=final, draft_len=drafts))
            if final:
                self.slots[i] = None
        if self.block > 1:
            self.model.draft.inject(taps, positions, injected, self.draft_cache)
        return responses

    def _draft(self, running: dict[int, _Running], generation: list[int]):
        """Block `[anchor, drafts...]` per generation row, its start position and how many of it get verified: the
        request's scheduled draft length + 1, fewer near the output budget (where the drafter sees a shorter block
        too), as in the reference loop. Other rows verify 1 dummy."""
        draft, block, rows = self.model.draft, self.block, len(self.slots)
        start = torch.zeros(rows, dtype=torch.long)
        verify = torch.ones(rows, dtype=torch.long)
        width = torch.ones(rows, dtype=torch.long)
        block_ids = torch.full((rows, block), draft.spec.mask_token_id, dtype=torch.long)
        for i in generation:
            s = running[i]
            start[i] = s.start
            width[i] = min(block, s.max_length - s.start)
            verify[i] = min(s.draft_len + 1, int(width[i]))
            block_ids[i, 0] = s.tokens[-1]
        if block > 1 and generation:
            anchors = block_ids[:, 0].clone()
            drafter_ids, drafter_valid = drafter_block(draft, anchors, block, width)
            hidden = draft.forward(drafter_ids, start, drafter_valid, self.draft_cache)
            block_ids[:, 1:] = draft.choose(hidden, anchors).tokens()[:, : block - 1]
        return block_ids, start, verify

    def _target_inputs(self, running, context, generation, block_ids, start, verify, offsets):
        """One ragged target batch: verify blocks and whole prompts side by side; padding is invalid and sits at
        in-range positions so it never widens the attention span."""
        rows, width, block = len(self.slots), len(offsets), self.block
        tokens = torch.zeros(rows, width, dtype=torch.long)
        positions = torch.zeros(rows, width, dtype=torch.long)
        valid = torch.zeros(rows, width, dtype=torch.bool)
        for i in generation:
            tokens[i, : min(block, width)] = block_ids[i, :width]
            positions[i] = start[i] + offsets.clamp(max=block - 1)
            valid[i] = offsets < verify[i]
        for i in context:
            prompt = running[i].tokens
            tokens[i, : len(prompt)] = torch.tensor(prompt)
            positions[i] = offsets.clamp(max=len(prompt) - 1)
            valid[i] = offsets < len(prompt)
        return tokens, positions, valid

    @staticmethod
    def _accept(block_ids: torch.Tensor, logits: torch.Tensor, verify: int) -> list[int]:
        """The golden loop's rule at temperature 0: the longest draft prefix the target agrees with, plus the
        target's own next token (the caller clips it to the output budget). Greedy: the uniforms are never read."""
        drafts = block_ids[1:verify]
        accepted, bonus = exact_match_accept(drafts, logits[:verify], 0.0, torch.zeros(verify))
        return drafts[:accepted].tolist() + [bonus]


class GoldenExecutor(WorkerExecutor):
    """The golden stepper served from a worker thread (`dflash-trt bench --checkpoint_dir`)."""

    def __init__(
        self,
        model: GoldenModel,
        max_batch_size: int,
        max_seq_len: int,
        *,
        block_size: int | None = None,
        stop_token_ids: list[int] | None = None,
        draft_len_schedule: DraftLenSchedule = FIXED,
    ):
        block = model.draft.spec.verify_width if block_size is None else block_size
        super().__init__(
            lambda: GoldenStepper(model, max_batch_size, max_seq_len, block_size, stop_token_ids, draft_len_schedule),
            DFLASH if block > 1 else AR,
        )
