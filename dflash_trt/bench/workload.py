"""The requests a benchmark sends: a jsonl prompt file, or synthetic token prompts of controlled lengths.

Synthetic prompts (`ISL,OSL,COUNT`, as trtllm-bench's dataset tool makes them) are uniform random token ids drawn
with a fixed seed; their requests ignore end tokens so every one produces exactly OSL tokens. Prompt files stop at
the model's end tokens, like `dflash-trt generate`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trt.bench.driver import BenchRequest
from dflash_trt.errors import DFlashTrtError
from dflash_trt.prompts import read_prompts

# Shipped real-text prompts (math, code, chat, several languages; written for this project), for sweeps.
REAL_PROMPTS = "build_configs/calibration.jsonl"
SYNTHETIC_WARNING = (
    "warning: synthetic prompts are random token ids; a drafter accepts almost none of its drafts on them "
    "(acceptance near 1 instead of several tokens per step on real text), so speculative speedups measured on "
    f"them are far too low. Measure DFlash on real prompts, e.g. {REAL_PROMPTS} in the repository "
    "(bench --input_file, or a sweep config's dataset:)."
)


@dataclass(frozen=True)
class Synthetic:
    input_len: int
    output_len: int
    count: int


@dataclass(frozen=True)
class Workload:
    requests: list[BenchRequest]
    ignore_eos: bool
    description: dict[str, Any]

    @property
    def max_seq_len(self) -> int:
        return max(len(r.input_ids) + r.max_new_tokens for r in self.requests)

    def resized(self, count: int) -> Workload:
        """`count` requests, cycling through the prompts (a longer run, or a subset, of the same set)."""
        if count < 1:
            raise DFlashTrtError(f"the number of requests must be >= 1, got {count}")
        cycled = [self.requests[i % len(self.requests)] for i in range(count)]
        return Workload(cycled, self.ignore_eos, self.description | {"num_requests": count})


def parse_synthetic(text: str) -> Synthetic:
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 3 or min(values) < 1:
        raise DFlashTrtError(f"--synthetic must be ISL,OSL,COUNT with three positive integers, got {text!r}")
    return Synthetic(*values)


def synthetic_workload(spec: Synthetic, vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    requests = [
        BenchRequest(i, [rng.randrange(vocab_size) for _ in range(spec.input_len)], spec.output_len)
        for i in range(spec.count)
    ]
    description = {
        "kind": "synthetic",
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "count": spec.count,
        "vocab_size": vocab_size,
        "seed": seed,
    }
    return Workload(requests, ignore_eos=True, description=description)


def file_workload(
    path: str | Path,
    max_new_tokens: int,
    tokenizer=None,
    limit: int | None = None,
    chat_kwargs: dict[str, Any] | None = None,
) -> Workload:
    if max_new_tokens < 1:
        raise DFlashTrtError(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
    prompts = read_prompts(path, tokenizer, limit, chat_kwargs)
    requests = [BenchRequest(i, ids, max_new_tokens) for i, ids in enumerate(prompts)]
    description = {
        "kind": "file",
        "path": str(Path(path).resolve()),
        "count": len(requests),
        "max_new_tokens": max_new_tokens,
    }
    if chat_kwargs is not None:
        description["chat_template_kwargs"] = chat_kwargs
    return Workload(requests, ignore_eos=False, description=description)
