"""`dflash-trt emulate`: a batch of prompts through the emulated engine and its runtime loop (`executor.py`).

Requests arrive at given steps (0 = all at once), join when a slot is free and leave when they finish, exactly as
the executor schedules them for a server; this module only feeds the batch in and collects the results.
"""

from __future__ import annotations

from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.executor import EmulatedExecutor, Request
from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.decode import SequenceResult


class EmulatedRuntime(EmulatedEngine):
    """One engine and its runtime loop over a converted checkpoint, decoding a whole batch of prompts."""

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
        requests = [
            Request(i, list(p), n, float(t), s)
            for i, (p, n, t, s) in enumerate(zip(prompts, news, temperatures, seeds, strict=True))
        ]
        # A batch run (`emulate`, the parity tests) fails loudly: an engine error is a finding, not a request's luck.
        longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
        executor = EmulatedExecutor(self, longest, stop_token_ids, isolate_failures=False)
        for r in requests:
            executor.check(r)
        arriving = sorted(zip(arrivals, requests, strict=True), key=lambda pair: (pair[0], pair[1].index))
        step = 0
        try:
            while arriving or executor.has_work():
                while arriving and arriving[0][0] <= step:
                    executor.add(arriving.pop(0)[1])
                executor.step()
                step += 1
        finally:
            executor.close()
        return [SequenceResult(r.prompt, r.output, r.acceptance, r.steps) for r in requests]
