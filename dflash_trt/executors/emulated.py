"""The emulated EAGLE runtime: in-flight batching over the network, fed as docs/engine.md §3-§4 says 1.2.x does.

Requests are added and cancelled at any time; each `step` admits waiting requests into free slots (up to
`max_batch_size`), runs one network forward over the inputs `emulated_inputs.py` packs, and answers every request
that produced tokens with what it produced, as the executor's per-iteration responses do. The scheduler takes the
generation requests (each costs `K+1` tokens of `max_num_tokens`) and as many context tokens as remain, chunking a
prompt at a multiple of `tokens_per_block` when it does not fit. After a step: the accepted tokens (clipped at
`max_new_tokens` and at a stop token or stop word), the EAGLE KV rewind along the accepted path, the next drafts.

`EmulatedExecutor` serves the stepper from the worker thread (what a CPU-served Triton repository and `dflash-trt
serve --checkpoint_dir` answer with); `decode_batch` feeds a whole batch of prompts through it (`dflash-trt emulate`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from dflash_trt.decoding_modes import DFLASH
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.kv_pool import BlockManager, KVPool
from dflash_trt.emulation.paths import path_geometry, rewind_moves
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import Request, Response, failed
from dflash_trt.executors.emulated_inputs import Decoding, SamplingSlots, step_inputs
from dflash_trt.executors.worker import WorkerExecutor
from dflash_trt.inputs import check_fits_in_memory
from dflash_trt.reference.decode import SequenceResult, StepTrace
from dflash_trt.reference.loop_rules import check_request, keep_tokens, longest_request
from dflash_trt.sampling_rules import GREEDY, Sampling


class EngineStepFailed(Exception):
    """The engine raised `engine_error` during a step; the requests' state is as before the step."""

    def __init__(self, engine_error: Exception):
        super().__init__(f"{type(engine_error).__name__}: {engine_error}")
        self.engine_error = engine_error


class EmulatedStepper:
    """Requests in, per-iteration responses out, over one emulated engine and a KV pool sized for `max_seq_len`."""

    def __init__(
        self,
        engine: EmulatedEngine,
        max_seq_len: int,
        stop_token_ids: list[int] | None = None,
        isolate_failures: bool = True,
    ):
        holds = longest_request(engine.max_position_embeddings, engine.depth)
        if not 2 <= max_seq_len <= holds:
            raise DFlashTrtError(
                f"max_seq_len must be in 2..{holds} (the target's {engine.max_position_embeddings} positions less "
                f"the two blocks of {engine.depth} draft positions the last step reaches past a request's last token), "
                f"got "
                f"{max_seq_len}"
            )
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
        self.waiting: deque[Decoding] = deque()
        self.active: list[Decoding] = []

    def check(self, request_id: int, request: Request) -> None:
        """Refuse what the engine refuses, in one line naming the request (its sampling was checked when its
        `Sampling` was made)."""
        check_request(request_id, request.input_ids, request.max_new_tokens, self.engine.vocab_size, self.max_seq_len)

    def add(self, request_id: int, request: Request) -> Decoding:
        """Queue a request; it joins a free batch slot at the next step. Its `Decoding` fills as it decodes."""
        self.check(request_id, request)
        decoding = Decoding(request_id, request, paths=self.engine.paths)
        self.waiting.append(decoding)
        return decoding

    def cancel(self, request_id: int) -> None:
        """Drop request `request_id` wherever it is, freeing its slot and pages; nothing when it is not known."""
        for d in self.waiting:
            if d.request_id == request_id:
                self.waiting.remove(d)
                return
        for d in self.active:
            if d.request_id == request_id:
                d.finished = True
                self._leave(d)
                return

    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    def close(self) -> None:
        """Give the KV pool back (the pool registry holds it until then)."""
        self.pool.release()

    def step(self) -> list[Response]:
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
        except EngineStepFailed as failure:
            if not self.isolate_failures:
                raise failure.engine_error from None
            responses = [out for item in batch for out in self._run_alone(item)]
        for r in [r for r in self.active if r.finished]:
            self._leave(r)
        return responses

    def _run(self, batch: list[tuple[Decoding, int]]) -> list[Response]:
        """One engine step over `batch`; EngineStepFailed, with every request as before, when the engine raises."""
        restore = [(r, r.random.get_state(), self.slots.validation[r.slot].clone()) for r, _ in batch if r.generating]
        for r, rows in batch:
            # The target writes the step's rows, the draft pass a block right after the drafter context.
            end = r.prefilled + rows if not r.generating else r.anchor_position + rows
            self.blocks.ensure(r.request_id, end + self.engine.block)
            if r.generating:
                self.slots.draw_validation(r)
        try:
            outputs = self.engine.run(step_inputs(self.engine, batch, self.slots, self.blocks, self.pool), len(batch))
        except Exception as exc:  # whatever the network raised: the caller isolates the request that caused it
            for r, state, row in restore:
                r.random.set_state(state)
                self.slots.validation[r.slot] = row
            raise EngineStepFailed(exc) from exc
        responses = []
        for b, (r, rows) in enumerate(batch):
            drafts = rows - 1 if r.generating else None
            produced = self._advance(r, rows, b, outputs)
            if produced is not None:
                responses.append(Response(request_id=r.request_id, tokens=produced, final=r.finished, draft_len=drafts))
        return responses

    def _run_alone(self, item: tuple[Decoding, int]) -> list[Response]:
        """`item`'s step on its own; if the engine fails on it alone, the request ends with the engine's error."""
        try:
            return self._run([item])
        except EngineStepFailed as failure:
            r = item[0]
            r.finished = True
            return [failed(r.request_id, f"the engine failed on this request: {failure}")]

    def _leave(self, r: Decoding) -> None:
        self.blocks.release(r.request_id)
        self.slots.leave(r)
        self.active.remove(r)

    def _schedule(self) -> list[tuple[Decoding, int]]:
        """Generation requests first take their `draft_len + 1` tokens of `max_num_tokens`, then the prompts."""
        generation = [(r, r.draft_len + 1) for r in self.active if r.generating]
        budget = self.engine.max_num_tokens - sum(rows for _, rows in generation)
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
        return context + generation

    def _advance(self, r: Decoding, rows: int, b: int, out: dict[str, torch.Tensor]) -> list[int] | None:
        """Apply one step's outputs to request `r`: the tokens it produced, or None for a non-last prompt chunk."""
        next_drafts = out["next_draft_tokens"][b].tolist()
        next_len = int(out["next_draft_lens"][b])
        next_paths = out["next_draft_paths"][b].tolist()
        if not r.generating:
            r.prefilled += rows
            if not r.generating:
                return None  # a non-last chunk: the runtime ignores this step's tokens
            produced = self._append(r, [int(out["accepted_tokens"][b, 0])])
        else:
            n = int(out["num_accepted_tokens"][b])
            start = r.anchor_position
            sources, targets = rewind_moves(r.paths, int(out["accepted_paths"][b]), n)
            self.blocks.move_tokens(r.request_id, [start + i for i in sources], [start + i for i in targets])
            r.steps.append(self._trace(r, n - 1))
            produced = self._append(r, out["accepted_tokens"][b, :n].tolist())
            r.acceptance.append(len(produced))
        r.drafts, r.draft_len, r.paths = next_drafts, next_len, next_paths
        r.bound = len(r.prompt) + len(r.output) + self.engine.k
        return produced

    def _trace(self, r: Decoding, accepted: int) -> StepTrace:
        """The verified step as the golden loop records it: a tree's nodes with their parents, read off the paths
        (node i's row lists its path, so its parent is the entry before it)."""
        drafts = r.drafts[: r.draft_len]
        if not self.engine.tree:
            return StepTrace(drafts, accepted)
        depth, _ = path_geometry(r.paths, r.draft_len + 1)
        parents = [r.paths[node][depth[node] - 1] for node in range(1, r.draft_len + 1)]
        return StepTrace(drafts, accepted, parents, positions=self.engine.depth)

    def _append(self, r: Decoding, tokens: list[int]) -> list[int]:
        budget = r.request.max_new_tokens
        kept = keep_tokens(tokens, budget - len(r.output), self.stops, lambda new: self._ends_a_stop_word(r, new))
        r.output.extend(kept.tokens)
        if kept.stopped or len(r.output) >= budget:
            r.finished = True
        return kept.tokens

    @staticmethod
    def _ends_a_stop_word(r: Decoding, new: list[int]) -> bool:
        words = r.request.stop_words
        if not words:
            return False
        tail = r.output[-max(len(w) for w in words) :] + new
        return any(len(tail) >= len(w) and tuple(tail[-len(w) :]) == w for w in words)


class EmulatedExecutor(WorkerExecutor):
    """The emulated engine served from a worker thread; `max_batch_size` is the engine's (fixed when it loaded)."""

    def __init__(self, engine: EmulatedEngine, max_seq_len: int, stop_token_ids: list[int] | None = None):
        super().__init__(lambda: EmulatedStepper(engine, max_seq_len, stop_token_ids), DFLASH)
        self.engine = engine


def decode_batch(
    engine: EmulatedEngine,
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    stop_token_ids: list[int] | None = None,
    arrivals: list[int] | None = None,
    sampling: Sequence[Sampling] | None = None,
) -> list[SequenceResult]:
    """Decode every prompt, request i arriving at step `arrivals[i]` (0 = all at once) and sampling with
    `sampling[i]` (greedy when None); requests join when a slot is free and leave when they finish, exactly as the
    stepper schedules them for a server."""
    count = len(prompts)
    budgets = [max_new_tokens] * count if isinstance(max_new_tokens, int) else list(max_new_tokens)
    samplings = list(sampling) if sampling is not None else [GREEDY] * count
    if len(samplings) != count:
        raise DFlashTrtError(f"got {len(samplings)} sampling settings for {count} prompts")
    requests = [
        Request(input_ids=list(p), max_new_tokens=n, sampling=s)
        for p, n, s in zip(prompts, budgets, samplings, strict=True)
    ]
    # A batch run (`emulate`, the parity tests) fails loudly: an engine error is a finding, not a request's luck.
    longest = max(len(r.input_ids) + r.max_new_tokens for r in requests)
    stepper = EmulatedStepper(engine, longest, stop_token_ids, isolate_failures=False)
    for i, request in enumerate(requests):
        stepper.check(i, request)
    arriving = sorted(enumerate(arrivals or [0] * count), key=lambda pair: (pair[1], pair[0]))
    decodings: dict[int, Decoding] = {}
    step = 0
    try:
        while arriving or stepper.has_work():
            while arriving and arriving[0][1] <= step:
                i = arriving.pop(0)[0]
                decodings[i] = stepper.add(i, requests[i])
            stepper.step()
            step += 1
    finally:
        stepper.close()
    return [
        SequenceResult(requests[i].input_ids, decodings[i].output, decodings[i].acceptance, decodings[i].steps)
        for i in range(count)
    ]
